"""The chunked NLL kernel of a mixture of (sig)softmaxes, which MoS, the SigSoftmax mixture and
Hybrid-LightRNN-MoS train with through :class:`heads.mixture.MixtureHead`.

:func:`mixture_nll` is the memory-lean ``-log sum_k pi_k p_k(x | h_k)``. The straightforward
implementation materialises the ``(N, K, V)`` logits, their softmax, the weighted sum and its log,
and autograd keeps several of them for backward. :class:`MixtureNLL` walks the vocabulary in token
chunks: for each chunk it forms the ``(c K, V)`` logits, the normalisers, the NLL and, while that
block is still in cache, its contribution to the gradients, then drops it. Peak memory is one chunk
(about :data:`heads.fused_nll.CHUNK_BYTES`) plus ``O(N K d + V d)`` gradients, whatever ``N`` and
``K``; training does the minimum three decoder matmuls (logits, gradient of the contexts, gradient
of ``W``). Everything is computed in log space: there is no ``log(p + eps)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from heads.fused_nll import CHUNK_BYTES  # rows per chunk: one chunk of fp32 logits is about this many bytes


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
        elif token_weight is None:
            # Evaluation keeps no exponentials: torch's logsumexp makes fewer passes over the
            # (c K, V) block than the by-hand version below.
            target_score = target_logit
            lse = torch.logsumexp(logits, dim=-1)  # (c K,)
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
