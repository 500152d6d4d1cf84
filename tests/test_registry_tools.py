"""The registry is the only list of heads: the demo and every bench take their names and per-head
defaults from what each head declared at ``register_head``, so a head registered here (no tool
edited) is in their selections and runs in ``bench heads``; bad declarations and unknown names are
one-line errors listing what exists."""

from __future__ import annotations

import pytest

import app.bench.heads as bench_heads
import app.bench.translation as bench_translation
import app.bench.workloads as bench_workloads
import app.demo as demo
from heads import Softmax
from heads import registry
from heads.registry import COMPARED_FAMILIES, available_heads, head_entry, list_heads, register_head


@pytest.fixture
def tiny_head(monkeypatch):
    """A head registered the way a user's would be, on a copy of the registry dropped after the test."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @register_head("tiny_softmax", family="bottleneck")
    class TinySoftmax(Softmax):
        """A softmax under another name: any class on the contract would do."""

    return "tiny_softmax"


def test_list_heads_filters_what_each_head_declared():
    assert sorted(list_heads()) == available_heads()
    assert list_heads()[0] == "softmax"  # the baseline every comparison divides by comes first
    assert list_heads("bottleneck") == ["softmax", "moc", "mos", "mixtape", "sigsoftmax"]
    assert list_heads("clustered") == ["adaptive_softmax"]
    assert list_heads(COMPARED_FAMILIES) == ["softmax", "adaptive_softmax", "moc", "mos", "mixtape", "sigsoftmax"]  # beside softmax
    assert list_heads(("bottleneck", "sparse"), trainable=True) == [*list_heads("bottleneck"), "ds_softmax"]
    assert list_heads(trainable=False) == ["svd_softmax"]
    assert head_entry("mos").bench_size == 15 and head_entry("ds_softmax").size_argument == "num_experts"


def test_every_tool_takes_its_heads_from_the_registry():
    assert [v for v in bench_heads.all_variants() if not v.endswith("-reference")] == list_heads(COMPARED_FAMILIES)
    assert bench_heads.parse_args([]).heads is None  # None: all_variants() at run time
    assert bench_workloads.train_heads() == list_heads((*COMPARED_FAMILIES, "sparse"), trainable=True)
    assert bench_workloads.default_specs() == ["softmax", "adaptive_softmax", "moc", "mos:15", "mixtape", "sigsoftmax", "ds_softmax:64"]
    assert bench_translation.bench_heads()[: len(list_heads())] == list_heads()
    assert demo.default_heads() == list_heads(COMPARED_FAMILIES, trainable=True)
    assert set(demo.demo_heads()) <= set(list_heads(trainable=True))


def test_a_head_registered_outside_the_tools_is_in_their_selections_and_runs(tiny_head, capsys):
    assert tiny_head in bench_heads.all_variants()
    assert tiny_head in bench_workloads.train_heads() and tiny_head in bench_workloads.default_specs()
    assert tiny_head in bench_translation.bench_heads()
    assert tiny_head not in demo.demo_heads()  # the demo also needs configs/heads/tiny_softmax.yaml
    assert bench_heads.main(["--tiny", "--threads", "1", "--repeats", "1", "--no-memory", "--heads", f"softmax,{tiny_head}"]) == 0
    assert f"| {tiny_head} |" in capsys.readouterr().out
    assert bench_workloads.make_head(f"{tiny_head}", 8, 20, 8).num_classes == 20


def test_unknown_names_are_one_line_listing_the_registered_heads(capsys):
    with pytest.raises(ValueError, match=r"^unknown head 'nope' in --heads: valid are softmax, adaptive_softmax, moc, mos, mixtape, "
                                         r"sigsoftmax, ds_softmax, hybrid_lightrnn$"):
        demo.main(["--heads", "softmax", "nope"])
    with pytest.raises(ValueError, match=r"^unknown head 'nope': valid names are adaptive_softmax, ds_softmax, hybrid_lightrnn, .*svd_softmax$"):
        head_entry("nope")
    with pytest.raises(ValueError, match=r"^unknown head family 'dense': valid are bottleneck, clustered, sparse, encoding$"):
        list_heads("dense")
    with pytest.raises(SystemExit):
        bench_translation.main(["--heads", "softmax,nope"])
    assert "unknown head 'nope' in --heads: valid are softmax, adaptive_softmax, moc, mos," in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"family": "dense"}, "head 'x': family must be one of bottleneck, clustered, sparse, encoding or None, got 'dense'"),
        ({"bench_size": 4}, "head 'x': bench_size=4 needs a size_argument for it to set"),
    ],
)
def test_bad_declarations_are_refused_where_the_head_registers(kwargs, message):
    with pytest.raises(ValueError) as info:
        register_head("x", **kwargs)
    assert str(info.value) == message
