"""Mixture of Softmaxes (Yang, Dai, Salakhutdinov & Cohen, ICLR 2018, "Breaking the Softmax
Bottleneck: A High-Rank RNN Language Model", §2.4).

The log-probability matrix of a softmax over ``d``-wide contexts has rank at most ``d + 1``
(§2.2). MoS mixes ``K`` softmaxes in probability space, which makes ``log p`` a non-linear
(log-sum-exp) function of the contexts and lifts that bound:

    pi_k   = softmax_k(w_pi . g)                            (prior, Eq. in §2.4)
    h_k    = tanh(W_k g)                                    (K context vectors, width d)
    log p(x | g) = logsumexp_k( log pi_k + h_k . w_x + b_x - logsumexp_v(h_k . w_v + b_v) )

Everything is computed in log space: there is no ``log(p + eps)`` anywhere.

Memory. The straightforward implementation materialises the ``(N, K, V)`` logits, their
softmax, the weighted sum and its log, and autograd keeps several of them for backward.
Here the only ``V``-wide quantity is the per-(token, component) normaliser
``logsumexp_v(h_k . w_v + b_v)``; :class:`ChunkedLogSumExp` computes it in row chunks and its
backward *recomputes* each chunk's logits instead of storing them, so the peak is one chunk
(about ``chunk_size x V`` floats) regardless of ``N`` and ``K``. The target logit
``h_k . w_x`` needs only the ``N`` gathered class embeddings.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.base import OutputHead, at_least_fp32, check_dropout, check_positive_int
from heads.registry import register_head

#: Rows per chunk are chosen so one chunk of fp32 logits is about this many bytes.
CHUNK_BYTES = 32 * 2**20


def auto_chunk_rows(num_classes: int, chunk_size: int | None = None) -> int:
    """Rows per chunk: ``chunk_size`` if given, else about :data:`CHUNK_BYTES` of fp32 logits."""
    if chunk_size is not None:
        return chunk_size
    return max(1, CHUNK_BYTES // (4 * num_classes))


class ChunkedLogSumExp(torch.autograd.Function):
    """``lse_r = logsumexp_v f(h_r . w_v + b_v)`` for every row ``r`` of ``h``, in row chunks.

    ``f`` is the identity (softmax normaliser) or, with ``sigmoid_weighting``,
    ``f(z) = z + log sigmoid(z)`` (the SigSoftmax normaliser, Kanai et al. 2018).
    Nothing ``V``-wide is saved for backward: backward recomputes each chunk's logits, so
    peak memory is one ``(chunk_rows, V)`` block (plus the gradient of ``W``).

    Under autocast the matmuls run in the autocast dtype while the exponentials, the sums
    and the returned normalisers are float32 ("fp32 accumulation").

    Shape:
        hidden ``(R, d)``, weight ``(V, d)``, bias ``(V,)`` or ``None`` -> ``(R,)`` float32
        (float64 when the inputs are float64).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        chunk_rows: int,
        sigmoid_weighting: bool,
        compute_dtype: torch.dtype,
    ) -> Tensor:
        accumulate = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        with torch.autocast(hidden.device.type, enabled=False):
            hidden_c, weight_t = hidden.to(compute_dtype), weight.to(compute_dtype).t()  # (R, d), (d, V)
            lse = hidden.new_empty(hidden.shape[0], dtype=accumulate)
            for start in range(0, hidden.shape[0], chunk_rows):
                logits = ChunkedLogSumExp._logits(hidden_c[start : start + chunk_rows], weight_t, bias, accumulate)
                if sigmoid_weighting:
                    logits = logits + F.logsigmoid(logits)  # (c, V)
                lse[start : start + chunk_rows] = torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(hidden, weight, bias, lse)
        ctx.chunk_rows, ctx.sigmoid_weighting, ctx.compute_dtype = chunk_rows, sigmoid_weighting, compute_dtype
        return lse

    @staticmethod
    def _logits(hidden: Tensor, weight_t: Tensor, bias: Tensor | None, accumulate: torch.dtype) -> Tensor:
        logits = (hidden @ weight_t).to(accumulate)  # (c, V)
        if bias is not None:
            logits += bias.to(accumulate)
        return logits

    @staticmethod
    def backward(ctx, grad_lse: Tensor):  # type: ignore[override]
        hidden, weight, bias, lse = ctx.saved_tensors
        rows, compute_dtype = ctx.chunk_rows, ctx.compute_dtype
        accumulate = lse.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with torch.autocast(hidden.device.type, enabled=False):
            hidden_c, weight_c = hidden.to(compute_dtype), weight.to(compute_dtype)  # (R, d), (V, d)
            grad_hidden = torch.empty_like(hidden) if need_h else None
            grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if need_w else None
            grad_bias = torch.zeros(weight.shape[0], dtype=accumulate, device=weight.device) if need_b else None
            for start in range(0, hidden.shape[0], rows):
                stop = start + rows
                logits = ChunkedLogSumExp._logits(hidden_c[start:stop], weight_c.t(), bias, accumulate)  # (c, V)
                if ctx.sigmoid_weighting:
                    # d/dz [z + log sigmoid(z)] = 1 + sigmoid(-z); p = exp(f(z) - lse)
                    slope = torch.sigmoid(-logits).add_(1.0)
                    prob = (logits + F.logsigmoid(logits)).sub_(lse[start:stop, None]).exp_()
                    grad_logits = prob.mul_(slope)
                else:
                    grad_logits = logits.sub_(lse[start:stop, None]).exp_()  # softmax, in place
                grad_logits.mul_(grad_lse[start:stop, None].to(accumulate))  # (c, V)
                if need_b:
                    grad_bias += grad_logits.sum(0)
                grad_logits = grad_logits.to(compute_dtype)
                if need_h:
                    grad_hidden[start:stop] = grad_logits @ weight_c  # (c, d)
                if need_w:
                    grad_weight += (grad_logits.t() @ hidden_c[start:stop]).to(accumulate)  # (V, d)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


