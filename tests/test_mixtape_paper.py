"""Mixtape as §3 / §3.4 of the paper write it: Gaussian noise added once to each pre-activation
gate prior, biases on the Eq. 4 gate matmuls, and state dicts saved without those biases still
loading as the model they were trained as."""

from __future__ import annotations

import math

import pytest
import torch

from heads import Mixtape

IN, V = 8, 40
SIGMA = 1.0


def probe_head(frequent_fraction: float) -> Mixtape:
    """A K = 2 head whose frequent logits read the injected gate noise back exactly.

    Every noise-free pre-activation prior is 0 (gate weights, embeddings and biases zero); the
    two context vectors are the constants ``h_1 = 0.5`` and ``h_2 = 0`` (1-wide) and every class
    embedding is 2, so a token's logit is ``sigmoid(l) * 1 + (1 - sigmoid(l)) * 0 = sigmoid(l)``
    with ``l`` its noisy pre-activation prior: ``logit(logit_x)`` is the noise on token ``x``.
    """
    head = Mixtape(IN, V, num_gates=2, embedding_dim=1, gate_dim=3, frequent_fraction=frequent_fraction,
                   gate_noise=SIGMA, bias=False).double().train()
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.context.bias[0] = math.atanh(0.5)
        head.decoder.weight.fill_(2.0)
    return head


def injected_noise(head: Mixtape, draws: int, grad: bool) -> torch.Tensor:
    """``(draws, V)`` noise on each token's pre-activation prior, one training forward per row.

    ``grad`` picks the path: with autograd the frequent block is recomputed in the backward
    (``_RecomputedFrequent``), without it the gate logits are formed directly."""
    torch.manual_seed(0)
    g = torch.zeros(draws, IN, dtype=torch.float64, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        p = head.flat_logits(g).detach()  # (draws, V) = sigmoid(l + noise)
    return torch.log(p) - torch.log1p(-p)


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad-path", "recomputed-path"])
def test_gate_noise_is_added_once_and_independently_per_frequent_token(grad):
    """Frequent tokens: std sigma and no correlation across tokens (the noise was added twice,
    once on the shared u_k . g and again per token: std sqrt(2) sigma, correlation 0.5).
    Shared-gate tokens: one draw of std sigma for their one shared prior (Eq. 6)."""
    head = probe_head(frequent_fraction=0.5)
    S = head.num_frequent
    noise = injected_noise(head, 4000, grad)  # (draws, V)
    frequent, rest = noise[:, :S], noise[:, S:]
    std = frequent.std().item()
    corr = torch.corrcoef(frequent.t())  # (S, S)
    off_diagonal = corr[~torch.eye(S, dtype=torch.bool)].mean().item()
    assert abs(std - SIGMA) < 0.05, f"frequent tokens' injected noise std {std:.3f}, expected {SIGMA}"
    assert abs(off_diagonal) < 0.05, f"frequent tokens' noise correlation {off_diagonal:.3f}, expected 0"
    assert abs(rest.std().item() - SIGMA) < 0.05
    assert torch.allclose(rest, rest[:, :1].expand_as(rest)), "shared-gate tokens share one prior and its noise"


def test_no_gate_noise_in_eval():
    head = probe_head(frequent_fraction=0.5).eval()
    assert injected_noise(head, 50, grad=False).abs().max() < 1e-12


def test_gate_matmuls_have_biases_that_move_the_gates():
    """§3.4: biases on the Eq. 4 matmuls, tanh(U_k g + a_k) and u_k . g + e_k."""
    head = Mixtape(IN, V, num_gates=4, gate_dim=3, frequent_fraction=0.5).double().eval()
    assert head.gate_projection.bias.shape == (3 * 3,) and head.shared_gate.bias.shape == (3,)
    hidden = torch.randn(5, IN, dtype=torch.float64)
    before = head.log_prob(hidden)
    for name in ("gate_projection", "shared_gate"):
        with torch.no_grad():
            getattr(head, name).bias.fill_(0.7)
        assert not torch.allclose(head.log_prob(hidden), before), f"{name}.bias has no effect"
        with torch.no_grad():
            getattr(head, name).bias.zero_()
