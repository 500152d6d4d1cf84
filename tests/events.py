"""A run's TensorBoard output read back as TensorBoard reads it: scalars, images and the HPARAMS
record (``_hparams_/experiment`` and ``_hparams_/session_start_info``), for the tests of the four
tasks that inspect the log directory of a run they already make."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from tasks.base import all_hparams_metrics
from tasks.tensorboard import COMPONENT_COLUMNS, head_argument_columns, metric_columns


def read_events(log_dir: str | Path) -> EventAccumulator:
    events = EventAccumulator(str(log_dir), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    return events


@dataclass
class HParams:
    """One run's HPARAMS row: its columns (name -> value), the metric columns of the table and
    the values the row shows in them (the last scalar of each one the run logged)."""

    columns: dict[str, str | float]
    metrics: list[str]
    shown: dict[str, float]


def read_hparams(events: EventAccumulator) -> HParams:
    content = events.PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    columns = {name: value.string_value if value.HasField("string_value") else value.number_value
               for name, value in start.hparams.items()}
    assert sorted(columns) == sorted(info.name for info in experiment.hparam_infos)
    metrics = [info.name.tag for info in experiment.metric_infos]
    scalars = set(events.Tags()["scalars"])
    return HParams(columns, metrics, {name: events.Scalars(name)[-1].value for name in metrics if name in scalars})


def check_hparams(log_dir: str | Path, head: str, data: str, metrics: list[str]) -> HParams:
    """The run's HPARAMS row has the columns every task writes (the head's short name among them,
    no internal key), the table lists every task's metrics, and the row shows the task's HPARAMS
    ``metrics``, whose values are the task's own scalars (written once per step, not again for
    HPARAMS)."""
    events = read_events(log_dir)
    hparams = read_hparams(events)
    assert sorted(hparams.columns) == sorted([*COMPONENT_COLUMNS, *head_argument_columns()]), hparams.columns
    assert not [name for name in hparams.columns if name.startswith("_") or "class_path" in name or "optimizer" in name]
    assert hparams.columns["head"] == head and hparams.columns["data"] == data, hparams.columns
    assert hparams.columns["data/num_classes"] > 0 and hparams.columns["encoder/out_features"] > 0
    assert "hp_metric" not in events.Tags()["scalars"]
    assert hparams.metrics == metric_columns(all_hparams_metrics())
    assert set(metrics) <= set(hparams.shown) and all(name.startswith("val/") for name in hparams.shown), hparams.shown
    for name in metrics:
        steps = [p.step for p in events.Scalars(name)]
        assert steps and len(steps) == len(set(steps)), f"{name}: the task's own values, each step once, got steps {steps}"
    return hparams


def group_order(tags: list[str]) -> list[str]:
    """Tag groups (first ``/`` segment) in the order TensorBoard's Scalars and Time Series views
    show them: by character code (its ``compareTagNames``, which only treats digits and ``/``
    specially; the groups compared here hold neither)."""
    return sorted({tag.split("/", 1)[0] for tag in tags})
