"""Optimizer and DDP surgery after a DS-Softmax structure change, and the rewind of weights.

Structure changes (mitosis, pruning: ``DSSoftmax.clone_experts`` / ``prune``) re-allocate head
parameters. :func:`apply_structure_change` then (1) swaps the new parameters into every
optimizer in place (:func:`heads.ds.interface.carry_optimizer_state`),
carrying each surviving or cloned row's state (Adam moments, momentum) over from its source row,
so learning-rate schedulers keep pointing at the same optimizer; and (2) rebuilds the DDP
wrapper, because DDP registers gradient hooks and buckets for the parameters it saw when it was
built: new parameters would silently never be all-reduced. Building the wrapper again also
broadcasts rank 0's parameters and buffers, so replicas stay bit-identical.

The rewind (``GroupLassoPruning(rewind=True)``) gives the module's parameters and their
optimizer state the values of a snapshot taken before the pruning phase, head rows matched by
(expert, class); the refit freezes everything but a list of parameters.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from heads.ds.interface import ParameterRemap, SparseExperts, carry_optimizer_state, remap_state


def apply_structure_change(trainer: pl.Trainer, remaps: list[ParameterRemap]) -> None:
    """Carry optimizer state over to re-allocated parameters and rebuild the DDP wrapper."""
    if not remaps:
        return
    carry_optimizer_state(trainer.optimizers, remaps)
    rebuild_ddp(trainer)


def rebuild_ddp(trainer: pl.Trainer) -> None:
    """DDP only reduces the parameters it was built with, those that required grad then (see the
    module docstring): rebuild the wrapper after parameters were added, replaced or frozen."""
    strategy = trainer.strategy
    # Lightning's public API has no call that re-wraps a module once fitting runs (strategy.setup
    # would also rebuild optimizers and precision plugins): _setup_model is what DDPStrategy.setup
    # itself uses to wrap it. tests/test_ds_callbacks.py's two-process DDP mitosis test pins that
    # the parameters added by cloning are all-reduced and the replicas stay identical.
    if isinstance(getattr(strategy, "model", None), DistributedDataParallel):
        strategy.model = strategy._setup_model(strategy.model.module)
        if hasattr(strategy, "_register_ddp_hooks"):
            strategy._register_ddp_hooks()


def take_snapshot(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """CPU copies of the module's state and, per optimizer, each parameter's state by name."""
    names = {id(p): n for n, p in pl_module.named_parameters()}
    optim = []
    for optimizer in trainer.optimizers:
        optim.append({
            names[id(p)]: {k: v.detach().cpu().clone() if isinstance(v, Tensor) else v for k, v in state.items()}
            for p, state in optimizer.state.items() if id(p) in names
        })
    module = {n: t.detach().cpu().clone() for n, t in pl_module.state_dict().items()}
    return {"module": module, "optimizers": optim}


def prefix_of(pl_module: torch.nn.Module, head: torch.nn.Module) -> str:
    """``"<name>."`` of ``head`` inside ``pl_module`` (``""`` if it is the module itself)."""
    name = next(n for n, m in pl_module.named_modules() if m is head)
    return f"{name}." if name else ""


def train_only(trainer: pl.Trainer, pl_module: pl.LightningModule, names: list[str]) -> bool:
    """Freeze every parameter of the module but ``names``; rebuild DDP if that changed anything
    (and say so)."""
    changed = False
    for name, param in pl_module.named_parameters():
        trainable = name in names
        if param.requires_grad != trainable:
            param.requires_grad_(trainable)
            changed = True
    if changed:
        rebuild_ddp(trainer)
    return changed


@torch.no_grad()
def rewind(trainer: pl.Trainer, pl_module: pl.LightningModule, head: SparseExperts, snapshot: dict[str, Any]) -> list[str]:
    """Give the module's parameters and their optimizer state the snapshot's values, rows of the
    sparse-experts head matched by (expert, class) so the pruned structure stays; the head's
    parameters it does not rewind (the gate) keep theirs. Returns the names of the head's
    rewound parameters."""
    prefix = prefix_of(pl_module, head)
    module = snapshot["module"]
    row_sources = {prefix + n: rows for n, rows in head.rewind_rows(
        {n[len(prefix):]: t for n, t in module.items() if n.startswith(prefix)}).items()}
    head_params = {prefix + n for n, _ in head.named_parameters()}
    params = {n: p for n, p in pl_module.named_parameters() if n not in head_params or n in row_sources}
    for name, param in params.items():
        if name not in head_params:
            if module[name].shape != param.shape:
                raise ValueError(f"GroupLassoPruning rewind: {name} changed shape during the pruning phase "
                                 f"({tuple(module[name].shape)} -> {tuple(param.shape)}); only head rows may be pruned")
            param.copy_(module[name].to(param))
    ids = {id(p): n for n, p in params.items()}
    for optimizer, saved in zip(trainer.optimizers, snapshot["optimizers"]):
        for param in list(optimizer.state):
            name = ids.get(id(param))
            if name is None or name not in saved:
                continue
            current, state, rows = optimizer.state[param], saved[name], row_sources.get(name)  # rows: None = whole tensor
            if rows is not None:
                state = remap_state(state, module[name].shape[0], rows)
            optimizer.state[param] = {
                key: value.to(current[key].device if key in current else param.device) if isinstance(value, Tensor) else value
                for key, value in state.items()
            }
    return sorted(row_sources)
