"""Heads and networks export their inference path (heads/export.py, ``python -m app convert export``).

What is proved: every registered head's ``log_prob`` and ``topk`` go through ``torch.export`` with
a free batch size, and the program answers what the eager head answers, saved as ``.pt2`` and
loaded back, and translated to ONNX by torch's dynamo-based exporter and run in onnxruntime
(within 1e-5), DS-Softmax with experts that receive no contexts included (its sparse ``topk`` did
not export: ``int(expert)``, ``bincount(...).tolist()`` and a loop over the used experts; its
``log_prob`` failed in onnxruntime for an empty expert); DS-Softmax's exported ``topk`` is its dense
restriction's top-k; a language model's network with its head (token ids and state in) answers in
onnxruntime as the eager model; the command writes a file from a run's checkpoint that loads back
to the model's own outputs, and refuses in one line, writing nothing, a file that answers
differently (the TorchScript exporter's DS-Softmax graph is such a file) and bad inputs.
"""

from __future__ import annotations

import functools
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.checkpoint_io import restore
from app.convert import export as convert_export
from app.main import main
from app.tools import run_tool
from heads.ds.build import pruned_head, random_kept_mask
from heads.export import (
    TOLERANCE, HeadInference, difference, export_head, flat_tensors, load_program, onnx_model, output_names,
)
from heads.registry import available_heads, create_head
from tasks import LanguageModel
from tasks.encoders import AWDLSTMEncoder, TransformerLMEncoder
from tasks.language_model import NextTokenInference, export_network
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


def sparse_ds_head(seed: int = 0, num_experts: int = 6):
    """A pruned DS-Softmax: 6 experts, each class kept by 1.5 of them on average (some keep < 10)."""
    generator = torch.Generator().manual_seed(seed)
    keep = random_kept_mask(num_experts, V, 1.5, generator)
    gate = torch.randn(num_experts, D, generator=generator)
    return pruned_head(keep, gate, rows=torch.randn(int(keep.sum()), D, generator=generator), class_bias=torch.randn(V, generator=generator)).eval()


def onnx_session(program: torch.export.ExportedProgram, method: str):
    """The program through torch's dynamo-based ONNX exporter, run in onnxruntime (flat outputs)."""
    return load_program(onnx_model(program, ["hidden"], output_names(method)), "onnx")


def assert_close_in_onnxruntime(run, eager, inputs, what: str) -> None:
    with torch.no_grad():
        diff = difference(run(*inputs), flat_tensors(eager(*inputs)))
    assert diff <= TOLERANCE, f"{what}: max difference {diff} from eager in onnxruntime"


@pytest.mark.parametrize("name", available_heads())
def test_every_registered_head_exports_log_prob_and_topk_to_pt2_and_onnx(name, caplog):
    """One program per method, saved as .pt2 and loaded back, and translated to ONNX and run in
    onnxruntime: both answer as the eager head within the tolerance the command checks, for a
    batch and for one context. The exporter's notes on its own translation ("Skipping constant
    folding for op Split ...", "Attribute type is ambiguous ...") are not logged."""
    caplog.set_level("WARNING")
    head = create_head(name, D, V).eval()
    hidden = torch.randn(9, D)
    with torch.no_grad():  # weights away from their start (zero biases, a uniform prior) so every part counts
        for p in head.parameters():
            p.normal_(0, 0.3)
    if name == "ds_softmax":  # one context leaves an expert without any (the exported path must allow it)
        assert head.route(hidden[:1])[0].unique().numel() < head.num_experts
    for method, k in (("log_prob", 0), ("topk", 7)):
        exported = export_head(head, method, k or 1)
        program, session = roundtrip(exported), onnx_session(exported, method)
        for batch in (hidden, hidden[:1]):
            want = head.log_prob(batch) if method == "log_prob" else head.topk(batch, k)
            assert_same(program(batch), want, f"{name}.{method} on {batch.shape[0]} contexts")
            assert_close_in_onnxruntime(session, HeadInference(head, method, k or 1), (batch,), f"{name}.{method} ONNX")
    notes = [r.getMessage() for r in caplog.records if r.name.split(".")[0] in ("onnx_ir", "onnxscript")]
    assert not [m for m in notes if m.startswith(("Skipping constant folding", "Attribute type is ambiguous"))], notes


@pytest.mark.parametrize("fast", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["log_prob", "log_prob-and-topk"])
def test_ds_onnx_answers_as_eager_when_experts_receive_no_contexts(fast):
    """A pruned DS-Softmax (experts of different sizes, a class bias) in onnxruntime: log_prob and
    topk equal the eager head's while some experts receive no context (one context leaves all but
    one empty; onnxruntime refused the empty update of log_prob before its indices were expanded,
    heads/ds/head.py). (log_prob in the default suite, where the registry test runs topk with an
    empty expert; both with -m slow.)"""
    head = sparse_ds_head(num_experts=3)
    hidden = torch.randn(2, D, generator=torch.Generator().manual_seed(0))
    for batch in (hidden, hidden[:1]):
        assert head.route(batch)[0].unique().numel() < head.num_experts  # some expert receives no row
    for method, k in (("log_prob", 1), ("topk", 10))[:1 if fast else 2]:
        session = onnx_session(export_head(head, method, k), method)
        for batch in (hidden, hidden[:1]):
            assert_close_in_onnxruntime(session, HeadInference(head, method, k), (batch,), f"ds {method} on {batch.shape[0]}")


