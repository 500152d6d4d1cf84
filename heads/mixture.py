"""The mixture kernel shared by MoC, MoS and mixtures of SigSoftmaxes.

Those heads share one parameterisation (Yang et al., ICLR 2018, §2.4-2.5): a softmax prior
over ``K`` components and ``K`` context vectors from one stacked latent layer, scored by one
decoder (the tieable class embeddings):

    pi_k = softmax_k(w_pi . g),    h_k = tanh(W_k g),    z_k = W h_k + b.

:class:`MixtureHead` holds those parameters (``prior``, ``latent``, ``decoder``), their
validation, tying and the prior statistics; the heads say how the components combine (in
probability space for MoS, in context space for MoC).

:func:`mixture_nll` is the memory-lean NLL of a mixture of (sig)softmaxes,
``-log sum_k pi_k p_k(x | h_k)``. The straightforward implementation materialises the
``(N, K, V)`` logits, their softmax, the weighted sum and its log, and autograd keeps several
of them for backward. :class:`MixtureNLL` walks the vocabulary in token chunks: for each chunk
it forms the ``(c K, V)`` logits, the normalisers, the NLL and, while that block is still in
cache, its contribution to the gradients, then drops it. Peak memory is one chunk (about
:data:`heads.fused_nll.CHUNK_BYTES`) plus ``O(N K d + V d)`` gradients, whatever ``N`` and
``K``; training does the minimum three decoder matmuls (logits, gradient of the contexts,
gradient of ``W``). Everything is computed in log space: there is no ``log(p + eps)``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from heads.base import IGNORE_INDEX, OutputHead, at_least_fp32
from heads.fused_nll import CHUNK_BYTES  # rows per chunk: one chunk of fp32 logits is about this many bytes
from heads.validation import check_dropout, check_positive_int


def auto_chunk_rows(num_classes: int, chunk_size: int | None = None) -> int:
    """Rows per chunk: ``chunk_size`` if given, else about :data:`CHUNK_BYTES` of fp32 logits."""
    if chunk_size is not None:
        return chunk_size
    return max(1, CHUNK_BYTES // (4 * num_classes))


def _mixture_pass(
    log_prior: Tensor,
    contexts: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    chunk_tokens: int,
    sigmoid_weighting: bool,
    compute_dtype: torch.dtype,
    token_weight: Tensor | None,
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor, Tensor | None] | None]:
    """One chunked pass over the vocabulary: the mixture NLL and, if ``token_weight`` is
    given, the gradients of ``sum_n token_weight_n * nll_n`` w.r.t. every input.

    Per chunk of tokens, with rows ``r = (n, k)`` and ``z_r = h_r W^T + b`` (``f`` the identity
    or ``f(z) = z + log sigmoid(z)``):
    ``lse_r = logsumexp_v f(z_rv)``; ``log joint_nk = log pi_nk + f(z_{r,x_n}) - lse_r``;
    ``nll_n = -logsumexp_k log joint_nk``; the component responsibilities are
    ``rho_nk = softmax_k(log joint_nk)`` and
    ``d nll_n / d z_rv = rho_nk (p_rv f'(z_rv) - [v = x_n] f'(z_{r,x_n}))``,
    ``d nll_n / d log pi_nk = -rho_nk``. The chunk's ``(c K, V)`` block is used for the
    gradient while it is still in cache and then dropped: nothing ``V``-wide outlives it.
    """
    n, K, d = contexts.shape
    V = weight.shape[0]
    accumulate = torch.float64 if contexts.dtype == torch.float64 else torch.float32
    hidden = contexts.reshape(n * K, d).to(compute_dtype)  # (n K, d): one row per (token, component)
    weight_c = weight.to(compute_dtype)  # (V, d)
    bias_a = None if bias is None else bias.to(accumulate)
    nll = torch.empty(n, dtype=accumulate, device=contexts.device)
    if token_weight is not None:
        grad_prior = torch.empty(n, K, dtype=accumulate, device=contexts.device)
        grad_hidden = torch.empty(n * K, d, dtype=accumulate, device=contexts.device)
        grad_weight = torch.zeros(V, d, dtype=accumulate, device=contexts.device)
        grad_bias = None if bias is None else torch.zeros(V, dtype=accumulate, device=contexts.device)
    for t0 in range(0, n, chunk_tokens):
        t1 = min(n, t0 + chunk_tokens)
        r0, r1, c = t0 * K, t1 * K, t1 - t0
        if bias_a is not None and compute_dtype == accumulate:
            logits = torch.addmm(bias_a, hidden[r0:r1], weight_c.t())  # (c K, V), bias fused in
        else:
            logits = (hidden[r0:r1] @ weight_c.t()).to(accumulate)  # (c K, V)
            if bias_a is not None:
                logits += bias_a
        scored = target[t0:t1] >= 0  # (c,): a negative target is an ignored token (zero NLL, no gradient)
        rows_target = target[t0:t1].clamp_min(0).repeat_interleave(K).unsqueeze(1)  # (c K, 1): x_n for each row
        target_logit = logits.gather(1, rows_target).squeeze(1)  # (c K,)
        if sigmoid_weighting:
            scores = logits + F.logsigmoid(logits)  # (c K, V): log of exp(z) sigmoid(z)
            target_score = target_logit + F.logsigmoid(target_logit)
            lse = torch.logsumexp(scores, dim=-1)  # (c K,)
        else:
            # logsumexp by hand so the exponentials are computed once and reused for the
            # gradient: unnormalised = exp(z - max), in place over the chunk's logits.
            target_score = target_logit
            row_max = logits.amax(dim=-1, keepdim=True)  # (c K, 1)
            unnormalised = logits.sub_(row_max).exp_()  # (c K, V)
            row_sum = unnormalised.sum(dim=-1)  # (c K,)
            lse = row_max.squeeze(1) + row_sum.log()
        log_joint = log_prior[t0:t1].to(accumulate) + (target_score - lse).view(c, K)  # (c, K)
        nll[t0:t1] = torch.where(scored, -torch.logsumexp(log_joint, dim=-1), 0.0)
        if token_weight is None:
            continue
        rho = torch.softmax(log_joint, dim=-1) * token_weight[t0:t1, None].to(accumulate)  # (c, K)
        grad_prior[t0:t1] = -rho
        rho = rho.reshape(-1, 1)  # (c K, 1)
        if sigmoid_weighting:
            # f'(z) = 1 + sigmoid(-z)
            grad_logits = scores.sub_(lse[:, None]).exp_().mul_(torch.sigmoid(-logits).add_(1.0)).mul_(rho)
            target_slope = torch.sigmoid(-target_logit).add_(1.0).unsqueeze(1)
        else:
            grad_logits = unnormalised.mul_(rho / row_sum[:, None])  # (c K, V), in place: rho * softmax
            target_slope = 1.0
        grad_logits.scatter_add_(1, rows_target, -rho * target_slope)
        if grad_bias is not None:
            grad_bias += grad_logits.sum(0)
        grad_logits = grad_logits.to(compute_dtype)
        grad_hidden[r0:r1] = grad_logits @ weight_c  # (c K, d)
        if grad_logits.dtype == accumulate:
            grad_weight.addmm_(grad_logits.t(), hidden[r0:r1])  # (V, d), accumulated without a temporary
        else:
            grad_weight += (grad_logits.t() @ hidden[r0:r1]).to(accumulate)
    if token_weight is None:
        return nll, None
    return nll, (grad_prior, grad_hidden.view(n, K, d), grad_weight, grad_bias)


class MixtureNLL(torch.autograd.Function):
    """Per-token NLL of a mixture of (sig)softmaxes with a shared decoder, memory-lean.

    Forward makes one chunked pass over the vocabulary (:func:`_mixture_pass`). When any
    input needs a gradient it also computes, in that same pass, the gradients for a
    *uniform* upstream gradient (every token weighted 1) — the case of a mean or a
    token-count-normalised sum, which is how every task here reduces the loss. Only these
    ``O(N K d + V d)`` gradients are kept; under ``no_grad`` / ``inference_mode`` (validation,
    test, decoding) nothing will call backward, so only the NLL is computed (``speculate``
    false: one decoder matmul per chunk instead of three). Backward scales them if the upstream gradient is
    indeed uniform; otherwise it runs the pass again with the actual per-token weights
    (exact either way, checked by ``gradcheck``). So training costs three matmuls with the
    decoder, the minimum, and never holds more than one ``(chunk, V)`` block.

    Under autocast the decoder matmuls run in the autocast dtype; exponentials, sums and
    gradients accumulate in float32.

    Shape:
        log_prior ``(n, K)``, contexts ``(n, K, d)``, weight ``(V, d)``, bias ``(V,)`` or
        ``None``, target ``(n,)`` -> nll ``(n,)``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, log_prior, contexts, weight, bias, target, chunk_tokens, sigmoid_weighting, compute_dtype, speculate
    ):
        # needs_input_grad reflects requires_grad even under no_grad, so the caller says whether
        # autograd is recording (see mixture_nll).
        recording = speculate and any(ctx.needs_input_grad[:4])
        # Compiled, backward always makes the second pass: torch.compile cannot choose between
        # scaling gradients computed ahead and a second pass (a data-dependent branch) without a
        # graph break, and torch.cond over this pass gave wrong gradients (tests/test_compile.py).
        speculate = recording and not torch.compiler.is_compiling()
        with torch.autocast(contexts.device.type, enabled=False):
            ones = (target >= 0).to(torch.float32) if speculate else None  # uniform weights, ignored tokens 0
            nll, grads = _mixture_pass(
                log_prior, contexts, weight, bias, target, chunk_tokens, sigmoid_weighting, compute_dtype, ones
            )
        ctx.options = (chunk_tokens, sigmoid_weighting, compute_dtype)
        ctx.has_bias = bias is not None
        if recording:
            ctx.save_for_backward(log_prior, contexts, weight, bias, target, *(grads if speculate else (None,) * 4))
        return nll

    @staticmethod
    @once_differentiable  # the saved gradients are constants: refuse double backward loudly
    def backward(ctx, grad_nll: Tensor):  # type: ignore[override]
        log_prior, contexts, weight, bias, target, *grads = ctx.saved_tensors
        scored = target >= 0  # ignored tokens (negative targets) have no gradient, whatever their weight
        uniform = False
        if grads[0] is not None and grad_nll.numel():
            scale = grad_nll[scored.to(torch.int8).argmax()]  # the first scored token's weight
            uniform = bool(((grad_nll == scale) | ~scored).all())
        if uniform:
            grads = [None if g is None else g * scale for g in grads]
        else:
            with torch.autocast(contexts.device.type, enabled=False):
                _, grads = _mixture_pass(log_prior, contexts, weight, bias, target, *ctx.options, grad_nll * scored)
        inputs = (log_prior, contexts, weight, bias)
        out = [
            None if (g is None or not need) else g.to(x.dtype)
            for g, x, need in zip(grads, inputs, ctx.needs_input_grad[:4])
        ]
        return (*out, None, None, None, None, None)


