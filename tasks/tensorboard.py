"""What a run shows in TensorBoard's HPARAMS tab: one row per run, the same columns for every task.

TensorBoard's hparams plugin takes the table's columns (hyper-parameters and metrics) from the
``_hparams_/experiment`` record of *one* run in the log directory, whichever it finds first, and
shows the other runs only under those columns. So every run writes the same hyper-parameter
columns, whatever its task or head: :data:`COMPONENT_COLUMNS` and one ``head/<argument>`` column
per size argument a registered head declares (:func:`heads.registry.register_head`). Without a
common schema a mixture of tasks or heads shows the columns of whichever run is read first.

The metrics are each task's own names (``val/ppl``, ``val/bleu``, ``val/CIDEr-D``, ``val/acc@1``
and their ``test/`` twins; :attr:`tasks.base.HeadTask.hparams_metrics`), written by
:meth:`tasks.base.HeadTask.log_hparams` through ``TensorBoardLogger.log_hyperparams``. The
experiment record lists them for the same reason: the metric columns of every task
(:func:`metric_columns`), so a log directory holding runs of several tasks shows each one's.
"""

from __future__ import annotations

from typing import Any

from heads.registry import head_entry, list_heads

#: The columns every run has: the data (its class and number of classes, the vocabulary size of a
#: text task), the networks before the head (class names) and the size of what they hand the head
#: (``d``), and the head's registered short name.
COMPONENT_COLUMNS = ("data", "data/num_classes", "encoder", "encoder/out_features", "head")


def metric_columns(metrics_by_task: list[tuple[str, ...]]) -> list[str]:
    """The HPARAMS metric columns of runs of all tasks, given each task's ``hparams_metrics``:
    validation before test; each task's first (headline) metric before the others, so the five
    columns TensorBoard shows before the user ticks more hold every task's headline."""
    names: list[str] = []
    for rank in range(max((len(m) for m in metrics_by_task), default=0)):
        for metrics in metrics_by_task:
            if rank < len(metrics) and metrics[rank] not in names:
                names.append(metrics[rank])
    return [f"{stage}/{name}" for stage in ("val", "test") for name in names]


def experiment_summary(row: dict[str, Any], metrics: list[str]) -> Any:
    """The ``_hparams_/experiment`` summary of ``row``'s columns and the ``metrics`` names (the
    record TensorBoard takes the table's columns from), as ``torch.utils.tensorboard`` builds it."""
    from torch.utils.tensorboard.summary import hparams

    experiment, _, _ = hparams(row, {name: 0.0 for name in metrics})  # values are not part of it
    return experiment


def head_argument_columns() -> list[str]:
    """``head/<argument>`` for every size argument a registered head declares (``num_components``,
    ``num_experts``, ``num_gates``), sorted: the head's key arguments, one column each."""
    arguments = {head_entry(name).size_argument for name in list_heads()}
    return sorted(f"head/{argument}" for argument in arguments if argument is not None)


def configured_argument(head: Any, spec: Any, argument: str) -> Any:
    """The value of the head's size ``argument`` (the one it registered): the configured one (the
    spec's ``init_args``; DS-Softmax's ``num_experts`` grows by mitosis, the configured count is the
    hyper-parameter), else the head's attribute of that name; ``None`` for another argument."""
    if getattr(type(head), "size_argument", None) != argument:
        return None
    init_args = (spec.get("init_args") or {}) if isinstance(spec, dict) else {}
    if argument in init_args:
        return init_args[argument]
    keywords = getattr(spec, "keywords", None)  # a functools.partial of the head class, from Python
    if isinstance(keywords, dict) and argument in keywords:
        return keywords[argument]
    return getattr(head, argument, None)


def hparams_columns(head: Any, head_name: str, head_spec: Any, networks: list[Any], data_name: str) -> dict[str, Any]:
    """One run's HPARAMS row: :data:`COMPONENT_COLUMNS` and every :func:`head_argument_columns`
    entry (0 for an argument the run's head does not take, so each column keeps one number type).

    Args:
        head: the task's head (:class:`heads.base.OutputHead`): its input size and number of classes.
        head_name: the head's registered short name.
        head_spec: the head as configured (short name, ``class_path`` + ``init_args``, a factory).
        networks: the modules before the head (encoder; decoder), named in the ``encoder`` column.
        data_name: the datamodule's class name.
    """
    row: dict[str, Any] = {
        "data": data_name,
        "data/num_classes": int(head.num_classes),
        "encoder": "+".join(type(network).__name__ for network in networks),
        "encoder/out_features": int(head.in_features),
        "head": head_name,
    }
    for column in head_argument_columns():
        value = configured_argument(head, head_spec, column.partition("/")[2])
        row[column] = int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
    return row
