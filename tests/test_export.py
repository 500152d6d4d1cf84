"""Heads export their inference path (heads/export.py, ``python -m app convert export``).

What is proved: every registered head's ``log_prob`` and ``topk`` go through ``torch.export`` with
a free batch size and the program answers what the eager head answers (DS-Softmax's sparse
``topk`` included, which did not export: ``int(expert)``, ``bincount(...).tolist()`` and a loop over
the used experts); DS-Softmax's exported ``topk`` is its dense restriction's top-k; the command
writes a program from a run's checkpoint that ``torch.export.load`` reads back to the head's own
outputs, for softmax, MoS, Mixtape and DS-Softmax; bad inputs are one error line and write nothing.
"""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

import pytest
import torch

from app.checkpoint_io import restore
from app.main import main
from app.tools import run_tool
from heads.ds.build import pruned_head, random_kept_mask
from heads.export import export_head
from heads.registry import available_heads, create_head
from tests.conftest import TinyConfig
from tests.shell import ROOT, one_error_line, run_cli

D, V = 16, 40


def roundtrip(program: torch.export.ExportedProgram) -> torch.nn.Module:
    """The program saved and loaded back, as a user of the file gets it."""
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    return torch.export.load(buffer).module()


def assert_same(got, want, what: str) -> None:
    got, want = (got,) if isinstance(got, torch.Tensor) else got, (want,) if isinstance(want, torch.Tensor) else want
    for a, b in zip(got, want):
        assert a.shape == b.shape, (what, a.shape, b.shape)
        if a.dtype.is_floating_point:
            diff = (a - b).nan_to_num(posinf=0, neginf=0).abs().max().item()
            assert torch.equal(a.isinf(), b.isinf()) and diff < 1e-5, f"{what}: max difference {diff}"
        else:
            assert torch.equal(a, b), f"{what}: indices differ"


def sparse_ds_head(seed: int = 0):
    """A pruned DS-Softmax: 6 experts, each class kept by 1.5 of them on average (some keep < 10)."""
    generator = torch.Generator().manual_seed(seed)
    keep = random_kept_mask(6, V, 1.5, generator)
    gate = torch.randn(6, D, generator=generator)
    return pruned_head(keep, gate, rows=torch.randn(int(keep.sum()), D, generator=generator), class_bias=torch.randn(V, generator=generator)).eval()


@pytest.mark.parametrize("name", available_heads())
def test_every_registered_head_exports_log_prob_and_topk(name):
    head = create_head(name, D, V).eval()
    hidden = torch.randn(9, D)
    with torch.no_grad():  # weights away from their start (zero biases, a uniform prior) so every part counts
        for p in head.parameters():
            p.normal_(0, 0.3)
    for method, k in (("log_prob", 0), ("topk", 7)):
        program = roundtrip(export_head(head, method, k or 1))
        for batch in (hidden, hidden[:1]):
            want = head.log_prob(batch) if method == "log_prob" else head.topk(batch, k)
            assert_same(program(batch), want, f"{name}.{method} on {batch.shape[0]} contexts")


def test_ds_exported_sparse_topk_is_the_dense_restrictions_topk_and_leaves_the_eager_head_working():
    """Exactness: the exported sparse topk ranks the chosen expert's kept classes as the head's own
    dense restriction (``pruned_in_softmax=False``: every class the chosen expert pruned at -inf)
    does; an expert with fewer than k classes fills the rest with index -1 at -inf. Tracing touches
    none of the eager path's caches: the head answers as before afterwards."""
    head = sparse_ds_head()
    assert int(head.rows_per_expert().min()) < 10  # some expert keeps fewer classes than k asks
    hidden = torch.randn(64, D)
    eager = head.topk(hidden, 10), head.topk(hidden[:1], 10)  # builds the caches first
    program = roundtrip(export_head(head, "topk", 10))
    assert_same(head.topk(hidden, 10), eager[0], "eager batch topk after export")
    assert_same(head.topk(hidden[:1], 10), eager[1], "eager single topk after export")
    values, indices = program(hidden)
    head.pruned_in_softmax = False
    dense_values, dense_indices = head.log_prob(hidden).topk(10, dim=-1)
    finite = dense_values.isfinite()
    assert torch.equal(indices[finite], dense_indices[finite])
    assert torch.equal(indices[~finite], torch.full_like(indices[~finite], -1)) and (~finite).any()
    assert torch.allclose(values[finite], dense_values[finite], atol=1e-5)
    assert values[~finite].eq(-torch.inf).all()


# ------------------------------------------------------------------------- the command
#: The shared tiny config of configs/lm/synthetic.yaml with 60 words and 16 hidden features.
TINY = [*TinyConfig().args("configs/lm/synthetic.yaml"), "--data.init_args.vocab_size", "60",
        "--model.init_args.encoder.init_args.last_hidden_size", "16", "--model.init_args.tie_weights", "false"]
