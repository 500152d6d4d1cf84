"""Builders of pruned DS-Softmax heads: a head whose experts keep given classes, made directly
in its compact form (no dense ``K x V x d`` tensor), and random structures for benchmarks.

Every pruned head built outside training goes through :func:`pruned_head`: the structure screened
from a trained softmax (:mod:`heads.ds.screening`, ``convert ds``), the one fitted to a softmax by
``bench infer``, and the random ones of ``bench ds`` and ``bench train``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from heads.ds.head import DSSoftmax


def random_kept_mask(num_experts: int, num_classes: int, redundancy: float, generator: torch.Generator) -> Tensor:
    """``(K, V)`` bool: every class kept by one expert drawn uniformly, every other (expert,
    class) pair kept with probability ``(redundancy - 1) / (K - 1)``, so a class is kept by
    ``redundancy`` experts on average; an expert left with no class keeps one drawn at random."""
    K, V = num_experts, num_classes
    if not 1.0 <= redundancy <= K:
        raise ValueError(f"random_kept_mask needs 1 <= redundancy <= num_experts={K}, got {redundancy}")
    keep = torch.zeros(K, V, dtype=torch.bool)
    keep[torch.randint(0, K, (V,), generator=generator), torch.arange(V)] = True  # every class once
    keep |= torch.rand(K, V, generator=generator) < (redundancy - 1.0) / max(1, K - 1)
    empty = (~keep.any(1)).nonzero().squeeze(1)
    keep[empty, torch.randint(0, V, (empty.numel(),), generator=generator)] = True  # no expert is empty
    return keep


@torch.no_grad()
def pruned_head(
    keep: Tensor,
    gate_weight: Tensor,
    *,
    rows: Tensor | None = None,
    class_rows: Tensor | None = None,
    class_bias: Tensor | None = None,
    **options: Any,
) -> DSSoftmax:
    """A :class:`DSSoftmax` whose expert ``k`` keeps exactly the classes ``keep[k]``.

    Args:
        keep: ``(K, V)`` bool, at least one class per expert.
        gate_weight: ``(K, d)`` gate rows ``W^g``.
        rows: ``(R, d)`` the kept rows, expert by expert and classes ascending inside an expert
            (the order of ``keep.nonzero()``); or
        class_rows: ``(V, d)`` one row per class, copied into every expert that keeps the class
            (a head screened from a softmax scores with the softmax's own rows).
        class_bias: ``(V,)`` the shared class bias, or None for a head without one.
        options: further :class:`DSSoftmax` arguments (``gate_scale``, ``pruned_in_softmax``, ...).

    The head is built with one expert (``V`` rows, a softmax's worth), then given its packed
    rows, so no dense ``K x V`` matrix is ever allocated.
    """
    if (rows is None) == (class_rows is None):
        raise ValueError("pruned_head needs exactly one of rows (packed) and class_rows (one per class)")
    K, V = keep.shape
    d = gate_weight.shape[1]
    experts, classes = keep.nonzero(as_tuple=True)  # expert-major, classes ascending inside an expert
    counts = torch.bincount(experts, minlength=K)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    packed = rows if rows is not None else class_rows[classes]  # (R, d)
    head = DSSoftmax(d, V, num_experts=1, class_bias=class_bias is not None, **options)
    head.set_experts(gate_weight, packed, classes, offsets)
    if class_bias is not None:
        head.class_bias.copy_(class_bias)
    return head
