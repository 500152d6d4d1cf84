"""Sparse inference of DS-Softmax (§2.2): the gate, then only the chosen expert's kept rows.

:meth:`SparseInference.topk` answers from the chosen expert's kept classes, normalised over
them. Two inference caches, both dropped when the storage is re-allocated
(:meth:`heads.ds.storage.PackedExperts.clear_inference_cache`), keep the batch path to one matmul
per used expert: a ``(K, n_max)`` table of each expert's classes and a transposed copy of the
rows.

Under ``torch.export`` / ``torch.compile`` (:func:`torch.compiler.is_compiling`) ``topk`` and
``log_prob`` run :meth:`SparseInference._topk_traceable` / :meth:`SparseInference._log_prob_traceable`:
the same computation without the caches and Python-side sizes the eager paths use (a cached
view picked by ``int(expert)``, ``bincount(...).tolist()``, a ``(K, n_max)`` table), which a
tracer cannot follow. Each expert's rows and contexts are taken by ``narrow`` with sizes read
from ``expert_offsets`` and the routing counts (unbacked sizes), and each expert's block is
normalised and ranked on its own, its width padded by ``k`` slots at ``-inf`` so the result has
``k`` columns whatever the expert keeps. It still touches only the chosen experts' rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from heads.base import at_least_fp32


class SparseInference:
    """Mixin of :class:`heads.ds.DSSoftmax` over :class:`heads.ds.storage.PackedExperts`; uses
    the head's ``inverse_temperature`` (Eq. 2)."""

    def topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Sparse inference (§2.2): the ``k`` best of the chosen expert's kept classes.

        Only the gate and the chosen expert's rows are touched. Log-probabilities are
        normalised over that expert's kept classes. If an expert keeps fewer than ``k``
        classes, the missing slots hold index ``-1`` with log-probability ``-inf``.

        Shape:
            hidden ``(..., d)`` -> ``(log_probs, indices)``, each ``(..., k)``.
        """
        if torch.is_grad_enabled():  # entered only when needed: a no_grad context costs more than a small kernel
            with torch.no_grad():
                return self._topk(hidden, k)
        return self._topk(hidden, k)

    def _topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        if torch.compiler.is_compiling():  # torch.export / torch.compile: no caches, no host-side sizes
            values, indices = self._topk_traceable(hidden.reshape(-1, self.in_features), k)
            return values.view(*hidden.shape[:-1], k), indices.view(*hidden.shape[:-1], k)
        if hidden.shape[0] == 1 and hidden.dim() == 2:
            return self._topk_single(hidden.view(-1), k)
        flat = hidden.reshape(-1, self.in_features)  # (N, d)
        gate, expert = torch.softmax(at_least_fp32(F.linear(flat, self.gate_weight)), dim=-1).max(dim=-1)  # Eq. 1
        order = torch.argsort(expert)  # group contexts by expert: one matmul per used expert
        # Eq. 2: scaling h by the gate equals scaling the logits, and costs d instead of n_k
        scaled = flat[order] * self.inverse_temperature(gate[order]).unsqueeze(1).to(flat.dtype)  # (N, d), expert-major
        counts = torch.bincount(expert, minlength=self.num_experts).tolist()
        views = self._expert_rows()
        class_table = self._class_table()  # (K, n_max), -1 past each expert's kept classes
        # Each expert's logits go into one (N, n_max) buffer padded with -inf, so the per-expert
        # loop is a single matmul and the normalisation and top-k run once for the batch.
        logits = flat.new_full((flat.shape[0], class_table.shape[1]), -math.inf, dtype=torch.promote_types(flat.dtype, torch.float32))
        # (d, n_e) copies of the rows make these small matmuls ~2x faster (_inference_rows)
        transposed = self._inference_rows() if scaled.dtype == logits.dtype == self.expert_weight.dtype else None
        start = 0
        for e, m in enumerate(counts):
            if m:
                weight, classes = views[e]
                block = logits[start : start + m, : weight.shape[0]]  # (m, n_e)
                if transposed is None:
                    block.copy_(F.linear(scaled[start : start + m], weight, self.class_bias[classes] if self.class_bias is not None else None))
                elif transposed[e][1] is None:
                    torch.mm(scaled[start : start + m], transposed[e][0], out=block)
                else:
                    torch.addmm(transposed[e][1], scaled[start : start + m], transposed[e][0], out=block)
                start += m
        j = min(k, class_table.shape[1])
        log_probs = torch.log_softmax(logits, dim=1)
        # top-1 (greedy decoding, the benchmark) by max: ~2x faster than topk(1) on CPU
        values, pos = log_probs.max(dim=1, keepdim=True) if j == 1 else log_probs.topk(j, dim=1)  # (N, j), expert-major
        indices = class_table[expert[order].unsqueeze(1), pos]  # -1 where the expert ran out of classes
        values = values.masked_fill(indices < 0, -math.inf)
        if j < k:
            values = F.pad(values, (0, k - j), value=-math.inf)
            indices = F.pad(indices, (0, k - j), value=-1)
        unsort = torch.argsort(order)
        values, indices = values[unsort], indices[unsort]  # (N, k), back in input order
        return values.view(*hidden.shape[:-1], k), indices.view(*hidden.shape[:-1], k)

    def _topk_single(self, h: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """:meth:`topk` of one context ``h (d,)`` -> ``(1, k)`` each: the latency path of the paper's
        speed-up claim. Its kernels are tiny, so each Python-level tensor call (about 1 us) costs
        a sizeable part of the kept-row matmul: the path keeps to about eleven of them."""
        scores = torch.mv(self.gate_weight, h)  # (K,) gate logits
        expert = int(scores.argmax())  # the gate's argmax is its softmax's argmax (Eq. 1)
        weight, classes = self._expert_rows()[expert]
        # Eq. 2: scaling h by the gate equals scaling the logits, on d instead of n_k numbers
        scaled = h * self.inverse_temperature(torch.softmax(scores, 0)[expert])
        if self.class_bias is None:
            logits = torch.mv(weight, scaled)
        else:
            logits = torch.addmv(self.class_bias.index_select(0, classes), weight, scaled)
        log_probs = torch.log_softmax(at_least_fp32(logits), 0).view(1, -1)  # (1, n_e)
        if k == 1:  # greedy decoding: max is about twice as fast as topk(1)
            values, pos = log_probs.max(1, keepdim=True)
            return values, classes.view(1, -1).gather(1, pos)
        j = min(k, classes.numel())
        values, pos = log_probs.topk(j, dim=1)
        indices = classes.view(1, -1).gather(1, pos)
        if j < k:
            values = F.pad(values, (0, k - j), value=-math.inf)
            indices = F.pad(indices, (0, k - j), value=-1)
        return values, indices

    def _traced_experts(self, expert: Tensor) -> tuple[Tensor, list[tuple[Tensor, Tensor, int, int]]]:
        """For the traceable paths: the order grouping contexts by expert ``(N,)`` and, per
        expert, its kept rows ``(n_e, d)``, their classes ``(n_e,)``, where its contexts start in
        that order and how many there are. Sizes are read from tensors (unbacked under export);
        the loop runs over all ``K`` experts, a fixed number, and an unused one costs empty ops."""
        R, N = self.expert_weight.shape[0], expert.shape[0]
        order = torch.argsort(expert)  # group contexts by expert
        counts = torch.zeros_like(self.expert_offsets[1:]).index_add_(0, expert, torch.ones_like(expert))  # (K,), bincount of fixed size
        bounds, sizes = self.expert_offsets.tolist(), counts.tolist()
        blocks, start = [], 0
        for e in range(self.num_experts):
            a, n, m = bounds[e], bounds[e + 1] - bounds[e], sizes[e]
            # the storage's invariants (heads.ds.storage), stated for the tracer
            torch._check(a >= 0)
            torch._check(n >= 1)
            torch._check(a + n <= R)
            torch._check(m >= 0)
            torch._check(start + m <= N)
            blocks.append((self.expert_weight.narrow(0, a, n), self.class_index.narrow(0, a, n), start, m))
            start = start + m
        return order, blocks

    def _topk_traceable(self, flat: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """:meth:`topk` of ``flat (N, d)`` as a tracer can follow it (module docstring): per
        expert, its contexts' logits over its kept classes, normalised and ranked block by block.

        Shape:
            flat ``(N, d)`` -> ``(log_probs, indices)``, each ``(N, k)``.
        """
        gate, expert = torch.softmax(at_least_fp32(F.linear(flat, self.gate_weight)), dim=-1).max(dim=-1)  # Eq. 1
        order, blocks = self._traced_experts(expert)
        # Eq. 2: scaling h by the gate equals scaling the logits
        scaled = flat[order] * self.inverse_temperature(gate[order]).unsqueeze(1).to(flat.dtype)  # (N, d), expert-major
        dtype = torch.promote_types(flat.dtype, torch.float32)
        values = flat.new_full((flat.shape[0], k), -math.inf, dtype=dtype)  # (N, k), expert-major
        indices = torch.full((flat.shape[0], k), -1, dtype=torch.long, device=flat.device)
        for weight, classes, start, m in blocks:
            bias = self.class_bias.index_select(0, classes) if self.class_bias is not None else None
            logits = F.linear(scaled.narrow(0, start, m), weight, bias)  # (m, n_e)
            log_probs = F.pad(torch.log_softmax(logits.to(dtype), dim=1), (0, k), value=-math.inf)  # (m, n_e + k)
            top, pos = log_probs.topk(k, dim=1)  # (m, k); a position past n_e is a padding slot
            values = values.slice_scatter(top, 0, start, start + m)
            indices = indices.slice_scatter(F.pad(classes, (0, k), value=-1)[pos], 0, start, start + m)
        unsort = torch.argsort(order)
        return values[unsort], indices[unsort]  # (N, k), back in input order

    def _log_prob_traceable(self, hidden: Tensor) -> Tensor:
        """:meth:`heads.ds.DSSoftmax.log_prob` as a tracer can follow it: each expert's logits
        written into its contexts' rows of the ``(N, V)`` logits.

        Shape: ``(..., d) -> (..., V)``.
        """
        flat = hidden.reshape(-1, self.in_features)  # (N, d)
        gate, expert = torch.softmax(at_least_fp32(F.linear(flat, self.gate_weight)), dim=-1).max(dim=-1)  # Eq. 1
        order, blocks = self._traced_experts(expert)
        logits = flat.new_zeros(flat.shape[0], self.num_classes, dtype=torch.promote_types(flat.dtype, torch.float32))  # (N, V)
        if not self.pruned_in_softmax:
            logits = logits.fill_(-math.inf)  # only the chosen expert's kept classes get a score
        elif self.class_bias is not None:
            logits = logits + self.class_bias.to(logits)  # pruned classes score their bias
        for weight, classes, start, m in blocks:
            rows = order.narrow(0, start, m)  # (m,) this expert's contexts
            expert_logits = self._expert_logits(flat[rows], gate[rows], weight, classes)  # (m, n_e)
            logits = logits.index_put((rows.unsqueeze(1), classes.unsqueeze(0)), expert_logits.to(logits.dtype))
        return torch.log_softmax(logits, dim=-1).view(*hidden.shape[:-1], self.num_classes)

    def _class_table(self) -> Tensor:
        """``(K, n_max)`` class ids of each expert's kept rows, padded with -1 (inference cache)."""
        self._expert_rows()  # refreshes the cache key
        if self._classes_padded is None:
            n_max = max(classes.numel() for _, classes in self._views)
            table = torch.full((self.num_experts, n_max), -1, dtype=torch.long, device=self.class_index.device)
            for e, (_, classes) in enumerate(self._views):
                table[e, : classes.numel()] = classes
            self._classes_padded = table
        return self._classes_padded

    def _inference_rows(self) -> list[tuple[Tensor, Tensor | None]] | None:
        """Per expert, its kept rows transposed ``(d, n_k)`` and their class bias ``(n_k,)`` or None;
        an inference cache for the batch path of :meth:`topk` in eval mode (built on its first
        call), or None (training mode, or where it cannot be kept).

        On CPU BLAS a matmul of a few contexts with ``(d, n_k)`` columns is about twice as fast
        as with ``(n_k, d)`` rows, and the batch path runs
        one such matmul per used expert. The copy costs as much memory as the kept rows and is
        rebuilt when the weights change: its key holds the storage and version counter of the
        rows and the bias, which in-place updates bump (``load_state_dict``, the lasso's
        shrinkage, the rewind, non-fused optimizers); pruning and mitosis re-allocate and drop it;
        it is not used in training mode, and switching to training mode and every optimizer step
        of a task (``after_optimizer_step``) drop it, since fused optimizers (``fused=True``) and
        writes through ``.data`` bypass version counters: outside a task, after such writes in
        eval mode, call ``clear_inference_cache()``.
        Weights made under ``torch.inference_mode`` have no version counter: nothing is cached.
        """
        weight, bias = self.expert_weight, self.class_bias
        if self.training or weight.is_inference() or (bias is not None and bias.is_inference()):
            return None
        key = (weight.data_ptr(), weight._version) + ((bias.data_ptr(), bias._version) if bias is not None else ())
        if self._inference_cache is None or self._inference_cache[0] != key:
            self._expert_rows()  # sets self._bounds
            with torch.no_grad():
                transposed = weight.detach().t().contiguous()  # (d, R)
                packed_bias = bias.detach()[self.class_index] if bias is not None else None  # (R,)
            bounds = self._bounds
            self._inference_cache = (key, [
                (transposed[:, a:b], packed_bias[a:b] if packed_bias is not None else None)
                for a, b in zip(bounds[:-1], bounds[1:])
            ])
        return self._inference_cache[1]
