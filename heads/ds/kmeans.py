"""Spherical (cosine) k-means, the clustering that places DS-Softmax experts in context space
(screening a softmax, :mod:`heads.ds.screening`; the inference benchmark, ``bench infer``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 8192  # rows of contexts per matmul: bounds the (CHUNK, K) similarities and (CHUNK, V) logits


def spherical_kmeans(points: Tensor, num_clusters: int, iterations: int = 15, generator: torch.Generator | None = None) -> Tensor:
    """Unit centroids ``(K, d)`` of the directions of ``points (N, d)`` (cosine k-means).

    Seeded with ``K`` distinct random points; a cluster that empties is re-seeded with the point
    least similar to its own centroid, so all ``K`` stay in use.
    """
    if not 1 <= num_clusters <= points.shape[0]:
        raise ValueError(f"spherical_kmeans needs 1 <= num_clusters <= {points.shape[0]} points, got {num_clusters}")
    unit = F.normalize(points.float(), dim=1)
    centroids = unit[torch.randperm(unit.shape[0], generator=generator)[:num_clusters]].clone()
    for _ in range(iterations):
        assignment, similarity = nearest(unit, centroids)
        sums = torch.zeros_like(centroids).index_add_(0, assignment, unit)
        counts = torch.bincount(assignment, minlength=num_clusters)
        for k in (counts == 0).nonzero().squeeze(1).tolist():
            worst = int(similarity.argmin())
            sums[k], similarity[worst] = unit[worst], float("inf")
        centroids = F.normalize(sums, dim=1)
    return centroids


def nearest(unit: Tensor, centroids: Tensor) -> tuple[Tensor, Tensor]:
    """Most similar centroid of each row and that similarity: ``(N, d), (K, d) -> (N,), (N,)``."""
    parts = [(chunk @ centroids.t()).max(dim=1) for chunk in unit.split(CHUNK)]
    return torch.cat([p.indices for p in parts]), torch.cat([p.values for p in parts])