def test_the_torchscript_exporters_ds_graph_is_refused_in_one_line():
    """The known-bad path: the TorchScript-based exporter traces DS-Softmax's eager log_prob with
    the routing of its example frozen: a file that answers wrong for another batch, or fails
    when the routing counts change. The command's check refuses such a file in one line before
    anything is written."""
    head = create_head("ds_softmax", D, V, num_experts=4).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    module = HeadInference(head, "log_prob", 1)
    buffer = io.BytesIO()
    torch.onnx.export(module, (torch.randn(7, D),), buffer, dynamo=False, input_names=["hidden"],
                      dynamic_axes={"hidden": {0: "N"}})
    session = load_program(buffer.getvalue(), "onnx")
    samples = [(torch.randn(n, D, generator=torch.Generator().manual_seed(n)),) for n in (7, 1)]  # 7: the traced size
    with pytest.raises(ValueError) as error:
        convert_export.verify(session, module, samples, "head log_prob of DSSoftmax")
    message = str(error.value)
    assert "\n" not in message and "nothing written" in message, message
    assert "differs from the eager model by" in message or "fails on a" in message, message


# ------------------------------------------------------------------------- the network with its head
def tiny_language_model(encoder, head: str = "ds_softmax") -> LanguageModel:
    """A language model of 30 words with a tiny encoder and ``head``, weights away from their start."""
    torch.manual_seed(0)
    model = LanguageModel(30, encoder=encoder, head=head, tie_weights=False, eval_topk=(1,)).eval()
    with torch.no_grad():
        for p in model.head.parameters():
            p.normal_(0, 0.3)
    return model


AWD_LSTM = functools.partial(AWDLSTMEncoder, embedding_dim=8, hidden_size=12, num_layers=2, last_hidden_size=D)
TRANSFORMER = functools.partial(TransformerLMEncoder, embedding_dim=D, num_layers=1, num_heads=2, feedforward_dim=24, max_length=12)


@pytest.mark.slow
@pytest.mark.parametrize("encoder, method, k", [
    pytest.param(AWD_LSTM, "topk", 5, id="awd_lstm-topk"), pytest.param(AWD_LSTM, "log_prob", 1, id="awd_lstm-log_prob"),
    pytest.param(TRANSFORMER, "topk", 5, id="transformer-topk"), pytest.param(TRANSFORMER, "log_prob", 1, id="transformer-log_prob"),
])
def test_language_model_network_with_its_head_in_onnxruntime(encoder, method, k):
    """Token ids and state in, log-probs / top-k and the new state out: the LM's whole network with
    a DS-Softmax head answers in onnxruntime as the eager model does, for one stream (experts left
    empty) and three, from a carried state (AWD-LSTM, window fixed) or over windows of any length
    (Transformer). (Slow: the default suite exports a checkpoint's LSTM network with a DS-Softmax
    head to ONNX through the command.)"""
    model = tiny_language_model(encoder)
    module = NextTokenInference(model, method, k)
    stateless = module.encoder.max_length is not None
    program = export_network(model, method, k, window=3)
    names = ["tokens", *(f"state_{i}" for i in range(len(flat_tensors(module.example_inputs(1, 3)[1]))))]
    run = load_program(onnx_model(program, names, output_names(method) + tuple(f"next_{n}" for n in names[1:])), "onnx")
    for batch, window in ((1, 3), (3, 3)) + (((2, 1), (2, 7)) if stateless else ()):
        inputs = module.example_inputs(batch, window, seed=batch)
        assert_close_in_onnxruntime(run, module, inputs, f"{method} of {batch} streams x {window} tokens")


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
    "name, method, k, part, suffix",
    [("ds", "topk", 5, "head", ".onnx"), ("ds", "log_prob", 1, "network", ".onnx")]
    + [pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("ds", "topk", 5, "head", ".pt2"), ("softmax", "topk", 5, "head", ".onnx"), ("mos", "topk", 5, "head", ".pt2"),
        ("mixtape", "topk", 5, "head", ".onnx"), ("ds", "log_prob", 1, "head", ".onnx"), ("mos", "log_prob", 1, "head", ".pt2"),
        ("mixtape", "topk", 5, "network", ".onnx"), ("softmax", "topk", 5, "network", ".pt2"))],
)
def test_convert_export_writes_a_file_that_reproduces_the_checkpoints_model(name, method, k, part, suffix, tmp_path, tmp_path_factory):
    """``python -m app convert export`` on a run's checkpoint: the file (ONNX run in onnxruntime,
    or a program loaded by torch.export.load) answers what the restored model answers, for a batch
    and for one context (DS-Softmax experts then receive no context): the head alone from hidden
    states, or the network with its head from token ids and the LSTM state. (DS-Softmax to ONNX in
    the default suite; the other heads and the .pt2 files with -m slow: each trains a run and exports.)"""
    ckpt = checkpoint(name, tmp_path_factory)
    output = tmp_path / f"{name}-{method}{suffix}"
    result = export(["--ckpt_path", str(ckpt), "--output", str(output), "--method", method, "--k", str(k), "--part", part])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == "", result.stderr[-3000:]  # no exporter notes, no warning
    assert f"wrote {output}" in result.stdout and "max difference from eager" in result.stdout, result.stdout
    assert ("onnxruntime" if suffix == ".onnx" else "torch.export.load") in result.stdout
    model = restore(str(ckpt), data=False)[0].eval()
    run = load_program(output.read_bytes(), suffix[1:])
    if part == "head":
        eager = HeadInference(model.head, method, k)
        samples = [(torch.randn(6, 16),), (torch.randn(1, 16),)]
    else:
        eager = NextTokenInference(model, method, k)
        samples = [eager.example_inputs(3, 1, seed=3), eager.example_inputs(1, 1, seed=1)]
    for inputs in samples:
        assert_close_in_onnxruntime(run, eager, inputs, f"{name} {part} {method} from {suffix} on {tuple(inputs[0].shape)}")