def mixture_nll(
    log_prior: Tensor,
    contexts: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    chunk_tokens: int,
    sigmoid_weighting: bool = False,
) -> Tensor:
    """``-log sum_k pi_k p_k(x | h_k)`` per token without any ``(N, K, V)`` tensor; see
    :class:`MixtureNLL`.

    Shape:
        log_prior ``(n, K)``, contexts ``(n, K, d)``, weight ``(V, d)``, bias ``(V,)``,
        target ``(n,)`` -> ``(n,)``.
    """
    device_type = contexts.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(contexts.dtype, weight.dtype)
    # Gradients are computed ahead only if autograd records this call (never in evaluation).
    speculate = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (log_prior, contexts, weight, bias))
    return MixtureNLL.apply(
        log_prior, contexts, weight, bias, target, chunk_tokens, sigmoid_weighting, compute_dtype, speculate
    )


def prior_stats(log_prior: Tensor) -> tuple[Tensor, Tensor]:
    """Mean prior entropy (nats) and mean per-component usage of a batch of log-priors ``(N, K)``."""
    prior = log_prior.exp()
    entropy = -(prior * log_prior).sum(-1).mean()
    return entropy, prior.mean(0)


class MixtureHead(OutputHead):
    """Base of the heads with a softmax prior over ``K`` tanh context vectors and one decoder.

    Args:
        in_features: hidden size of the encoder output ``g``.
        num_classes: vocabulary size ``V``.
        num_components: number of components ``K``.
        embedding_dim: width ``d`` of the context vectors and of the (tieable) class
            embeddings; ``in_features`` when unset.
        dropout: dropout on the context vectors ``h_k``.
        bias: learn a per-class bias ``b``.
        ignore_index: target value that contributes zero loss.
        chunk_size: rows of ``(token, component)`` pairs per chunk of the normaliser; by
            default about :data:`heads.fused_nll.CHUNK_BYTES` of fp32 logits per chunk.
        use_prior: build the prior ``w_pi`` (a single component needs none).
        use_latent: build the latent layer ``W_k`` (without it the context is ``g`` itself).
        variational_dropout: one dropout mask per sequence, shared over its time steps
            (variational dropout, Gal & Ghahramani 2016; the MoS paper's "context vector
            V-dropout", its Table 8), instead of a fresh mask per token. A sequence is a row of
            the first dimension of ``hidden`` ``(B, T, ...)``; a 2-D ``hidden`` is one token per
            row, so it gets per-token dropout either way.

    Subclasses set :attr:`sigmoid_weighting` (and override :meth:`component_scores`) when a
    component's unnormalised weight is ``exp(z) sigmoid(z)`` rather than ``exp(z)``.
    """

    #: Whether component weights are ``exp(z) sigmoid(z)`` (SigSoftmax) instead of ``exp(z)``.
    sigmoid_weighting: ClassVar[bool] = False

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        num_components: int,
        embedding_dim: int | None,
        dropout: float,
        bias: bool,
        ignore_index: int = IGNORE_INDEX,
        chunk_size: int | None = None,
        use_prior: bool = True,
        use_latent: bool = True,
        variational_dropout: bool = False,
    ) -> None:
        super().__init__(in_features, num_classes, ignore_index)
        name = type(self).__name__
        self.num_components = check_positive_int(num_components, "num_components", name)
        self.embedding_dim = check_positive_int(embedding_dim or in_features, "embedding_dim", name)
        if chunk_size is not None:
            check_positive_int(chunk_size, "chunk_size", name)
        self.chunk_size = chunk_size
        self.dropout = check_dropout(dropout, "dropout", name)
        if not isinstance(variational_dropout, bool):
            raise ValueError(
                f"{name} needs variational_dropout to be true or false, got {variational_dropout!r} "
                f"(set head.init_args.variational_dropout)"
            )
        self.variational_dropout = variational_dropout
        K, d = self.num_components, self.embedding_dim
        self.prior = nn.Linear(in_features, K, bias=False) if use_prior else None  # w_pi
        self.latent = nn.Linear(in_features, K * d) if use_latent else None  # W_k stacked: h_k = tanh(W_k g)
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
    def log_prior(self, g: Tensor) -> Tensor:
        """Mixture prior ``log pi`` (float32); records the prior statistics in training.

        Shape: ``(N, in_features) -> (N, K)``.
        """
        if self.prior is None:
            return at_least_fp32(g.new_zeros(g.shape[0], 1))
        log_prior = torch.log_softmax(at_least_fp32(self.prior(g)), dim=-1)  # (N, K)
        if self.training:
            self._last_prior_entropy, self._last_component_usage = prior_stats(log_prior.detach())
        return log_prior

    def context_mask(self, hidden: Tensor) -> Tensor | None:
        """The variational dropout mask of a batch, one per sequence repeated over its time steps
        (scaled by ``1 / (1 - p)``), or None when per-token dropout (or none) applies.

        Shape: hidden ``(B, T, ..., in_features)`` -> ``(B T ..., K', d)`` (``K' = 1`` without a
        latent layer), rows in ``hidden.reshape(-1, in_features)`` order.
        """
        if not (self.variational_dropout and self.training and self.dropout > 0 and hidden.dim() >= 3):
            return None
        width = self.num_components if self.latent is not None else 1
        d = self.embedding_dim if self.latent is not None else self.in_features
        keep = hidden.new_empty(hidden.shape[0], 1, width, d).bernoulli_(1.0 - self.dropout) / (1.0 - self.dropout)
        steps = hidden[0, ..., 0].numel()  # time steps (and any further positions) per sequence
        return keep.expand(-1, steps, -1, -1).reshape(-1, width, d)  # (B T, K', d)

    def contexts(self, g: Tensor, mask: Tensor | None = None) -> Tensor:
        """Context vectors ``h_k = tanh(W_k g)`` after dropout (``g`` itself without a latent layer):
        ``mask`` (from :meth:`context_mask`, rows matching ``g``) if given, else per-token dropout.

        Shape: ``(N, in_features) -> (N, K, d)``.
        """
        if self.latent is None:
            h = g.unsqueeze(1)  # (N, 1, d)
        else:
            h = torch.tanh(self.latent(g)).view(g.shape[0], self.num_components, self.embedding_dim)  # (N, K, d)
        if mask is not None:
            return h * mask.to(h.dtype)
        return F.dropout(h, self.dropout, self.training)

    def component_scores(self, logits: Tensor) -> Tensor:
        """Log of a component's unnormalised class weights from its logits (``z`` for a softmax)."""
        return logits

    def chunk_tokens(self) -> int:
        """Tokens per chunk of the mixture's normaliser (``K`` rows each)."""
        return max(1, auto_chunk_rows(self.num_classes, self.chunk_size) // self.num_components)

    # ------------------------------------------------------------------ probability-space mixture
    def mixture_forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Per-token NLL of the mixture of the components' (sig)softmaxes, without any
        ``(N, K, V)`` tensor (:func:`mixture_nll`).

        Shape:
            hidden ``(..., in_features)``, target ``(...)`` -> ``(...)`` float32, zero at
            ``ignore_index``.
        """
        flat_target = target.reshape(-1)  # (N,)
        valid = flat_target != self.ignore_index
        if torch.compiler.is_compiling():
            # torch.compile: no boolean indexing (a data-dependent shape is a graph break). Every row
            # is scored; ignored ones carry target -1, which the kernel gives zero NLL and no gradient.
            g = hidden.reshape(-1, self.in_features)  # (N, in)
            log_prior, contexts = self.log_prior(g), self.contexts(g, self.context_mask(hidden))  # (N, K), (N, K, d)
            return mixture_nll(
                log_prior, contexts, self.decoder.weight, self.decoder.bias, torch.where(valid, flat_target, -1),
                self.chunk_tokens(), sigmoid_weighting=self.sigmoid_weighting,
            ).view(target.shape)
        g = hidden.reshape(-1, self.in_features)[valid]  # (n, in) -- ignored rows cost nothing
        x = flat_target[valid]  # (n,)
        mask = self.context_mask(hidden)  # (N, K, d) or None
        log_prior, contexts = self.log_prior(g), self.contexts(g, None if mask is None else mask[valid])  # (n, K), (n, K, d)
        token_nll = mixture_nll(
            log_prior, contexts, self.decoder.weight, self.decoder.bias, x, self.chunk_tokens(),
            sigmoid_weighting=self.sigmoid_weighting,
        )  # (n,)
        nll = hidden.new_zeros(flat_target.shape, dtype=token_nll.dtype)
        nll[valid] = token_nll
        return nll.view(target.shape)

    def mixture_log_prob(self, hidden: Tensor) -> Tensor:
        """Full log-probabilities of the mixture, in token chunks so at most one chunk's
        ``(c, K, V)`` block exists at a time.

        Shape:
            ``(..., in_features) -> (..., V)`` float32.
        """
        g = hidden.reshape(-1, self.in_features)  # (N, in)
        log_prior, contexts = self.log_prior(g), self.contexts(g, self.context_mask(hidden))  # (N, K), (N, K, d)
        rows = self.chunk_tokens()
        # a program traced for any batch size (torch.export, heads/export.py) cannot loop over its
        # chunks: it computes the (N, K, V) block at once
        starts = [0] if torch.compiler.is_compiling() else range(0, g.shape[0], rows)
        rows = g.shape[0] if torch.compiler.is_compiling() else rows
        pieces = []
        for start in starts:
            scores = self.component_scores(at_least_fp32(self.decoder(contexts[start : start + rows])))  # (c, K, V)
            component_log_p = torch.log_softmax(scores, dim=-1)  # (c, K, V)
            pieces.append(torch.logsumexp(log_prior[start : start + rows, :, None] + component_log_p, dim=1))
        out = torch.cat(pieces) if pieces else g.new_zeros(0, self.num_classes, dtype=log_prior.dtype)
        return out.view(*hidden.shape[:-1], self.num_classes)

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict[str, Tensor | float]:
        """Prior entropy (nats, mean over the last training batch) and per-component usage
        (mean prior, a ``(K,)`` tensor, logged as a histogram) plus its minimum, which flags
        dead components."""
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
