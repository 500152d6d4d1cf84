"""Structure changes of a DS-Softmax head: pruning (Eq. 4), mitosis (App. B) and the rewind.

Each re-allocates the packed storage (:mod:`heads.ds.storage`) and returns
:data:`heads.ds.interface.ParameterRemap` triples, so the caller can carry optimizer state over
and rebuild the DDP wrapper (:mod:`heads.ds.surgery`); none of them touches either itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from heads.ds.interface import ParameterRemap
from heads.validation import check_nonnegative


class ExpertSurgery:
    """Mixin of :class:`heads.ds.DSSoftmax` over :class:`heads.ds.storage.PackedExperts`."""

    @torch.no_grad()
    def prune(self, threshold: float, optimizers=()) -> list[ParameterRemap]:
        """Remove rows with ``||W^e_(c,k)||_2 < threshold`` (Eq. 4), for good.

        A class's last kept row is never removed when ``keep_last_copy`` (its strongest row
        stays), and every expert keeps at least its strongest row so no expert becomes empty.
        Returns the remap of ``expert_weight`` (empty list when nothing was pruned). The
        ``optimizers`` given (plain PyTorch ones) get the new parameter in place of the old one,
        the kept rows' state carried over; under Lightning use
        :func:`heads.ds.surgery.apply_structure_change` with the returned remaps instead.
        """
        remaps = self._prune(threshold)
        _carry(optimizers, remaps)
        return remaps

    def _prune(self, threshold: float) -> list[ParameterRemap]:
        check_nonnegative(threshold, "threshold", "DSSoftmax.prune", "trainer.callbacks.GroupLassoPruning.init_args")
        norms = self.expert_weight.norm(dim=1)  # (R,)
        keep = norms >= threshold
        expert_of_row = self._expert_of_row()
        if self.keep_last_copy:
            copies = torch.bincount(self.class_index[keep], minlength=self.num_classes)  # (V,)
            orphan = copies == 0  # classes that would lose every row
            keep |= orphan[self.class_index] & _first_strongest(norms, self.class_index, self.num_classes)
        keep |= _first_strongest(norms, expert_of_row, self.num_experts)
        if bool(keep.all()):
            return []
        kept_rows = keep.nonzero().squeeze(1)  # (R',)
        counts = torch.bincount(expert_of_row[kept_rows], minlength=self.num_experts)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        old_gate, old_expert = self._replace(self.gate_weight, self.expert_weight[kept_rows], self.class_index[kept_rows], offsets)
        self.gate_weight = old_gate  # the gate is unchanged: keep the same Parameter object
        return [(old_expert, self.expert_weight, kept_rows)]

    @torch.no_grad()
    def clone_experts(self, noise: float = 0.01, generator: torch.Generator | None = None, optimizers=()) -> list[ParameterRemap]:
        """Mitosis (§2, Fig. 2, App. B): clone every expert, ``K -> 2K``; clone ``K + k`` copies expert ``k``.

        The sparsity is inherited: a clone copies only its parent's *kept* rows (the packed
        storage holds no others) and its gating row, so a pruned row is never recreated and
        memory doubles from the kept rows, not from ``K x V``. ``noise`` (relative to each
        tensor's standard deviation) is added to the clones so parent and clone receive
        different gate values and specialise; identical gating rows would tie and the argmax
        would always pick the parent. ``optimizers`` (plain PyTorch ones) get the new
        parameters in place, each clone starting from its parent's state; under Lightning use
        :func:`heads.ds.surgery.apply_structure_change` with the returned remaps instead.
        """
        remaps = self.split_experts(noise, generator)
        _carry(optimizers, remaps)
        return remaps

    @torch.no_grad()
    def split_experts(self, noise: float = 0.01, generator: torch.Generator | None = None) -> list[ParameterRemap]:
        """:meth:`clone_experts` without the optimizers (returns the remaps)."""
        check_nonnegative(noise, "noise", "DSSoftmax.split_experts", "trainer.callbacks.Mitosis.init_args")
        K, R = self.num_experts, self.expert_weight.shape[0]

        def jitter(weight: Tensor) -> Tensor:
            if noise == 0:
                return weight
            scale = noise * float(weight.std()) if weight.numel() > 1 else noise
            return weight + scale * torch.randn(weight.shape, generator=generator, device="cpu").to(weight)

        gate = torch.cat([self.gate_weight, jitter(self.gate_weight)])  # (2K, d)
        experts = torch.cat([self.expert_weight, jitter(self.expert_weight)])  # (2R, d)
        class_index = torch.cat([self.class_index, self.class_index])
        offsets = torch.cat([self.expert_offsets, self.expert_offsets[1:] + R])  # (2K+1,)
        old_gate, old_expert = self._replace(gate, experts, class_index, offsets)
        gate_rows = torch.arange(K, device=gate.device).repeat(2)
        expert_rows = torch.arange(R, device=experts.device).repeat(2)
        return [(old_gate, self.gate_weight, gate_rows), (old_expert, self.expert_weight, expert_rows)]


    @torch.no_grad()
    def rewind_rows(self, snapshot: dict[str, Tensor]) -> dict[str, Tensor | None]:
        """Give every kept row its value from ``snapshot`` (this head's ``state_dict()`` taken
        earlier with the same experts), matched by (expert, class); the class bias too.

        The structure stays: rows pruned since the snapshot stay pruned, and from now on they
        are out of the training softmax (``pruned_in_softmax`` becomes False, kept in the
        checkpoint's structure): under Eq. 4 the rewound model's validation loss was 40 at
        94.2 % accuracy, and training on under it fell to 21.8 %. The gate is *not*
        rewound: it keeps the routing the structure was selected under (with the snapshot's
        gate, 0.9 % of the 100x100 test contexts went to an expert that had pruned their class).
        Used by ``GroupLassoPruning(rewind=True)``. Returns ``{"expert_weight": source rows}``
        (plus ``"class_bias": None``, rewound whole), the snapshot row of each current row, so
        the caller can rewind row-wise optimizer state.
        """
        old_offsets = snapshot["expert_offsets"].to(self.expert_offsets.device)
        if old_offsets.numel() != self.expert_offsets.numel():
            raise ValueError(
                f"DSSoftmax.rewind_rows needs a snapshot with the head's {self.num_experts} experts, got "
                f"{old_offsets.numel() - 1} (no mitosis may happen between the snapshot and the rewind: end "
                f"Mitosis before GroupLassoPruning.lasso_from_epoch)"
            )
        K, V = self.num_experts, self.num_classes
        old_expert = torch.repeat_interleave(torch.arange(K, device=old_offsets.device), old_offsets.diff())
        old_keys = old_expert * V + snapshot["class_index"].to(old_offsets.device)  # ascending: packed by expert, sorted classes
        keys = self._expert_of_row() * V + self.class_index
        source = torch.searchsorted(old_keys, keys).clamp_max(old_keys.numel() - 1)
        if not bool((old_keys[source] == keys).all()):
            raise ValueError("DSSoftmax.rewind_rows: the head has rows the snapshot lacks (it must be taken before pruning starts)")
        self.expert_weight.copy_(snapshot["expert_weight"].to(self.expert_weight)[source])
        # The pruned rows were cut from a dense model, not shrunk to zero: Eq. 4 no longer
        # describes them, and the consistent distribution is the one inference uses.
        self.pruned_in_softmax = False
        rewound: dict[str, Tensor | None] = {"expert_weight": source}
        if self.class_bias is not None:
            self.class_bias.copy_(snapshot["class_bias"].to(self.class_bias))
            rewound["class_bias"] = None
        return rewound



def _carry(optimizers, remaps: list[ParameterRemap]) -> None:
    if optimizers and remaps:
        from heads.ds.surgery import carry_optimizer_state  # surgery imports the interface, not the head

        carry_optimizer_state(optimizers, remaps)


def _first_strongest(norms: Tensor, group: Tensor, num_groups: int) -> Tensor:
    """``(R,)`` bool: the strongest row of each group, one per group even when norms tie
    (the proximal lasso leaves many rows at exactly zero)."""
    best = torch.full((num_groups,), -1.0, device=norms.device, dtype=norms.dtype).scatter_reduce(0, group, norms, "amax")
    rows = torch.arange(norms.shape[0], device=norms.device)
    candidate = norms == best[group]
    first = torch.full((num_groups,), norms.shape[0], device=norms.device).scatter_reduce(
        0, group[candidate], rows[candidate], "amin")
    return first[group] == rows

