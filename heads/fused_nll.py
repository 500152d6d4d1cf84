"""Fused ``linear -> log-softmax -> NLL`` with a hand-written backward, in row chunks.

``F.cross_entropy(F.linear(h, W, b), target)`` makes four full ``(N, V)`` tensors per
training step (the logits, the log-softmax output autograd saves, the gradient of the
log-softmax output and the gradient of the logits), and on a CPU each fresh tensor above
glibc's mmap threshold is paid for again in page faults. At language-model sizes those
elementwise passes and faults are a large share of the step.
:func:`linear_nll` computes the same per-token NLL and the same gradients with one
``(rows, V)`` buffer per chunk of rows:

* forward: ``e = exp(z - max)`` in place of the chunk's logits, ``s = sum(e)``,
  ``nll = log s + max - z_target``; only ``e`` and ``s`` are kept for the backward;
* backward: ``dz = e * (w / s) - w * onehot(target)`` in one reused chunk buffer (``w`` the incoming
  per-token gradient, zero at the ignore index), then ``dh = dz W`` and ``dW = dz^T h``,
  ``db = sum(dz)``, the weight gradient accumulated chunk by chunk.

The matmul work is the same three products as the unfused path; no logits are recomputed.
Gradients match autograd's to float rounding (tested).
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_BYTES = 8 * 2**20  # about 8 MiB of fp32 logits per chunk: cache-friendly and under glibc's mmap ceiling


def chunk_rows(num_classes: int, itemsize: int = 4) -> int:
    """Rows per chunk so that one chunk of ``(rows, num_classes)`` logits is about :data:`CHUNK_BYTES`."""
    return max(16, CHUNK_BYTES // (itemsize * num_classes))


class _LinearNLL(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, prefix: Tensor | None, target: Tensor,
        ignore_index: int, rows: int,
    ):
        N = hidden.shape[0]
        S = 0 if prefix is None else prefix.shape[1]
        nll = hidden.new_empty(N)
        exps: list[Tensor] = []
        sums: list[Tensor] = []
        for start in range(0, N, rows):
            h = hidden[start:start + rows]  # (n, d)
            t = target[start:start + rows]  # (n,)
            z = torch.addmm(bias, h, weight.t()) if bias is not None else h @ weight.t()  # (n, V - S) logits
            if S:
                z = torch.cat([prefix[start:start + rows], z], 1)  # (n, V): the given logits of classes < S first
            peak = z.amax(1, keepdim=True)  # (n, 1)
            valid = t != ignore_index
            picked = z.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)  # (n,)
            z.sub_(peak).exp_()  # (n, V) e = exp(z - max), in place
            total = z.sum(1)  # (n,)
            nll[start:start + rows] = torch.where(valid, total.log() + peak.squeeze(1) - picked, 0.0)
            exps.append(z)
            sums.append(total)
        ctx.exps, ctx.sums = exps, sums
        ctx.save_for_backward(hidden, weight, target)
        ctx.has_bias, ctx.ignore_index, ctx.rows, ctx.S = bias is not None, ignore_index, rows, S
        return nll

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_nll: Tensor):
        hidden, weight, target = ctx.saved_tensors
        exps, sums, rows, S = ctx.exps, ctx.sums, ctx.rows, ctx.S
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
        need_prefix = S > 0 and ctx.needs_input_grad[3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_prefix = hidden.new_empty(hidden.shape[0], S) if need_prefix else None
        grad_w = grad_b = None
        # One chunk-sized scratch buffer, reused (it stays in cache); the saved exps stay intact so a
        # retained graph can run backward again.
        scratch = torch.empty_like(exps[0]) if exps else None
        for i, start in enumerate(range(0, hidden.shape[0], rows)):
            total = sums[i]
            t = target[start:start + rows]
            valid = t != ctx.ignore_index
            w = torch.where(valid, grad_nll[start:start + rows], 0.0)  # (n,) per-token upstream gradient
            e = torch.mul(exps[i], (w / total).unsqueeze(1), out=scratch[: t.shape[0]])  # softmax * w
            e[torch.arange(t.shape[0], device=t.device), torch.where(valid, t, 0)] -= w  # - w * onehot
            if need_prefix:
                grad_prefix[start:start + rows] = e[:, :S]
            e = e[:, S:]  # (n, V - S): the classes the matmul scored
            h = hidden[start:start + rows]
            if need_h:
                torch.mm(e, weight, out=grad_h[start:start + rows])
            if need_w:
                if grad_w is None:
                    grad_w = torch.mm(e.t(), h, out=weight.new_empty(weight.shape))
                else:
                    grad_w.addmm_(e.t(), h)
            if need_b:
                grad_b = e.sum(0) if grad_b is None else grad_b.add_(e.sum(0))
        if need_w and grad_w is None:  # no rows at all
            grad_w = torch.zeros_like(weight)
        if need_b and grad_b is None:
            grad_b = weight.new_zeros(weight.shape[0])
        return grad_h, grad_w, grad_b, grad_prefix, None, None, None


def fusable(hidden: Tensor, weight: Tensor) -> bool:
    """Whether :func:`linear_nll` applies: same float32/float64 dtype, no autocast, no double backward."""
    return (
        hidden.dtype == weight.dtype
        and hidden.dtype in (torch.float32, torch.float64)
        and not torch.is_autocast_enabled(hidden.device.type)
    )


def linear_nll(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, ignore_index: int, rows: int | None = None,
    prefix: Tensor | None = None,
) -> Tensor:
    """Per-token NLL of ``softmax([prefix, hidden W^T + b])`` at ``target``; zero where ``target == ignore_index``.

    ``prefix`` holds already computed logits of the first ``S`` classes (Mixtape's gated frequent
    classes); ``weight`` and ``bias`` then score classes ``S..V-1``. Its gradient is returned too.

    Shape:
        hidden ``(N, d)``, weight ``(V - S, d)``, bias ``(V - S,)`` or None, prefix ``(N, S)`` or None,
        target ``(N,)`` ids in ``[0, V)`` -> ``(N,)``.
    """
    V = weight.shape[0] + (0 if prefix is None else prefix.shape[1])
    rows = rows or chunk_rows(V, hidden.element_size())
    chunks = max(1, -(-hidden.shape[0] // rows))
    rows = max(1, -(-hidden.shape[0] // chunks))  # even chunks: no thin remainder chunk for the matmuls
    return _LinearNLL.apply(hidden, weight, bias, prefix, target, ignore_index, rows)
