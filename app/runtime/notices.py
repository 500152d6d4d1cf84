"""Lightning notices that do not apply to the project's runs, silenced by their exact text.

Each filter names one message and the module that emits it, and says why the project makes it
moot; anything else a library or the user's code warns about is shown as usual.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, Iterator

#: A promotion Lightning logs at every Trainer start.
PROMOTION = "💡 Tip: For seamless cloud logging"


class _DropPromotion(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(PROMOTION)


def quiet_lightning_notices() -> None:
    """Silence, for this process, the notices every command would print and none can act on:

    * Lightning's logging-service tip (an advertisement, not a notice about the run);
    * ``isinstance(treespec, LeafSpec)`` is deprecated, ``torch.distributed.nn.functional.all_gather``
      is deprecated: PyTorch deprecating APIs that Lightning's own code calls (its pytree helper,
      its ``all_gather`` under DDP); nothing in the run can change them.
    """
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropPromotion) for f in logger.filters):
            logger.addFilter(_DropPromotion())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            module=r"lightning\.pytorch\.utilities\._pytree")
    warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_gather is deprecated",
                            module=r"lightning\.fabric\.utilities\.distributed")


def quiet_iterable_length_notice(datamodule: Any) -> None:
    """Silence Lightning's warning that an ``IterableDataset`` with ``__len__`` may be counted
    wrong with several workers, when the datamodule is one of the project's: its token streams
    refuse more than one worker (``datamodules/lm.py``) and its token batches are sharded per
    worker (``datamodules/translation/batching.py``). A user's own datamodule keeps the warning."""
    if type(datamodule).__module__.split(".")[0] == "datamodules":
        warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined",
                                module=r"lightning\.pytorch\.utilities\.data")


#: The commands that evaluate a checkpoint (``--ckpt_path``) without training it.
EVALUATIONS = ("validate", "test", "predict")


@contextlib.contextmanager
def quiet_unrestored_callbacks_notice(subcommand: str | None) -> Iterator[None]:
    """While ``validate|test|predict`` runs, silence Lightning's notice that the checkpoint holds
    the states of callbacks the Trainer lacks ("Be aware that when using `ckpt_path`, callbacks
    used to create the checkpoint need to be provided ...", e.g. a DS-Softmax run's ``Mitosis``,
    ``GroupLassoPruning``, ``LoadBalancing``, ``SparsityTracker``): those states are training
    bookkeeping (stages, pruning steps, running loads) that an evaluation never uses, and it
    restores none of the run's training state on purpose (``TopKAndLastCheckpoint.evaluating``,
    :meth:`app.cli.WorkbenchCLI.instantiate_trainer`). ``fit --ckpt_path`` resumes them: there
    the notice stands."""
    if subcommand not in EVALUATIONS:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Be aware that when using `ckpt_path`, callbacks used to create the checkpoint",
                                category=UserWarning, module=r"lightning\.pytorch\.trainer\.call")
        yield
