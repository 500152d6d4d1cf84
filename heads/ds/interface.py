"""What DS-Softmax's callbacks, tools and analysis rely on: the sparse-experts interface, the
remap triple that structure changes return, and two small shared helpers (learning rate, speed-up)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

#: One re-allocated parameter: (old parameter, new parameter, for each new row the old row
#: it was copied from). Callbacks use it to carry optimizer state over (Mitosis, pruning).
ParameterRemap = tuple[nn.Parameter, nn.Parameter, Tensor]


@runtime_checkable
class SparseExperts(Protocol):
    """What the DS-Softmax callbacks and analysis need from a sparse mixture-of-experts head.

    Structure-changing methods return :data:`ParameterRemap` triples so the caller can
    rebuild optimizer state and the DDP wrapper; they never touch either themselves.
    """

    num_experts: int
    #: The head's ``num_experts`` argument: the experts it had before any structure change (K0 of Mitosis).
    initial_experts: int
    num_classes: int
    group_lasso_weight: float
    expert_lasso_weight: float
    load_balance_weight: float
    keep_last_copy: bool

    def kept_mask(self) -> Tensor: ...  # (K, V) bool

    def rows_per_expert(self) -> Tensor: ...  # (K,) long

    def route(self, hidden: Tensor) -> tuple[Tensor, Tensor]: ...  # (N,) expert, (N,) gate

    def prune(self, threshold: float) -> list[ParameterRemap]: ...

    def split_experts(self, noise: float, generator: torch.Generator | None = None) -> list[ParameterRemap]: ...

    def clone_experts(self, noise: float, generator: torch.Generator | None = None, optimizers: Any = ()) -> list[ParameterRemap]: ...

    def routing_counts(self) -> Tensor: ...  # (K,) contexts routed since the number of experts last changed

    def last_importance(self) -> Tensor | None: ...  # (K,) differentiable gate mass

    def memory_bytes(self) -> int: ...

    def structure(self) -> dict[str, Any]: ...

    def load_structure(self, structure: dict[str, Any]) -> None: ...

    def rewind_rows(self, snapshot: dict[str, Tensor]) -> dict[str, Tensor | None]: ...  # {rewound param: source rows}


def learning_rate_of(optimizer: Any, param: Tensor) -> float | None:
    """The learning rate of the param group holding ``param`` (None if no group holds it)."""
    for group in getattr(optimizer, "param_groups", []):
        if any(p is param for p in group["params"]):
            return float(group["lr"])
    return None


def speedup(utilisation: Tensor, kept_fraction: Tensor) -> float:
    """Theoretical speed-up ``1 / Σ_k utilisation_k · kept_fraction_k`` over a full softmax."""
    cost = float((utilisation * kept_fraction).sum())
    return 1.0 / cost if cost > 0 else float("inf")
