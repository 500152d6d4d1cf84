"""Packed expert storage of DS-Softmax: the kept rows of all experts in one matrix.

The kept rows of all experts are packed into one ``(R, d)`` matrix, expert ``k`` owning rows
``expert_offsets[k]:expert_offsets[k+1]`` with its classes ascending, and ``class_index`` says
which class each row scores. Pruning removes rows and mitosis appends clones
(:mod:`heads.ds.structure`), so memory is proportional to the kept entries, never to ``K * V``.
This module owns the parameters and index buffers, the per-expert views and inference caches
built on them, the structure metadata that lets a checkpoint resize a fresh head before its
weights are loaded, and the proximal group-lasso step that shrinks the packed rows in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from heads.base import OutputHead, at_least_fp32


class PackedExperts(OutputHead):
    """Gate rows ``W^g (K, d)``, packed expert rows ``W^e (R, d)``, their classes and offsets,
    and an optional class bias ``b (V,)``; the head on top (:class:`heads.ds.DSSoftmax`) routes
    and scores with them."""

    def _allocate(self, num_experts: int, init_std: float, class_bias: bool) -> None:
        """Dense start: every expert keeps all ``V`` classes; rows are packed expert by expert."""
        K, V, d = num_experts, self.num_classes, self.in_features
        self.gate_weight = nn.Parameter(torch.randn(K, d) * init_std)  # W^g, (K, d)
        self.expert_weight = nn.Parameter(torch.randn(K * V, d) * init_std)  # packed W^e, (R, d)
        self.register_buffer("class_index", torch.arange(V).repeat(K))  # (R,)
        self.register_buffer("expert_offsets", torch.arange(K + 1) * V)  # (K+1,)
        self.class_bias = nn.Parameter(torch.zeros(V)) if class_bias else None  # b, (V,)
        self._views: list[tuple[Tensor, Tensor]] | None = None
        self._bounds: list[int] = []
        self._classes_padded: Tensor | None = None
        self._inference_cache: tuple[tuple[int, ...], list[tuple[Tensor, Tensor | None]]] | None = None
        self._structure_pinned = False

    @property
    def num_experts(self) -> int:
        return self.gate_weight.shape[0]

    def rows_per_expert(self) -> Tensor:
        """Kept classes of each expert, ``(K,)``."""
        return self.expert_offsets.diff()

    def kept_mask(self) -> Tensor:
        """Dense ``(K, V)`` view of which classes each expert keeps (for analysis only)."""
        mask = torch.zeros(self.num_experts, self.num_classes, dtype=torch.bool, device=self.class_index.device)
        mask[self._expert_of_row(), self.class_index] = True
        return mask

    def dense_expert_weight(self) -> Tensor:
        """``(K, V, d)`` weights with pruned rows as zeros (reference implementations and tests)."""
        dense = self.expert_weight.new_zeros(self.num_experts, self.num_classes, self.in_features)
        dense[self._expert_of_row(), self.class_index] = self.expert_weight
        return dense

    def _expert_of_row(self) -> Tensor:
        return torch.repeat_interleave(torch.arange(self.num_experts, device=self.class_index.device), self.rows_per_expert())

    def _expert_rows(self) -> list[tuple[Tensor, Tensor]]:
        """Per expert, ``(n_k, d)`` kept rows and ``(n_k,)`` their classes (sorted).

        Without autograd (inference) the slices are cached: they are views sharing storage with
        the packed parameter, so they stay valid across optimizer steps and in-place
        ``load_state_dict``; re-allocation (structure change, ``.to``) clears the cache.
        With autograd the pieces are split afresh so each step builds its own graph.
        """
        if self._views is None:
            self._classes_padded = None
            bounds = self.expert_offsets.tolist()
            with torch.no_grad():
                self._views = [
                    (self.expert_weight[bounds[k] : bounds[k + 1]], self.class_index[bounds[k] : bounds[k + 1]])
                    for k in range(self.num_experts)
                ]
            self._bounds = bounds
        if torch.is_grad_enabled() and self.expert_weight.requires_grad:
            # One split, not K slices: each slice's backward would allocate a gradient of the
            # whole packed matrix, while split's backward concatenates the K pieces once.
            sizes = [b - a for a, b in zip(self._bounds[:-1], self._bounds[1:])]
            return [(weight, classes) for weight, (_, classes) in zip(self.expert_weight.split(sizes), self._views)]
        return self._views

    def clear_inference_cache(self) -> None:
        """Drop the inference caches: row views, class table and the transposed copy of the rows
        the batch ``topk`` keeps (as large as the kept rows; call this to free it)."""
        self._views = None
        self._inference_cache = None

    def train(self, mode: bool = True) -> "PackedExperts":
        if mode:
            self._inference_cache = None  # training updates the weights (see _inference_rows)
        return super().train(mode)

    def _apply(self, fn, recurse=True):
        self.clear_inference_cache()  # .to() / .cuda() / .half() re-allocate the storage the views point at
        return super()._apply(fn, recurse)

    def _per_expert_sum(self, per_row: Tensor) -> Tensor:
        """``(K,)`` sums of a per-row quantity over each expert's rows."""
        return per_row.new_zeros(self.num_experts).index_add(0, self._expert_of_row(), per_row)

    def memory_bytes(self) -> int:
        """Bytes of the head's parameters and buffers (proportional to kept rows)."""
        tensors = list(self.parameters()) + list(self.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ re-allocation
    def _replace(self, gate_weight: Tensor, expert_weight: Tensor, class_index: Tensor, offsets: Tensor) -> tuple[nn.Parameter, nn.Parameter]:
        """Re-allocate the parameters and index buffers with new contents; returns the old
        parameters (callers turn them into :data:`heads.ds.interface.ParameterRemap` triples)."""
        old_gate, old_expert = self.gate_weight, self.expert_weight
        self.gate_weight = nn.Parameter(gate_weight.detach().clone(), requires_grad=old_gate.requires_grad)
        self.expert_weight = nn.Parameter(expert_weight.detach().clone(), requires_grad=old_expert.requires_grad)
        self.class_index = class_index.to(self.class_index.device)
        self.expert_offsets = offsets.to(self.expert_offsets.device)
        self.clear_inference_cache()
        return old_gate, old_expert

    @torch.no_grad()
    def set_experts(self, gate_weight: Tensor, expert_weight: Tensor, class_index: Tensor, expert_offsets: Tensor) -> None:
        """Give the head experts built elsewhere (:mod:`heads.ds.build`):
        ``gate_weight (K, d)``, packed rows ``(R, d)`` with their classes ``(R,)``, expert ``k``
        owning rows ``expert_offsets[k]:expert_offsets[k+1]``, classes ascending inside an expert.
        The parameters are re-allocated (build the optimizer afterwards)."""
        K, d, V = gate_weight.shape[0], self.in_features, self.num_classes
        offsets = expert_offsets.long()
        R = expert_weight.shape[0]
        rows = offsets.diff() if offsets.numel() == K + 1 else None
        problem = None
        if gate_weight.shape != (K, d) or K < 1 or expert_weight.shape != (R, d) or class_index.shape != (R,):
            problem = f"shapes gate {tuple(gate_weight.shape)}, rows {tuple(expert_weight.shape)}, classes {tuple(class_index.shape)} (need (K, {d}), (R, {d}), (R,))"
        elif rows is None or int(offsets[0]) != 0 or int(offsets[-1]) != R or bool((rows < 1).any()):
            problem = f"expert_offsets {offsets.tolist()[:8]}... must run from 0 to {R} over {K} non-empty experts"
        elif R and not (0 <= int(class_index.min()) and int(class_index.max()) < V):
            problem = f"class ids outside 0..{V - 1}"
        else:
            expert_of_row = torch.repeat_interleave(torch.arange(K), rows)
            keys = expert_of_row * V + class_index.long().cpu()
            if bool((keys.diff() <= 0).any()):
                problem = "classes must be ascending and distinct inside each expert"
        if problem is not None:
            raise ValueError(f"DSSoftmax.set_experts: {problem}; build the arguments as heads.ds.build does")
        self._replace(gate_weight.to(self.gate_weight), expert_weight.to(self.expert_weight), class_index.long(), offsets)

    def structure(self) -> dict[str, Any]:
        """Sizes needed to rebuild the parameters before a state dict is loaded."""
        return {
            "num_experts": self.num_experts,
            "num_classes": self.num_classes,
            "in_features": self.in_features,
            "rows_per_expert": self.rows_per_expert().tolist(),
        }

    def load_structure(self, structure: dict[str, Any]) -> None:
        """Resize parameters and index buffers to ``structure`` (values come from the state dict)."""
        rows = [int(n) for n in structure.get("rows_per_expert", [])]
        K = int(structure.get("num_experts", -1))
        for key, mine in (("num_classes", self.num_classes), ("in_features", self.in_features)):
            if int(structure.get(key, mine)) != mine:
                raise ValueError(
                    f"DSSoftmax checkpoint structure has {key}={structure[key]} but this head has {mine} "
                    f"(build the model with the data and encoder the checkpoint was trained with)"
                )
        if K < 1 or len(rows) != K or any(not 1 <= n <= self.num_classes for n in rows):
            raise ValueError(
                f"DSSoftmax checkpoint structure is inconsistent: num_experts={K} with rows_per_expert of "
                f"length {len(rows)} (each must be in 1..{self.num_classes}); the checkpoint is corrupt or "
                f"was not written by DSSoftmax"
            )
        counts = torch.tensor(rows)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        device = self.expert_weight.device
        self._structure_pinned = True  # the next load_state_dict must match these sizes exactly
        self._replace(
            torch.zeros(K, self.in_features, device=device),
            torch.zeros(int(offsets[-1]), self.in_features, device=device),
            torch.zeros(int(offsets[-1]), dtype=torch.long),
            offsets,
        )

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        names = ("gate_weight", "expert_weight", "class_index", "expert_offsets")
        incoming = {name: state_dict.get(prefix + name) for name in names}
        mismatch = [n for n, t in incoming.items() if t is not None and t.shape != getattr(self, n).shape]
        if mismatch and self._structure_pinned:
            # load_structure() set the sizes from the checkpoint's metadata: the weights must agree.
            # One line instead of PyTorch's multi-line size-mismatch report.
            name = mismatch[0]
            raise ValueError(
                f"DSSoftmax {name} in the checkpoint has shape {tuple(incoming[name].shape)} but the "
                f"expert structure says {tuple(getattr(self, name).shape)}: the checkpoint's head_structure "
                f"does not match its weights (re-save it from a run, or load it with the matching head)"
            )
        if mismatch and all(t is not None for t in incoming.values()):
            # A plain state dict (no metadata, e.g. DDP-spawn handing weights back to the main
            # process) still carries the whole structure in expert_offsets and class_index.
            offsets, gate, experts = incoming["expert_offsets"], incoming["gate_weight"], incoming["expert_weight"]
            if offsets.numel() != gate.shape[0] + 1 or not int(offsets[-1]) == experts.shape[0] == incoming["class_index"].numel():
                raise ValueError(
                    f"DSSoftmax state dict is inconsistent: {gate.shape[0]} gate rows, {offsets.numel()} expert "
                    f"offsets ending at {int(offsets[-1])}, {experts.shape[0]} expert rows (the checkpoint is corrupt)"
                )
            self.load_structure({"num_experts": gate.shape[0], "rows_per_expert": offsets.diff().tolist(),
                                 "num_classes": self.num_classes, "in_features": self.in_features})
        self._structure_pinned = False
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        self.clear_inference_cache()

    @torch.no_grad()
    def proximal_lasso(self, row_shrink: float, expert_shrink: float = 0.0) -> None:
        """Block soft-thresholding: ``w <- w * max(0, 1 - shrink / ||w||)`` per row, then per expert."""
        weight = self.expert_weight
        if row_shrink > 0:
            norms = at_least_fp32(weight).norm(dim=1, keepdim=True)  # (R, 1)
            weight.mul_((1 - row_shrink / norms.clamp_min(1e-30)).clamp_min(0).to(weight.dtype))
        if expert_shrink > 0:
            squared = at_least_fp32(weight).pow(2).sum(1)
            scale = (1 - expert_shrink / self._per_expert_sum(squared).sqrt().clamp_min(1e-30)).clamp_min(0)  # (K,)
            weight.mul_(scale.repeat_interleave(self.rows_per_expert()).unsqueeze(1).to(weight.dtype))
