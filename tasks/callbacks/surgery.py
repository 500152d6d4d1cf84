"""Optimizer and DDP surgery after a DS-Softmax structure change, and freezing parameters.

Structure changes (mitosis, pruning: ``DSSoftmax.clone_experts`` / ``prune``) re-allocate head
parameters. :func:`apply_structure_change` then (1) swaps the new parameters into every
optimizer in place (:func:`heads.ds.interface.carry_optimizer_state`),
carrying each surviving or cloned row's state (Adam moments, momentum) over from its source row,
so learning-rate schedulers keep pointing at the same optimizer; and (2) rebuilds the DDP
wrapper, because DDP registers gradient hooks and buckets for the parameters it saw when it was
built: new parameters would silently never be all-reduced. Building the wrapper again also
broadcasts rank 0's parameters and buffers, so replicas stay bit-identical.

:func:`train_only` freezes every parameter but a list (``FreezeNetwork``: the head alone trains on
a pretrained network) and rebuilds the DDP wrapper for the parameters that still train.
"""

from __future__ import annotations

import lightning.pytorch as pl
from torch.nn.parallel import DistributedDataParallel

from heads.ds.interface import ParameterRemap, carry_optimizer_state


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