HEADS = {
    "softmax": [],
    "mos": ["--model.init_args.head", "heads.MoS", "--model.init_args.head.init_args.num_components", "3"],
    "mixtape": ["--config", str(ROOT / "configs/heads/mixtape.yaml"), "--model.init_args.head.init_args.gate_dim", "8"],
    "ds": ["--config", str(ROOT / "configs/heads/ds_softmax.yaml")],
}


_CHECKPOINTS: dict[str, Path] = {}


def checkpoint(name: str, tmp_path_factory) -> Path:
    """A tiny run's last.ckpt with head ``name``, trained in this process once per test session
    (the command under test is export, not fit)."""
    if name not in _CHECKPOINTS:
        out = tmp_path_factory.mktemp(name)
        main(["fit", *TINY, *HEADS[name], *TinyConfig.dirs(out), "--checkpoint.dirpath", str(out / "ckpt")])
        _CHECKPOINTS[name] = out / "ckpt" / "last.ckpt"
    return _CHECKPOINTS[name]


def export(args: list[str]) -> subprocess.CompletedProcess:
    """``python -m app convert export ARGS`` as the shell sees it (in-process, :func:`tests.shell.run_cli`)."""
    return run_cli(["convert", "export", *args])


@pytest.mark.parametrize(
    "name, method, k",
    [("ds", "topk", 5)] + [pytest.param(*case, marks=pytest.mark.slow) for case in
                           (("softmax", "topk", 5), ("mos", "topk", 5), ("mixtape", "topk", 5), ("ds", "log_prob", 1), ("mos", "log_prob", 1))],
)
def test_convert_export_writes_a_program_that_reproduces_the_checkpoints_head(name, method, k, tmp_path, tmp_path_factory):
    """``python -m app convert export`` on a run's checkpoint: the file loads with torch.export.load
    and answers what the restored head answers, for a batch and for one context. (DS-Softmax's
    sparse topk in the default suite; softmax, MoS, Mixtape and log_prob with -m slow: each trains a
    run and exports.)"""
    ckpt = checkpoint(name, tmp_path_factory)
    output = tmp_path / f"{name}-{method}.pt2"
    result = export(["--ckpt_path", str(ckpt), "--output", str(output), "--method", method, "--k", str(k)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"wrote {output}" in result.stdout
    head = restore(str(ckpt), data=False)[0].head.eval()
    program = torch.export.load(str(output)).module()
    for hidden in (torch.randn(6, 16), torch.randn(1, 16)):
        want = head.log_prob(hidden) if method == "log_prob" else head.topk(hidden, k)
        assert_same(program(hidden), want, f"{name} {method} on {hidden.shape[0]} contexts")


def test_convert_export_bad_inputs_are_one_line_and_write_nothing(tmp_path, tmp_path_factory):
    """Unknown method, k beyond the vocabulary, a checkpoint without a head: one line naming the
    value, the rule and the fix, nothing written. (The shell's view, exit code 2 and no traceback,
    for the first; the others through the tool's entry, which raises the line the shell prints.)"""
    ckpt = checkpoint("ds", tmp_path_factory)
    headless = tmp_path / "headless.ckpt"
    torch.save({"state_dict": {"encoder.weight": torch.zeros(2, 2)}, "hyper_parameters": {}}, headless)
    output = str(tmp_path / "out.pt2")
    one_error_line(export(["--ckpt_path", str(ckpt), "--method", "predict", "--output", output]),
                   "unknown export method 'predict'", "log_prob, topk", "--method")
    cases = [
        (["--ckpt_path", str(ckpt), "--k", "61"], ("k=61", "num_classes=60", "--k")),
        (["--ckpt_path", str(headless)], ("holds no output head", str(headless))),
    ]
    for args, fragments in cases:
        with pytest.raises(ValueError) as error:
            run_tool("convert", ["export", *args, "--output", output])
        assert "\n" not in str(error.value) and all(f in str(error.value) for f in fragments), str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["headless.ckpt"]


def test_a_head_over_code_inputs_is_refused_in_one_line():
    """HybridLightRNNCodes needs the network for a word distribution: refused before tracing."""
    from heads.export import export_head
    from heads.lightrnn import HybridLightRNNCodes

    with pytest.raises(ValueError) as error:
        export_head(HybridLightRNNCodes(8, 30, num_exclusive=5), "topk", 3)
    assert str(error.value) == ("HybridLightRNNCodes reads codes, so its word distribution needs the network, not one hidden "
                                "state: it cannot be exported alone (export an output-only heads.HybridLightRNN model instead)")
