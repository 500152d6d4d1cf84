"""What a run shows in TensorBoard's HPARAMS tab: one row per run, the same columns for every task.

TensorBoard's hparams plugin takes the table's columns (hyper-parameters and metrics) from the
``_hparams_/experiment`` record of *one* run in the log directory, whichever it finds first, and
shows the other runs only under those columns. So every run writes the same hyper-parameter
columns, whatever its task or head: :data:`COMPONENT_COLUMNS` and one ``head/<argument>`` column
per size argument a registered head declares (:func:`heads.registry.register_head`). Without a
common schema a mixture of tasks or heads shows the columns of whichever run is read first.

The metrics are each task's own names (``val/ppl``, ``val/bleu``, ``val/CIDEr-D``, ``val/acc@1``
and their ``test/`` twins; :attr:`tasks.base.HeadTask.hparams_metrics`), written by
:meth:`tasks.base.HeadTask.log_hparams` through ``TensorBoardLogger.log_hyperparams``.
"""

from __future__ import annotations

import inspect
from typing import Any

from heads.registry import head_class, head_entry, list_heads

#: The columns every run has: the data (its class and number of classes, the vocabulary size of a
#: text task), the networks before the head (class names) and the size of what they hand the head
#: (``d``), and the head's registered short name.
COMPONENT_COLUMNS = ("data", "data/num_classes", "encoder", "encoder/out_features", "head")


def head_argument_columns() -> list[str]:
    """``head/<argument>`` for every size argument a registered head declares (``num_components``,
    ``num_experts``, ``num_gates``), sorted: the head's key arguments, one column each."""
    arguments = {head_entry(name).size_argument for name in list_heads()}
    return sorted(f"head/{argument}" for argument in arguments if argument is not None)


def configured_argument(spec: Any, argument: str) -> Any:
    """The value of a head constructor ``argument`` as configured: the spec's ``init_args`` entry,
    else the constructor's default; ``None`` when the head has no such argument."""
    init_args = spec.get("init_args") or {} if isinstance(spec, dict) else {}
    if argument in init_args:
        return init_args[argument]
    class_path = spec.get("class_path") if isinstance(spec, dict) else spec
    if not isinstance(class_path, str):
        return None
    parameter = inspect.signature(head_class(class_path).__init__).parameters.get(argument)
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def hparams_columns(head_name: str, head_spec: Any, networks: list[Any], out_features: int,
                    data_name: str, num_classes: int) -> dict[str, Any]:
    """One run's HPARAMS row: :data:`COMPONENT_COLUMNS` and every :func:`head_argument_columns`
    entry (0 for an argument the run's head does not take, so each column keeps one number type).

    Args:
        head_name: the head's registered short name.
        head_spec: the head as configured (short name, or ``class_path`` + ``init_args``).
        networks: the modules before the head (encoder; decoder), named in the ``encoder`` column.
        out_features: the size of the hidden state the head reads.
        data_name: the datamodule's class name.
        num_classes: the number of classes (vocabulary size).
    """
    row: dict[str, Any] = {
        "data": data_name,
        "data/num_classes": int(num_classes),
        "encoder": "+".join(type(network).__name__ for network in networks),
        "encoder/out_features": int(out_features),
        "head": head_name,
    }
    for column in head_argument_columns():
        value = configured_argument(head_spec, column.partition("/")[2])
        row[column] = int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
    return row
