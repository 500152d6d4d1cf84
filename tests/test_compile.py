"""torch.compile: the tasks' ``compile`` option (through the real CLI), graph breaks of each
head's forward counted with ``torch._dynamo.explain``, and compiled gradients equal to eager ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo as dynamo

from heads.registry import create_head
from tasks.base import compile_options
from tasks.encoders import AWDLSTMEncoder
from tasks.language_model import LanguageModel
from tests.shell import run_app, run_cli

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = str(ROOT / "configs/lm/synthetic.yaml")
N, G, V = 24, 16, 60
SIZES = {"softmax": None, "mos": 3, "mixtape": 4, "ds_softmax": None}

#: Graph breaks of one training forward (autograd on, train mode) and of ``log_prob`` under
#: ``no_grad``, after one eager forward has filled the heads' structure caches.
#: DS-Softmax: 2, both at ``torch.unique(expert).tolist()`` in its forward, where the tokens are
#: grouped by their chosen expert so each one pays only for that expert's kept classes (the
#: method's sparsity, Liao et al. 2019 §2.2): which experts receive tokens, and how many, is data,
#: so the shapes after it are too. Its ``log_prob`` compiles through the traceable path written
#: for torch.export. Softmax, MoS and Mixtape have none.
EXPECTED_BREAKS = {
    ("softmax", "forward"): 0, ("softmax", "log_prob"): 0,
    ("mos", "forward"): 0, ("mos", "log_prob"): 0,
    ("mixtape", "forward"): 0, ("mixtape", "log_prob"): 0,
    ("ds_softmax", "forward"): 2,
}


def tiny_head(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    kwargs = {"num_experts": 4} if name == "ds_softmax" else {}
    return create_head(name, G, V, size=SIZES[name], **kwargs).train()


def inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    target = torch.randint(0, V, (N,), generator=generator)
    target[[3, 7]] = -100  # ignored tokens: the compiled path scores no row differently
    return torch.randn(N, G, generator=generator), target


@pytest.mark.parametrize(("name", "path"), sorted(EXPECTED_BREAKS))
def test_graph_breaks_of_each_head(name, path):
    head = tiny_head(name)
    hidden, target = inputs()
    hidden.requires_grad_()
    head(hidden, target)  # eager pass: fills structure caches (DS row views), as in a real run
    dynamo.reset()
    if path == "forward":
        explained = dynamo.explain(lambda h, t: head(h, t))(hidden, target)
    else:
        with torch.no_grad():
            explained = dynamo.explain(lambda h: head.log_prob(h))(hidden.detach())
    reasons = [f"{r.reason.splitlines()[0]} at {r.user_stack[-1].filename}:{r.user_stack[-1].lineno}"
               for r in explained.break_reasons if r.user_stack]
    assert explained.graph_break_count == EXPECTED_BREAKS[name, path], reasons


@pytest.mark.parametrize("name", ["softmax", "mos", "mixtape"])
@pytest.mark.parametrize("weighted", [False, True], ids=["mean", "per-token-weights"])
def test_compiled_head_matches_eager_values_and_gradients(name, weighted):
    """Same NLL and gradients compiled as eager, for a mean (MoS scales the gradients it computed
    ahead) and for per-token weights (MoS makes a second pass), with ignored targets in the batch."""
    eager, compiled = tiny_head(name), tiny_head(name)
    compiled.compile(backend="aot_eager")  # the autograd graph torch.compile builds, without codegen
    hidden, target = inputs()
    weights = torch.rand(N, generator=torch.Generator().manual_seed(2)) if weighted else torch.full((N,), 1.0 / N)
    results = []
    for head in (eager, compiled):
        h = hidden.clone().requires_grad_()
        nll = head(h, target)
        (nll * weights).sum().backward()
        results.append((nll.detach(), h.grad, [p.grad for p in head.parameters()]))
    (nll_e, grad_e, params_e), (nll_c, grad_c, params_c) = results
    assert torch.allclose(nll_e, nll_c, atol=1e-5), (nll_e - nll_c).abs().max()
    assert torch.allclose(grad_e, grad_c, atol=1e-5), (grad_e - grad_c).abs().max()
    for a, b in zip(params_e, params_c):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_compile_option_compiles_the_encoder_and_the_head_in_place():
    """``compile`` wraps the forward of the task's modules (here through a backend that records
    the graphs it receives); the state-dict keys, which checkpoints hold, do not change."""
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    plain = LanguageModel(40, encoder=AWDLSTMEncoder, head="mos", tie_weights=False)
    model = LanguageModel(40, encoder=AWDLSTMEncoder, head="mos", tie_weights=False, compile={"backend": recording_backend})
    model.load_state_dict(plain.state_dict())
    plain.eval(), model.eval()  # no dropout: the two must agree
    model.configure_model()
    assert list(model.state_dict()) == list(plain.state_dict())
    tokens = torch.randint(0, 40, (2, 5))
    target = torch.randint(0, 40, (2, 5))
    expected = plain.head(plain.encode(tokens)[0], target)
    got = model.head(model.encode(tokens)[0], target)
    assert graphs, "nothing was compiled"
    assert torch.allclose(got, expected, atol=1e-5)
    assert "compile" not in model.hparams  # a run-time choice: a checkpoint never turns it on


def test_bad_compile_option_is_one_line_from_the_shell(tmp_path):
    done = run_cli(["fit", "--config", SYNTHETIC, "--trainer.default_root_dir", str(tmp_path),
                    "--model.init_args.compile", "{backend: nope}"])
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(errors) == 1, done.stderr
    assert "which torch.compile refuses: Invalid backend: 'nope'" in errors[0], errors[0]
    assert "(fix model.init_args.compile)" in errors[0]
    assert not list(tmp_path.iterdir()), "a refused option writes nothing"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"speed": 11}, "got unknown key(s) speed"),
        ({"mode": "fastest"}, "which torch.compile refuses: Unrecognized mode=fastest"),
        ("fast", "needs compile to be true, false or a mapping"),
    ],
)
def test_bad_compile_options_name_the_rule_and_the_fix(value, message):
    with pytest.raises(ValueError) as info:
        compile_options(value, "LanguageModel")
    assert message in str(info.value) and "(fix model.init_args.compile)" in str(info.value)
    assert "\n" not in str(info.value)


TINY = [
    "--config", SYNTHETIC, "--config", str(ROOT / "configs/heads/mos.yaml"),
    "--model.init_args.encoder.init_args.embedding_dim", "16", "--model.init_args.encoder.init_args.hidden_size", "24",
    "--model.init_args.encoder.init_args.last_hidden_size", "16", "--model.init_args.tie_weights", "false",
    "--data.init_args.vocab_size", "60", "--data.init_args.train_tokens", "3000",
    "--data.init_args.valid_tokens", "600", "--data.init_args.test_tokens", "600",
    "--data.init_args.batch_size", "4", "--data.init_args.eval_batch_size", "3", "--data.init_args.bptt", "8",
    "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
    "--trainer.limit_test_batches", "1", "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
]


@pytest.mark.slow
def test_fit_compiled_from_the_shell_then_test_its_checkpoint_eagerly(tmp_path):
    """``fit --model.init_args.compile true`` (inductor, a minute or more of compilation on a CPU),
    then ``test --ckpt_path`` without it: the checkpoint loads into the eager model."""
    dirs = ["--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]
    fitted = run_app(["fit", *TINY, *dirs, "--model.init_args.compile", "true"], timeout=900)
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    checkpoints = sorted(tmp_path.rglob("last.ckpt"))
    assert checkpoints, "fit wrote no checkpoint"
    tested = run_cli(["test", *TINY, *dirs, "--ckpt_path", str(checkpoints[0])])
    assert tested.returncode == 0, tested.stderr[-3000:]
    assert "test/ppl" in tested.stdout + tested.stderr
