"""Mixtape (Yang, Luong, Salakhutdinov & Le, NeurIPS 2019, "Mixtape: Breaking the Softmax
Bottleneck Efficiently", §3).

Mixtape mixes ``K`` context vectors in *logit* space with token-dependent gates, so only one
softmax over the vocabulary is needed:

    h_k          = tanh(H_k g + c_k)                                    (Eq. 5)
    l_{x,k}      = v_x . tanh(U_k g + a_k) + u_k . g + e_k + b_{x,k}    (Eq. 4, k < K)
    pi_{x,.}     = sigmoid tree over l_{x,1..K-1}                       (Eq. 3)
    logit_x      = sum_k pi_{x,k} h_k . w_x + b_x                        (vector gating)
    p(x | g)     = softmax(logit)_x                                     (Eq. 2; Eq. 1 is the factorisation H W^T = A + shift)

Because the gates depend on the token, ``logit`` is not a linear function of one ``d``-vector
and the rank bound of the softmax does not apply.

*Gate sharing* (Eq. 6). Only the ``S = round(r V)`` most frequent tokens get their own gate
logits; every other token uses ``l_k = u_k . g``, the same for all of them. For those tokens
``sum_k pi_k h_k . w_x = (sum_k pi_k h_k) . w_x``: the context vectors are mixed with the shared
prior first and multiplied by the class embeddings once, so no per-token gate logits are ever
formed for them. This is why the head **requires class ids sorted by decreasing frequency**
(``requires_frequency_order = True``): ids ``0 .. S-1`` must be the frequent tokens. Every
datamodule of this project delivers such vocabularies.

The sigmoid tree is generalised from the paper's ``K = 4`` to any ``K = 2^m``: ``K - 1`` gate
logits sit on the internal nodes of a complete binary tree of depth ``m`` (heap order, root
first); ``pi_k`` is the product along the root-to-leaf path of ``sigmoid(l)`` for a left turn and
``sigmoid(-l) = 1 - sigmoid(l)`` for a right turn, so the ``K`` priors sum to one by construction.

*Biases* (§3.4: "we also add biases to the matrix multiplication operations in Eq. (2), (4) and (5)"):
``c_k`` on the context matmul (Eq. 5), ``a_k`` on ``U_k g`` and ``e_k`` on ``u_k . g`` (Eq. 4), ``b_x``
on the class embeddings (Eq. 2); ``b_{x,k}`` is Eq. 4's own per-token gate bias. ``a_k`` and ``e_k``
start at zero.

*Gate noise* (§3.4: Gaussian noise "on the pre-activation priors l_*"): added once per training
forward pass to each pre-activation prior, after all its terms are summed: an independent draw for
every frequent token's ``l_{x,k}`` and one draw for the shared ``l_k = u_k . g + e_k`` of the
infrequent tokens (Eq. 6 gives them one prior, so they share its noise).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.base import IGNORE_INDEX, OutputHead, at_least_fp32
from heads.fused_nll import fusable, linear_nll
from heads.registry import register_head
from heads.sigmoid_tree import sigmoid_tree, tree_mix  # noqa: F401  (sigmoid_tree: public here too)
from heads.validation import (
    check_dropout,
    check_fraction,
    check_nonnegative,
    check_positive_int,
    check_positive_or_none,
    check_power_of_two,
)


def frequent_gate_logits(gate_hidden: Tensor, gate_embedding: Tensor, shared_logit: Tensor, gate_bias: Tensor) -> Tensor:
    """Pre-activation gate priors of the frequent tokens, ``v_x . tanh(U_k g) + u_k . g + b_{x,k}`` (Eq. 4).

    Shape:
        gate_hidden ``(n, K-1, d2)``, gate_embedding ``(S, d2)``, shared_logit ``(n, K-1)``, gate_bias
        ``(S, K-1)`` -> ``(n, K-1, S)``.
    """
    return gate_hidden @ gate_embedding.t() + (shared_logit.unsqueeze(-1) + gate_bias.t())


def frequent_logits(
    contexts: Tensor, weight_frequent: Tensor, gate_hidden: Tensor, gate_embedding: Tensor, shared_logit: Tensor,
    gate_bias: Tensor, noise: Tensor | None = None,
) -> Tensor:
    """Gated logits of the frequent tokens, ``sum_k pi_{x,k} h_k . w_x`` (Eqs. 2-4), without bias.

    Shape:
        contexts ``(n, K, d)``, weight_frequent ``(S, d)``, gate_hidden ``(n, K-1, d2)``, gate_embedding
        ``(S, d2)``, shared_logit ``(n, K-1)``, gate_bias ``(S, K-1)``, noise ``(n, K-1, S)`` -> ``(n, S)``.
    """
    gate_logit = frequent_gate_logits(gate_hidden, gate_embedding, shared_logit, gate_bias)  # (n, K-1, S)
    if noise is not None:
        gate_logit = gate_logit + noise
    return tree_mix(contexts @ weight_frequent.t(), gate_logit)  # (n, S)


class _RecomputedFrequent(torch.autograd.Function):
    """:func:`frequent_logits` whose backward recomputes the ``(n, K, S)`` gate and component
    tensors row chunk by row chunk instead of keeping them from the forward: the frequent block
    then holds only its small inputs between forward and backward (same values and gradients)."""

    @staticmethod
    def forward(ctx, rows: int, noise: Tensor | None, contexts, weight_frequent, gate_hidden, gate_embedding, shared_logit, gate_bias):
        N = contexts.shape[0]
        out = contexts.new_empty(N, weight_frequent.shape[0])
        for start in range(0, N, rows):
            part = slice(start, start + rows)
            out[part] = frequent_logits(
                contexts[part], weight_frequent, gate_hidden[part], gate_embedding, shared_logit[part], gate_bias,
                None if noise is None else noise[part],
            )
        ctx.rows, ctx.noise = rows, noise
        ctx.save_for_backward(contexts, weight_frequent, gate_hidden, gate_embedding, shared_logit, gate_bias)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        contexts, weight_frequent, gate_hidden, gate_embedding, shared_logit, gate_bias = ctx.saved_tensors
        row_grads = [torch.empty_like(x) for x in (contexts, gate_hidden, shared_logit)]
        weight_grads = [torch.zeros_like(w) for w in (weight_frequent, gate_embedding, gate_bias)]
        for start in range(0, contexts.shape[0], ctx.rows):
            part = slice(start, start + ctx.rows)
            noise = None if ctx.noise is None else ctx.noise[part]

            def chunk_logits(c, wf, h, ge, sh, gb, noise=noise):
                return frequent_logits(c, wf, h, ge, sh, gb, noise)

            # torch.func.vjp, not torch.autograd.grad: torch.compile traces it, so the head compiles
            # without a graph break (tests/test_compile.py counts them).
            _, pullback = torch.func.vjp(
                chunk_logits, contexts[part], weight_frequent, gate_hidden[part], gate_embedding, shared_logit[part], gate_bias
            )
            grads = pullback(grad_out[part])
            for target, value in zip(row_grads, grads[0::2]):  # contexts, gate_hidden, shared_logit
                target[part] = value
            for total, value in zip(weight_grads, grads[1::2]):  # weight_frequent, gate_embedding, gate_bias
                total += value
        g_contexts, g_hidden, g_shared = row_grads
        g_wf, g_ge, g_gb = weight_grads
        return None, None, g_contexts, g_wf, g_hidden, g_ge, g_shared, g_gb


def prior_entropy(prior: Tensor, dim: int = 1) -> Tensor:
    """Mean entropy (nats) of priors along ``dim``; ``0 log 0`` counted as 0."""
    return -(prior * prior.clamp_min(1e-30).log()).sum(dim).mean()


@register_head("mixtape", size_argument="num_gates", family="bottleneck")
class Mixtape(OutputHead):
    """Mixtape output layer with sigmoid-tree gates and gate sharing (Yang et al. 2019, §3).

    Requires class ids sorted by decreasing frequency (the first ``S`` ids get their own
    gates).

    Args:
        in_features: hidden size of the encoder output ``g``.
        num_classes: vocabulary size ``V``.
        num_gates: number of mixture components ``K``; a power of two ``>= 2``.
        embedding_dim: width ``d`` of the context vectors and of the (tieable) class
            embeddings; defaults to ``in_features``.
        gate_dim: width ``d2`` of the gate embeddings ``v_x`` and of ``tanh(U_k g)``.
        frequent_fraction: ``r``; the ``S = round(r V)`` most frequent tokens get their own
            gate logits (``r = 1`` turns gate sharing off). The paper sets 0.1 for language
            modeling and 0.5 for machine translation (§3.3).
        dropout: dropout on the context vectors ``h_k``.
        gate_dropout: dropout on ``tanh(U_k g + a_k)`` (0.2 / 0.15 in the paper's WMT'14 En-De /
            En-Fr runs, §4.2).
        gate_noise: standard deviation of Gaussian noise added once to each pre-activation gate
            prior during training (§3.4; 0.1 in the paper's WMT'14 runs, §4.2).
        weight_norm_scale: if set, each row of ``U_k`` is normalised to this constant
            (non-learned) norm before use.
        bias: learn a per-class logit bias ``b_x``.
        recompute_gates: keep only the frequent block's small inputs for the backward and
            recompute its ``(N, K, S)`` gate and component tensors there, in row chunks (less
            memory for the output layer for a little more time;
            float32/64 without autocast; otherwise autograd keeps them).
        ignore_index: target value that contributes zero loss.
    """

    requires_frequency_order = True

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        num_gates: int = 4,
        embedding_dim: int | None = None,
        gate_dim: int = 64,
        frequent_fraction: float = 0.1,
        dropout: float = 0.0,
        gate_dropout: float = 0.0,
        gate_noise: float = 0.0,
        weight_norm_scale: float | None = None,
        bias: bool = True,
        recompute_gates: bool = True,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        super().__init__(in_features, num_classes, ignore_index)
        name = type(self).__name__
        self.num_gates = check_power_of_two(num_gates, "num_gates", name)
        self.frequent_fraction = check_fraction(frequent_fraction, "frequent_fraction", name)
        self.gate_noise = check_nonnegative(gate_noise, "gate_noise", name)
        self.weight_norm_scale = check_positive_or_none(weight_norm_scale, "weight_norm_scale", name)
        self.embedding_dim = check_positive_int(embedding_dim or in_features, "embedding_dim", name)
        self.gate_dim = check_positive_int(gate_dim, "gate_dim", name)
        self.num_frequent = min(num_classes, max(1, round(self.frequent_fraction * num_classes)))
        self.dropout = check_dropout(dropout, "dropout", name)
        self.gate_dropout = check_dropout(gate_dropout, "gate_dropout", name)
        self.recompute_gates = bool(recompute_gates)
        K, d, d2, S = num_gates, self.embedding_dim, gate_dim, self.num_frequent
        self.context = nn.Linear(in_features, K * d)  # H_k stacked (Eq. 5)
        self.gate_projection = nn.Linear(in_features, (K - 1) * d2)  # U_k stacked, bias a_k (Eq. 4, §3.4)
        self.shared_gate = nn.Linear(in_features, K - 1)  # u_k, bias e_k (Eqs. 4 and 6, §3.4)
        nn.init.zeros_(self.gate_projection.bias)
        nn.init.zeros_(self.shared_gate.bias)
        self.gate_embedding = nn.Parameter(torch.randn(S, d2) / math.sqrt(d2))  # v_x, frequent tokens only
        self.gate_bias = nn.Parameter(torch.zeros(S, K - 1))  # b_{x,k}, frequent tokens only
        self.decoder = nn.Linear(d, num_classes, bias=bias)  # class embeddings w_x, bias b_x
        self._last_entropy: tuple[Tensor, Tensor | None] | None = None

    # ------------------------------------------------------------------ tying
    @property
    def output_embedding_dim(self) -> int:
        return self.embedding_dim

    def tie_to(self, embedding: nn.Embedding) -> None:
        self._check_tie(embedding, self.embedding_dim)
        self.decoder.weight = embedding.weight

    # ------------------------------------------------------------------ pieces
    def gate_projection_weight(self) -> Tensor:
        """``U_k`` stacked, rows rescaled to ``weight_norm_scale`` when weight normalisation is on."""
        weight = self.gate_projection.weight  # ((K-1) d2, in)
        if self.weight_norm_scale is None:
            return weight
        return weight * (self.weight_norm_scale / weight.norm(dim=1, keepdim=True).clamp_min(1e-12))

    def _noisy(self, gate_logits: Tensor) -> Tensor:
        if self.training and self.gate_noise > 0:
            return gate_logits + self.gate_noise * torch.randn_like(gate_logits)
        return gate_logits

    def _parts(self, g: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """The gated logits of the ``S`` frequent tokens, and what scores the rest.

        Returns ``frequent`` ``(N, S)`` float32 (bias included), the shared-gate mixed context
        ``(N, d)`` and the rest's class embeddings ``(V-S, d)`` and biases ``(V-S,)`` or None.
        """
        N = g.shape[0]
        K, d, d2, S = self.num_gates, self.embedding_dim, self.gate_dim, self.num_frequent
        contexts = torch.tanh(self.context(g)).view(N, K, d)  # (N, K, d), Eq. 5
        contexts = F.dropout(contexts, self.dropout, self.training)
        shared_logit = at_least_fp32(self.shared_gate(g))  # (N, K-1): u_k . g + e_k, noise-free
        # Frequent and shared-gate class embeddings; split (not two slices) so the backward is one cat.
        weight_frequent, weight_rest = self.decoder.weight.split([S, self.num_classes - S])  # (S, d), (V-S, d)
        bias = self.decoder.bias
        bias_frequent, bias_rest = bias.split([S, self.num_classes - S]) if bias is not None else (None, None)

        # Frequent tokens: per-token gate logits (Eq. 4), sigmoid tree (Eq. 3), vector gating (Eq. 2).
        gate_hidden = torch.tanh(F.linear(g, self.gate_projection_weight(), self.gate_projection.bias))
        gate_hidden = gate_hidden.view(N, K - 1, d2)  # (N, K-1, d2): tanh(U_k g + a_k)
        gate_hidden = F.dropout(gate_hidden, self.gate_dropout, self.training)
        same_dtype = contexts.dtype == gate_hidden.dtype == self.gate_embedding.dtype == weight_frequent.dtype
        if self.recompute_gates and same_dtype and torch.is_grad_enabled() and fusable(contexts, weight_frequent):
            noise = None
            if self.training and self.gate_noise > 0:  # drawn here, as _noisy would, and replayed in the backward
                noise = self.gate_noise * torch.randn(N, K - 1, S, dtype=contexts.dtype, device=contexts.device)
            rows = max(1, 2**18 // (K * S))  # ~1 MiB of (rows, K, S) float32 per recomputed chunk
            frequent = _RecomputedFrequent.apply(
                rows, noise, contexts, weight_frequent, gate_hidden, self.gate_embedding, shared_logit, self.gate_bias
            )
            gate_logit = None
        else:
            gate_logit = at_least_fp32(gate_hidden @ self.gate_embedding.t().to(gate_hidden.dtype))  # (N, K-1, S)
            # The noise goes on the summed pre-activation prior, once (shared_logit carries none).
            gate_logit = self._noisy(gate_logit + (shared_logit.unsqueeze(-1) + at_least_fp32(self.gate_bias.t())))
            component_logits = at_least_fp32(contexts @ weight_frequent.t().to(contexts.dtype))  # (N, K, S): h_k . w_x
            frequent = tree_mix(component_logits, gate_logit)  # (N, S): sum_k pi_{x,k} h_k . w_x
        if bias_frequent is not None:
            frequent = frequent + at_least_fp32(bias_frequent)

        # Shared-gate tokens (Eq. 6): one prior for all of them, so mix the contexts first and
        # multiply by the class embeddings once.
        # Their pre-activation prior u_k . g + e_k gets its one noise draw here.
        mixed = tree_mix(contexts, self._noisy(shared_logit).unsqueeze(-1).to(contexts.dtype))  # (N, d)
        if self.training:
            if gate_logit is None:  # recomputed path: the first tokens' gate logits for the statistics
                with torch.no_grad():
                    gate_logit = frequent_gate_logits(gate_hidden[:64], self.gate_embedding, shared_logit[:64], self.gate_bias)
            self._record_entropy(gate_logit.detach(), shared_logit.detach())
        return frequent, mixed, weight_rest, bias_rest

    def flat_logits(self, g: Tensor) -> Tensor:
        """Logits over the whole vocabulary, float32: the ``S`` frequent tokens first.

        Shape:
            g ``(N, in_features)`` -> ``(N, V)``.
        """
        frequent, mixed, weight_rest, bias_rest = self._parts(g)
        if self.num_frequent == self.num_classes:
            return frequent
        rest = at_least_fp32(F.linear(mixed, weight_rest, bias_rest))  # (N, V-S)
        return torch.cat([frequent, rest], dim=-1)  # (N, V)

    @torch.no_grad()
    def _record_entropy(self, gate_logit: Tensor, shared_logit: Tensor, max_tokens: int = 64) -> None:
        """Gate-prior entropies for stats(), from the first tokens of the batch only (the full
        ``(N, K, S)`` priors are never formed in training)."""
        frequent = prior_entropy(sigmoid_tree(gate_logit[:max_tokens]))
        shared = prior_entropy(sigmoid_tree(shared_logit[:max_tokens])) if self.num_frequent < self.num_classes else None
        self._last_entropy = (frequent, shared)

    def logits(self, hidden: Tensor) -> Tensor:
        """Full logits. Shape: ``(..., in_features) -> (..., V)`` float32."""
        return self.flat_logits(hidden.reshape(-1, self.in_features)).view(*hidden.shape[:-1], self.num_classes)

    # ------------------------------------------------------------------ contract
    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Per-token NLL.

        Shape:
            hidden ``(..., in_features)``, target ``(...)`` -> ``(...)``, zero at ``ignore_index``.
        """
        g, flat_target = hidden.reshape(-1, self.in_features), target.reshape(-1)
        frequent, mixed, weight_rest, bias_rest = self._parts(g)
        if self.num_frequent < self.num_classes and fusable(mixed, weight_rest):
            # The rest's logits, the softmax over [frequent, rest] and its gradient in row chunks.
            nll = linear_nll(mixed, weight_rest, bias_rest, flat_target, self.ignore_index, prefix=frequent)
        else:
            if self.num_frequent < self.num_classes:
                rest = at_least_fp32(F.linear(mixed, weight_rest, bias_rest))  # (N, V-S)
                frequent = torch.cat([frequent, rest], dim=-1)  # (N, V)
            nll = F.cross_entropy(frequent, flat_target, ignore_index=self.ignore_index, reduction="none")
        return nll.view(target.shape)

    def log_prob(self, hidden: Tensor) -> Tensor:
        """Shape: ``(..., in_features) -> (..., V)`` float32."""
        return torch.log_softmax(self.logits(hidden), dim=-1)

    def stats(self) -> dict[str, Tensor | float]:
        """Gate-prior entropy (nats) of the frequent tokens' own gates and of the shared gate,
        over the last training batch; ``log K`` is the maximum."""
        if self._last_entropy is None:
            return {}
        frequent, shared = self._last_entropy
        out: dict[str, Tensor | float] = {
            "gate_entropy_frequent": frequent,
            "gate_entropy_max": math.log(self.num_gates),
        }
        if shared is not None:
            out["gate_entropy_shared"] = shared
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, num_classes={self.num_classes}, num_gates={self.num_gates}, "
            f"embedding_dim={self.embedding_dim}, gate_dim={self.gate_dim}, num_frequent={self.num_frequent}"
        )