def chunked_logsumexp(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    chunk_rows: int,
    sigmoid_weighting: bool = False,
) -> Tensor:
    """Memory-lean ``logsumexp_v f(hidden @ weight.T + bias)``; see :class:`ChunkedLogSumExp`.

    Shape:
        hidden ``(R, d)``, weight ``(V, d)``, bias ``(V,)`` -> ``(R,)``.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    return ChunkedLogSumExp.apply(hidden, weight, bias, chunk_rows, sigmoid_weighting, compute_dtype)


def prior_stats(log_prior: Tensor) -> tuple[Tensor, Tensor]:
    """Mean prior entropy (nats) and mean per-component usage of a batch of log-priors ``(N, K)``."""
    prior = log_prior.exp()
    entropy = -(prior * log_prior).sum(-1).mean()
    return entropy, prior.mean(0)


@register_head("mos")
class MixtureOfSoftmaxes(OutputHead):
    """Mixture of Softmaxes output layer (Yang et al. 2018, §2.4).

    Args:
        in_features: hidden size of the encoder output ``g``.
        num_classes: vocabulary size ``V``.
        num_components: number of mixture components ``K`` (the paper uses 15 on PTB).
        embedding_dim: width ``d`` of each context vector and of the (tieable) class
            embeddings; defaults to ``in_features``.
        dropout: dropout on the context vectors ``h_k`` (the paper's latent dropout).
        bias: learn a per-class bias ``b``.
        chunk_size: rows of ``(token, component)`` pairs per chunk of the normaliser; by
            default about 32 MiB of fp32 logits per chunk.
        ignore_index: target value that contributes zero loss.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        num_components: int = 15,
        embedding_dim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        chunk_size: int | None = None,
        ignore_index: int = -100,
    ) -> None:
        super().__init__(in_features, num_classes, ignore_index)
        name = type(self).__name__
        self.num_components = check_positive_int(num_components, "num_components", name)
        self.embedding_dim = check_positive_int(embedding_dim or in_features, "embedding_dim", name)
        if chunk_size is not None:
            check_positive_int(chunk_size, "chunk_size", name)
        self.chunk_size = chunk_size
        self.dropout = check_dropout(dropout, "dropout", name)
        K, d = self.num_components, self.embedding_dim
        self.prior = nn.Linear(in_features, K, bias=False)  # w_pi
        self.latent = nn.Linear(in_features, K * d)  # W_k stacked: h_k = tanh(W_k g)
        self.decoder = nn.Linear(d, num_classes, bias=bias)  # class embeddings w_x and bias b_x
        self._last_prior_entropy: Tensor | None = None
        self._last_component_usage: Tensor | None = None

    # ------------------------------------------------------------------ tying
    @property
    def output_embedding_dim(self) -> int:
        return self.embedding_dim

    def tie_to(self, embedding: nn.Embedding) -> None:
        self._check_tie(embedding, self.embedding_dim)
        self.decoder.weight = embedding.weight

    # ------------------------------------------------------------------ pieces
    def priors_and_contexts(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """``log pi`` (float32) and the context vectors ``h_k`` for flat hidden states.

        Shape:
            hidden ``(N, in_features)`` -> ``(N, K)``, ``(N, K, d)``.
        """
        N = hidden.shape[0]
        log_prior = torch.log_softmax(at_least_fp32(self.prior(hidden)), dim=-1)  # (N, K)
        contexts = torch.tanh(self.latent(hidden)).view(N, self.num_components, self.embedding_dim)  # (N, K, d)
        contexts = F.dropout(contexts, self.dropout, self.training)
        if self.training:
            entropy, usage = prior_stats(log_prior.detach())
            self._last_prior_entropy, self._last_component_usage = entropy, usage
        return log_prior, contexts

    # ------------------------------------------------------------------ contract
    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Per-token NLL without materialising any ``(N, K, V)`` tensor.

        Shape:
            hidden ``(..., in_features)``, target ``(...)`` -> ``(...)`` float32, zero at
            ``ignore_index``.
        """
        flat_target = target.reshape(-1)  # (N,)
        valid = flat_target != self.ignore_index
        g = hidden.reshape(-1, self.in_features)[valid]  # (n, in) -- ignored rows cost nothing
        x = flat_target[valid]  # (n,)
        n, K, d = g.shape[0], self.num_components, self.embedding_dim
        log_prior, contexts = self.priors_and_contexts(g)  # (n, K), (n, K, d)
        weight, bias = self.decoder.weight, self.decoder.bias
        # Target logit h_k . w_x + b_x needs only the n gathered class embeddings.
        target_logit = at_least_fp32((contexts * weight[x].unsqueeze(1)).sum(-1))  # (n, K)
        if bias is not None:
            target_logit = target_logit + at_least_fp32(bias[x]).unsqueeze(1)
        normaliser = chunked_logsumexp(
            contexts.reshape(n * K, d), weight, bias, auto_chunk_rows(self.num_classes, self.chunk_size)
        ).view(n, K)  # (n, K)
        log_p = torch.logsumexp(log_prior + target_logit - normaliser, dim=-1)  # (n,)
        nll = hidden.new_zeros(flat_target.shape, dtype=log_p.dtype)
        nll[valid] = -log_p
        return nll.view(target.shape)

    def log_prob(self, hidden: Tensor) -> Tensor:
        """Full log-probabilities, computed in token chunks so at most one chunk's
        ``(c, K, V)`` block exists at a time.

        Shape:
            ``(..., in_features) -> (..., V)`` float32.
        """
        g = hidden.reshape(-1, self.in_features)  # (N, in)
        log_prior, contexts = self.priors_and_contexts(g)  # (N, K), (N, K, d)
        rows = max(1, auto_chunk_rows(self.num_classes, self.chunk_size) // self.num_components)
        pieces = []
        for start in range(0, g.shape[0], rows):
            logits = at_least_fp32(self.decoder(contexts[start : start + rows]))  # (c, K, V)
            component_log_p = torch.log_softmax(logits, dim=-1)  # (c, K, V)
            pieces.append(torch.logsumexp(log_prior[start : start + rows, :, None] + component_log_p, dim=1))
        out = torch.cat(pieces) if pieces else g.new_zeros(0, self.num_classes, dtype=log_prior.dtype)
        return out.view(*hidden.shape[:-1], self.num_classes)

    def stats(self) -> dict[str, Tensor | float]:
        """Prior entropy (nats, mean over the last training batch) and per-component usage
        (mean prior, a ``(K,)`` tensor) plus its minimum, which flags dead components."""
        if self._last_prior_entropy is None:
            return {}
        usage = self._last_component_usage
        return {
            "prior_entropy": self._last_prior_entropy,
            "prior_entropy_max": math.log(self.num_components),
            "component_usage": usage,
            "component_usage_min": usage.min(),
        }

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, num_classes={self.num_classes}, "
            f"num_components={self.num_components}, embedding_dim={self.embedding_dim}"
        )
