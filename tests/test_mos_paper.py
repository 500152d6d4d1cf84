"""MoS as its paper trains it, and evaluated without training work:

* evaluation (``no_grad`` / ``inference_mode``) of MoS, the SigSoftmax mixture and
  Hybrid-LightRNN-MoS computes no gradients ahead (the chunked kernel's speculative gradient
  matmuls) and gives the same NLL as a forward that records autograd;
* variational dropout on the context vectors (the MoS paper's "context vector V-dropout",
  Table 8): one mask per sequence, shared over its time steps; the LM preset turns it on.
"""

from __future__ import annotations

import pytest
import torch
import yaml

import heads.mixture_kernel
from heads import MixtureOfSoftmaxes, SigSoftmax, create_head
from heads.registry import head_factory
from tests.shell import ROOT

IN, V = 12, 30


@pytest.fixture
def gradient_passes(monkeypatch):
    """Counts the chunked kernel's passes that compute gradients (``token_weight`` given)."""
    calls = {"gradient": 0, "nll_only": 0}
    original = heads.mixture_kernel._mixture_pass

    def counting(*args):
        calls["nll_only" if args[-1] is None else "gradient"] += 1
        return original(*args)

    monkeypatch.setattr(heads.mixture_kernel, "_mixture_pass", counting)
    return calls


def mixture_heads():
    torch.manual_seed(0)
    return {
        "mos": MixtureOfSoftmaxes(IN, V, num_components=3, embedding_dim=6, chunk_size=8),
        "sigsoftmax-mixture": SigSoftmax(IN, V, num_components=3, embedding_dim=6, chunk_size=8),
        "hybrid-lightrnn-mos": create_head(
            "hybrid_lightrnn", IN, V, num_exclusive=4,
            inner=head_factory("mos", num_components=3, chunk_size=8),
        ),
    }


@pytest.mark.parametrize("name", ["mos", "sigsoftmax-mixture", "hybrid-lightrnn-mos"])
def test_evaluation_does_no_gradient_work_and_gives_the_same_nll(name, gradient_passes):
    head = mixture_heads()[name].eval()
    hidden, target = torch.randn(4, 5, IN), torch.randint(0, V, (4, 5))
    recorded = head(hidden, target)  # autograd records: gradients computed ahead, in the same pass
    assert gradient_passes["gradient"] > 0
    for context in (torch.no_grad, torch.inference_mode):
        gradient_passes["gradient"] = 0
        with context():
            evaluated = head(hidden, target)
        assert gradient_passes["gradient"] == 0, f"{name} computed gradients under {context.__name__}"
        assert torch.equal(evaluated, recorded.detach()), f"{name}: evaluation NLL differs"
    recorded.sum().backward()  # and training still gets its gradients
    assert all(p.grad is not None for p in head.parameters() if p.requires_grad and p.numel())


def test_evaluation_is_cheaper_than_a_recorded_forward():
    """The cost the speculative gradients added: an evaluation forward of MoS-15 does about half
    the arithmetic of a recorded forward (which computes the gradients ahead). Counted with
    PyTorch's FLOP counter, not timed: the speed itself is `bench heads`' evaluation column."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    head = MixtureOfSoftmaxes(64, 2000, num_components=15).eval()
    hidden, target = torch.randn(8, 16, 64), torch.randint(0, 2000, (8, 16))
    flops = {}
    for kind in ("eval", "recorded"):
        with torch.set_grad_enabled(kind == "recorded"), FlopCounterMode(display=False) as counter:
            head(hidden, target)
        flops[kind] = counter.get_total_flops()
    assert 0 < flops["eval"] < 0.6 * flops["recorded"], flops


def repeated_sequence_batch(B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every time step of a sequence has the same hidden state and target."""
    g = torch.randn(B, 1, IN).expand(B, T, IN)
    return g, torch.randint(0, V, (B, 1)).expand(B, T)


def test_variational_dropout_shares_one_mask_over_a_sequences_time_steps():
    torch.manual_seed(0)
    B, T = 6, 7
    hidden, target = repeated_sequence_batch(B, T)
    head = MixtureOfSoftmaxes(IN, V, num_components=3, dropout=0.5, variational_dropout=True).train()
    nll = head(hidden, target)  # (B, T)
    assert torch.allclose(nll, nll[:, :1].expand(B, T)), "a sequence's time steps saw different masks"
    assert not torch.allclose(nll[0], nll[1]), "sequences share one mask"
    log_p = head.log_prob(hidden)  # (B, T, V): same mask over time in log_prob too
    assert torch.allclose(log_p, log_p[:, :1].expand_as(log_p))
    per_token = MixtureOfSoftmaxes(IN, V, num_components=3, dropout=0.5).train()
    per_token.load_state_dict(head.state_dict())
    nll = per_token(hidden, target)
    assert not torch.allclose(nll, nll[:, :1].expand(B, T)), "per-token dropout draws one mask per token"
    head.eval()
    nll_eval = head(hidden, target)
    assert torch.equal(nll_eval, head(hidden, target)), "no dropout in evaluation"


def test_variational_dropout_keeps_the_expected_context():
    """Inverted dropout: the mask's mean is 1 (kept units scaled by 1 / (1 - p))."""
    torch.manual_seed(0)
    head = MixtureOfSoftmaxes(IN, V, num_components=3, embedding_dim=5, dropout=0.3, variational_dropout=True).train()
    mask = head.context_mask(torch.randn(400, 2, IN))
    assert mask.shape == (800, 3, 5)
    assert torch.equal(mask[0::2], mask[1::2])
    assert abs(mask.mean().item() - 1.0) < 0.05
    assert torch.allclose(mask.unique(), torch.tensor([0.0, 1 / 0.7]))


def test_lm_mos_preset_uses_variational_context_dropout(tmp_path):
    """configs/heads/mos.yaml (the LM preset) sets the paper's variational dropout; the CLI builds it."""
    from app.main import main
    from tests.test_cli import TINY_LM, TINY_SYNTHETIC, run_dirs

    preset = yaml.safe_load((ROOT / "configs/heads/mos.yaml").read_text())
    assert preset["model"]["init_args"]["head"]["init_args"]["variational_dropout"] is True
    cli = main(["--config", str(ROOT / "configs/lm/synthetic.yaml"), "--config", str(ROOT / "configs/heads/mos.yaml"),
                *TINY_LM, *TINY_SYNTHETIC, *run_dirs(tmp_path)], run=False)
    assert isinstance(cli.model.head, MixtureOfSoftmaxes) and cli.model.head.variational_dropout


def test_bad_variational_dropout_is_one_line():
    with pytest.raises(ValueError, match=r"variational_dropout to be true or false, got 'yes' \(set head.init_args"):
        MixtureOfSoftmaxes(IN, V, variational_dropout="yes")
