"""The epoch from which a DS-Softmax head's routing loss is on (not in the paper)."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from tasks.callbacks.common import sparse_experts

WHERE = "trainer.callbacks.RoutingLoss.init_args"


class RoutingLoss(Callback):
    """Hold the head's routing-loss weight λ_route (``DSSoftmax.routing_loss_weight``, not in the
    paper) at 0 before ``from_epoch``; from it on the head's own value applies.

    λ_route itself is the head's ``routing_loss_weight`` (``head.init_args.routing_loss_weight``),
    read when the callback first sees the head; a head whose λ_route is 0 is refused, since the
    callback would then do nothing. The routing loss teaches the gate to send a context to an
    expert that keeps its target. Switched on while rows are still pruned it changes what gets
    pruned; started after the last pruning it only moves the routing over a fixed structure. A
    function of the epoch, so a resumed run gets the same schedule.

    Args:
        from_epoch: first epoch with the routing loss.
    """

    def __init__(self, from_epoch: int = 0) -> None:
        super().__init__()
        if from_epoch < 0:
            raise ValueError(f"RoutingLoss needs from_epoch >= 0, got {from_epoch} (set {WHERE}.from_epoch)")
        self.from_epoch = from_epoch
        #: The head's λ_route as configured (None until the callback has seen the head).
        self.weight: float | None = None
        self._head: object | None = None

    def weight_at(self, epoch: int) -> float:
        """λ_route at ``epoch`` (known once fitting started)."""
        if self.weight is None:
            raise RuntimeError("RoutingLoss.weight_at needs the head's routing_loss_weight: call it after fit starts")
        return self.weight if epoch >= self.from_epoch else 0.0

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = sparse_experts(pl_module, "RoutingLoss")
        if not hasattr(head, "routing_loss_weight"):
            raise TypeError(f"RoutingLoss needs a head with a routing loss (routing_loss_weight), got {type(head).__name__}; "
                            "use heads.DSSoftmax or remove the callback")
        if head is not self._head:  # the configured value, before this callback scheduled it
            if not head.routing_loss_weight > 0:
                raise ValueError(
                    f"RoutingLoss needs the head's routing_loss_weight > 0, got {head.routing_loss_weight} (set "
                    f"model.init_args.head.init_args.routing_loss_weight, e.g. 1.0, or remove the callback)"
                )
            self._head, self.weight = head, float(head.routing_loss_weight)
        head.routing_loss_weight = self.weight_at(trainer.current_epoch)

    # on_train_start too: Lightning skips on_train_epoch_start on some resumes.
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer, pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer, pl_module)