def test_convert_export_bad_inputs_are_one_line_and_write_nothing(tmp_path, tmp_path_factory):
    """Unknown method, format or part, k beyond the vocabulary, a checkpoint without a head, an
    output suffix that names no format or contradicts --format, an empty window: one line naming the
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
        (["--ckpt_path", str(ckpt), "--output", str(tmp_path / "out.bin")], ("out.bin names no export format", ".onnx or .pt2", "--format")),
        (["--ckpt_path", str(ckpt), "--format", "onnx"], ("--format onnx", "ends in .pt2", "matching")),
        (["--ckpt_path", str(ckpt), "--format", "tflite"], ("unknown export format 'tflite'", "onnx, pt2", "--format")),
        (["--ckpt_path", str(ckpt), "--part", "encoder"], ("unknown export part 'encoder'", "head, network", "--part")),
        (["--ckpt_path", str(ckpt), "--part", "network", "--window", "0"], ("--window must be >= 1", "got 0")),
    ]
    for args, fragments in cases:
        with pytest.raises(ValueError) as error:
            run_tool("convert", ["export", "--output", output, *args])
        assert "\n" not in str(error.value) and all(f in str(error.value) for f in fragments), str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["headless.ckpt"]


def test_convert_export_refuses_a_file_that_answers_differently_and_writes_nothing(tmp_path, tmp_path_factory, monkeypatch):
    """The command's check on the bytes it is about to write: a file whose answers are off by 1e-4
    (loaded through a perturbing loader in place of torch.export.load) is one error line naming the
    difference and the tolerance, and nothing is written."""
    ckpt = checkpoint("ds", tmp_path_factory)
    load = convert_export.load_program

    def perturbed(data, file_format):
        run = load(data, file_format)
        return lambda *inputs: tuple(t + 1e-4 if t.is_floating_point() else t for t in run(*inputs))

    monkeypatch.setattr(convert_export, "load_program", perturbed)
    with pytest.raises(ValueError) as error:
        run_tool("convert", ["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "head.pt2"), "--method", "log_prob"])
    message = str(error.value)
    assert "\n" not in message and "differs from the eager model by 0.0001 > 1e-05" in message and "nothing written" in message, message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_without_onnxruntime_the_onnx_file_is_written_and_says_it_was_not_run(tmp_path, tmp_path_factory, monkeypatch):
    """onnxruntime missing (the ``export`` extra half installed): the ONNX file is still written,
    the program it was translated from is what was checked, and the last line says so. (Slow: one
    more export to ONNX.)"""
    ckpt = checkpoint("ds", tmp_path_factory)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    output = tmp_path / "head.onnx"
    result = export(["--ckpt_path", str(ckpt), "--output", str(output), "--k", "3"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert output.is_file() and "in torch.export.load (not run in onnxruntime: pip install 'headbench[export]'" in result.stdout, result.stdout


def test_a_head_over_code_inputs_is_refused_in_one_line():
    """HybridLightRNNCodes needs the network for a word distribution: refused before tracing."""
    from heads.export import export_head
    from heads.lightrnn import HybridLightRNNCodes

    with pytest.raises(ValueError) as error:
        export_head(HybridLightRNNCodes(8, 30, num_exclusive=5), "topk", 3)
    assert str(error.value) == ("HybridLightRNNCodes reads codes, so its word distribution needs the network, not one hidden "
                                "state: it cannot be exported alone (export an output-only heads.HybridLightRNN model instead)")
