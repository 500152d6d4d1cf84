"""The sigmoid tree decomposition of Mixtape's gates (Yang et al., NeurIPS 2019, Eq. 3),
generalised from the paper's ``K = 4`` to any ``K = 2^m``: ``K - 1`` gate logits sit on the
internal nodes of a complete binary tree of depth ``m`` (heap order, root first); ``pi_k`` is the
product along the root-to-leaf path of ``sigmoid(l)`` for a left turn and ``sigmoid(-l)`` for a
right turn, so the ``K`` priors sum to one by construction. :func:`tree_mix` mixes leaves by those
priors without forming them.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sigmoid_tree(gate_logits: Tensor) -> Tensor:
    """Priors from gate logits by the sigmoid tree decomposition (Eq. 3, any ``K = 2^m``).

    Shape:
        gate_logits ``(N, K - 1, *rest)`` in heap order -> priors ``(N, K, *rest)``.
    """
    num_gates = gate_logits.shape[1] + 1
    prior = torch.ones_like(gate_logits[:, :1])  # (N, 1, *rest): the root holds all the mass
    start, width = 0, 1
    while width < num_gates:
        level = gate_logits[:, start : start + width]  # (N, width, *rest): one depth of the tree
        left, right = prior * torch.sigmoid(level), prior * torch.sigmoid(-level)
        # Children of level position i are positions 2i (left) and 2i + 1 (right) one level down.
        prior = torch.stack([left, right], dim=2).flatten(1, 2)  # (N, 2 width, *rest)
        start, width = start + width, 2 * width
    return prior


def tree_mix(leaves: Tensor, gate_logits: Tensor) -> Tensor:
    """``sum_k pi_k leaves_k`` with ``pi`` from the sigmoid tree, without forming ``pi``.

    Evaluated bottom-up: each internal node ``j`` with gate ``gamma_j = sigmoid(l_j)`` holds
    ``gamma_j * left + (1 - gamma_j) * right`` (one ``lerp``), which expands to exactly the
    path products of Eq. 3. ``K - 1`` lerps replace building ``(N, K, ...)`` priors and a
    weighted sum, which matters for the ``(N, K, S)`` frequent-token block.

    Shape:
        leaves ``(N, K, *rest)``, gate_logits ``(N, K - 1, *rest)`` (broadcastable over
        ``rest``) -> ``(N, *rest)``.
    """
    num_gates = leaves.shape[1]
    depth = num_gates.bit_length() - 1
    # Per-depth gate blocks via split (its backward is one cat, not a zero-filled buffer per slice).
    levels = gate_logits.split([2**t for t in range(depth)], dim=1)  # (N, 2^t, *rest) each
    values = leaves
    for gate_level in reversed(levels):
        width = gate_level.shape[1]
        # Children of depth position i are positions 2i (left, weight gamma) and 2i + 1 (right).
        left, right = values.unflatten(1, (width, 2)).unbind(2)  # (N, width, *rest) each
        values = torch.lerp(right, left, torch.sigmoid(gate_level))  # (N, width, *rest)
    return values[:, 0]
