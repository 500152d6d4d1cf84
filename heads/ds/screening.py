"""A DS-Softmax structure screened from a trained full softmax: sparse inference, dense accuracy.

DS-Softmax trained as in the paper gives every expert its own class rows, each trained only on
the contexts routed to it. That can cost top-k accuracy against a softmax with the same
training budget, and the loss is then in the ranking
*inside* the chosen expert, not in which classes it keeps. This module keeps DS-Softmax's
inference structure (one expert per context, each expert scoring only its kept classes, packed
rows, :meth:`DSSoftmax.topk`) and takes the scores from a trained softmax instead:

1. **Experts from contexts.** Spherical k-means on the softmax model's hidden states ``h`` of
   training tokens gives ``K`` unit centroids; the gate is ``argmax_k c_k . h`` (the centroids
   are the gate rows; ``gate_scale="unit"``, so the gate only routes).
2. **Kept classes from what the softmax does there.** Over the training contexts routed to expert
   ``k``, ``n_(k,c)`` adds how often ``c`` is the target and how often it is in the softmax's top
   ``top``. Expert ``k`` keeps class ``c`` when ``n_(k,c) >= tau``; every class also stays in one
   *home* expert (where it was counted most, or, never counted, the expert whose centroid it
   scores highest: ``argmax_k w_c . c_k``), as ``keep_last_copy`` does for the lasso.
3. **Rows are the softmax's.** Every kept row of class ``c`` is a copy of ``w_c`` and the class
   bias is ``b``, so for a context whose expert keeps ``c`` the logit is exactly the softmax's.

``tau`` is either given (``min_count``) or the smallest count whose FLOPs reduction
``1 / Σ_k utilisation_k · kept_k / V`` (on the screening tokens) reaches ``flops_reduction``.
The construction follows the idea of screening a softmax by clustered contexts (Chen, Si, Kumar,
Li & Hsieh, ICLR 2019, "Learning to Screen for Fast Softmax Inference on Large Vocabulary Neural
Networks"), without its end-to-end (Gumbel-softmax) training of the screening: plain k-means
and counts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from heads.ds.build import pruned_head
from heads.ds.head import DSSoftmax
from heads.ds.interface import speedup
from heads.ds.kmeans import CHUNK, nearest, spherical_kmeans

def dense_topk(hidden: Tensor, weight: Tensor, bias: Tensor | None, k: int) -> Tensor:
    """The full softmax's top ``k`` classes per context, ``(N, d) -> (N, k)``, in row chunks."""
    return torch.cat([F.linear(chunk, weight, bias).topk(k, dim=1).indices for chunk in hidden.split(CHUNK)])


def kept_mask(counts: Tensor, home: Tensor, tau: float) -> Tensor:
    """``counts >= tau``, plus every class in its home expert and every expert's most counted class."""
    K, V = counts.shape
    mask = counts >= tau
    mask[home, torch.arange(V)] = True
    mask[torch.arange(K), counts.argmax(dim=1)] = True  # no expert left empty
    return mask


def screen_softmax(
    weight: Tensor,
    bias: Tensor | None,
    hidden: Tensor,
    targets: Tensor,
    num_experts: int,
    flops_reduction: float | None = None,
    min_count: float | None = None,
    top: int = 5,
    iterations: int = 15,
    generator: torch.Generator | None = None,
) -> tuple[DSSoftmax, dict[str, Any]]:
    """A :class:`DSSoftmax` (``gate_scale="unit"``, ``pruned_in_softmax=False``) screened from a
    softmax with class rows ``weight (V, d)`` and ``bias (V,)`` on training contexts ``hidden
    (N, d)`` with their ``targets (N,)``; pass exactly one of ``flops_reduction`` (> 1) and
    ``min_count`` (>= 1). Returns the head and a report (threshold, FLOPs reduction, coverage of
    the screening targets, kept fraction, copies per class, utilisation).
    """
    V, d = weight.shape
    if (flops_reduction is None) == (min_count is None):
        raise ValueError("screen_softmax needs exactly one of flops_reduction and min_count")
    if flops_reduction is not None and not float(flops_reduction) > 1.0:
        raise ValueError(f"screen_softmax needs flops_reduction > 1, got {flops_reduction} (e.g. 10 for a tenth of the work)")
    if min_count is not None and not float(min_count) >= 1.0:
        raise ValueError(f"screen_softmax needs min_count >= 1, got {min_count} (a class seen once in an expert is kept at 1)")
    if not 1 <= top <= V:
        raise ValueError(f"screen_softmax needs 1 <= top <= {V} classes, got {top}")
    if hidden.shape[0] != targets.shape[0] or hidden.shape[-1] != d:
        raise ValueError(f"screen_softmax got {tuple(hidden.shape)} contexts for {tuple(targets.shape)} targets and rows of width {d}")
    weight, hidden = weight.detach().float(), hidden.detach().float()
    bias = None if bias is None else bias.detach().float()
    centroids = spherical_kmeans(hidden, num_experts, iterations, generator)
    expert, _ = nearest(F.normalize(hidden, dim=1), centroids)
    counts = torch.zeros(num_experts, V)
    ones = torch.ones(expert.shape[0])
    counts.index_put_((expert, targets.long()), ones, accumulate=True)
    for column in dense_topk(hidden, weight, bias, top).t():
        counts.index_put_((expert, column), ones, accumulate=True)
    affinity = centroids @ weight.t()  # (K, V): where a never-counted class would score best
    home = torch.where(counts.sum(0) > 0, counts.argmax(0), affinity.argmax(0))
    utilisation = torch.bincount(expert, minlength=num_experts).float() / expert.shape[0]

    def reduction(mask: Tensor) -> float:
        return speedup(utilisation, mask.sum(1).float() / V)

    if min_count is not None:
        tau = float(min_count)
    else:  # the smallest integer count that reaches the target (reduction grows with tau)
        lo, hi = 1, max(1, int(counts.max()) + 1)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if reduction(kept_mask(counts, home, mid)) < flops_reduction else (lo, mid)
        tau = float(lo)
    mask = kept_mask(counts, home, tau)
    if flops_reduction is not None and reduction(mask) < flops_reduction:
        raise ValueError(
            f"screen_softmax cannot reach flops_reduction {flops_reduction} with {num_experts} experts: keeping every "
            f"class once gives {reduction(mask):.2f}x; use more experts or a smaller target"
        )
    head = pruned_head(mask, centroids, class_rows=weight, class_bias=bias, gate_scale="unit", pruned_in_softmax=False)
    report = {
        "num_experts": num_experts,
        "screening_tokens": int(expert.shape[0]),
        "top": top,
        "threshold": tau,
        "flops_reduction": reduction(mask),
        "coverage": float(mask[expert, targets.long()].float().mean()),
        "kept_fraction": float(mask.float().mean()),
        "copies_per_class": float(mask.sum(0).float().mean()),
        "utilisation": utilisation.tolist(),
    }
    return head, report
