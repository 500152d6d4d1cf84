"""What DS-Softmax's callbacks, tools and analysis rely on: the sparse-experts interface, the
remap triple that structure changes return, carrying optimizer state along a remap, and the
theoretical speed-up."""

from __future__ import annotations

from typing import Any, Iterable, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

#: One re-allocated parameter: (old parameter, new parameter, for each new row the old row
#: it was copied from). Callbacks use it to carry optimizer state over (Mitosis, pruning).
ParameterRemap = tuple[nn.Parameter, nn.Parameter, Tensor]


@runtime_checkable
class SparseExperts(Protocol):
    """What the DS-Softmax callbacks (``tasks.callbacks``) and analysis need from a sparse
    mixture-of-experts head.

    Structure-changing methods return :data:`ParameterRemap` triples so the caller can
    rebuild optimizer state and the DDP wrapper; given plain PyTorch ``optimizers`` they carry
    the state over themselves (:func:`carry_optimizer_state`), and never touch a DDP wrapper.
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

    def prune(self, threshold: float, optimizers: Any = ()) -> list[ParameterRemap]: ...

    def split_experts(self, noise: float, generator: torch.Generator | None = None) -> list[ParameterRemap]: ...

    def clone_experts(self, noise: float, generator: torch.Generator | None = None, optimizers: Any = ()) -> list[ParameterRemap]: ...

    def routing_counts(self) -> Tensor: ...  # (K,) contexts routed since the number of experts last changed

    def last_importance(self) -> Tensor | None: ...  # (K,) differentiable gate mass

    def memory_bytes(self) -> int: ...

    def structure(self) -> dict[str, Any]: ...

    def load_structure(self, structure: dict[str, Any]) -> None: ...


def remap_state(state: dict[str, Any], old_rows: int, source_rows: Tensor) -> dict[str, Any]:
    """Row-wise optimizer state (moments, momentum) follows its source row; scalars (step) stay."""
    remapped = {}
    for key, value in state.items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == old_rows:
            remapped[key] = value.index_select(0, source_rows.to(value.device))
        else:
            remapped[key] = value
    return remapped


def carry_optimizer_state(optimizers: Iterable[torch.optim.Optimizer], remaps: list[ParameterRemap]) -> None:
    """Swap re-allocated parameters into plain PyTorch optimizers in place, each surviving or
    cloned row taking its source row's state, so learning-rate schedulers keep pointing at the
    same optimizer objects."""
    for optimizer in optimizers:
        for old, new, source_rows in remaps:
            for group in optimizer.param_groups:
                for i, param in enumerate(group["params"]):
                    if param is old:
                        group["params"][i] = new
                        if old in optimizer.state:
                            optimizer.state[new] = remap_state(optimizer.state.pop(old), old.shape[0], source_rows)


def speedup(utilisation: Tensor, kept_fraction: Tensor) -> float:
    """Theoretical speed-up ``1 / Σ_k utilisation_k · kept_fraction_k`` over a full softmax."""
    cost = float((utilisation * kept_fraction).sum())
    return 1.0 / cost if cost > 0 else float("inf")
