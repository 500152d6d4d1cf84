"""DS-Softmax: a sparse mixture of sparse experts (Doubly Sparse softmax, Liao et al. 2019).

A gating network picks one of ``K`` experts per context; each expert is a softmax over a
*subset* of the vocabulary. Group lasso drives whole class rows of an expert to zero, and
rows whose norm falls below a threshold are removed for good, so at inference a context
pays for the gate plus the chosen expert's kept rows instead of all ``V`` classes. This module
holds the method (routing, loss, inference, regularisers); the packed rows live in
:mod:`heads.ds.storage`, structure changes in :mod:`heads.ds.structure`.

Semantics of pruned classes:

* training / ``forward`` / ``log_prob`` follow Eq. 2 with Eq. 4's zeroed weights: the
  chosen expert scores every class, a pruned class with logit 0, so the normaliser runs
  over all ``V`` classes (computed in closed form from the kept logits; no ``V``-sized work
  in ``forward``);
* inference (``topk``) follows §2.2: only the chosen expert's kept classes are candidates,
  and the returned log-probabilities are normalised over those classes;
* ``pruned_in_softmax=False`` (not in the paper) makes training and ``log_prob`` follow the
  inference semantics: the chosen expert's softmax runs over its kept classes only. A context
  whose target that expert pruned would then have probability 0, so its loss is Eq. 4's (the
  target and every pruned class at logit 0, their bias): finite, it pushes the expert's kept
  logits down for that context, and an expert that prunes more costs more, so a trainable gate
  gains nothing by routing such contexts to experts that keep few classes (with the kept
  classes alone in the normaliser it did). The loss is then not a distribution over the ``V``
  classes, so its perplexity is not comparable with a softmax's. ``GroupLassoPruning(rewind=True)``
  switches a head to it when it rewinds (:meth:`DSSoftmax.rewind_rows`): the rewound rows come
  from a dense model, in which the classes an expert does not serve had strongly negative
  logits, and Eq. 4 moves them to 0, above the targets' own logits.

Gate scale (``gate_scale``). Eq. 2 uses the chosen gate value ``G_k*`` as the inverse
temperature. ``G`` is a softmax over ``K`` experts, so it starts near ``1/K``, and each mitosis
step halves it for a parent and its clone: the logits shrink ``K``-fold and the expert rows
must grow to compensate, which under Adam (a step of ~lr per coordinate) makes learning in
logit space ``K`` times slower. ``gate_scale="experts"`` uses ``K * G_k*`` instead: the same
model family (``W`` rescaled by the constant ``K``), but the inverse temperature starts near 1
and a noiseless mitosis step leaves every logit unchanged. ``"none"`` (the default) is the paper's Eq. 2 as written.

Lasso mode (``lasso_mode``). ``"loss"`` adds the group lassos (Eq. 3, Eq. 6) to the training
loss, as the paper does, and the optimizer follows their gradient. Under Adam that gradient is
normalised per coordinate like any other, so the lasso moves a row with little task gradient
(a copy in an expert its class is rarely routed to) towards zero by about ``lr`` per coordinate
per step, while a row with a steady task gradient (large second moment) hardly feels it: the
pruning is selective. ``"proximal"`` leaves the lassos out of the loss and, after every
optimizer step, applies their proximal operator with the step's learning rate ``η``: each row is
shrunk towards zero by ``η λ`` in norm (block soft-thresholding; rows shorter than that become
exactly zero), then, with an expert lasso, each expert's block by ``η λ_expert``. Row groups
nest inside expert groups, so applying the two in that order is the exact proximal operator of
their sum. It is the textbook way to train a group lasso with plain gradient steps, and there
λ means what it says. Under Adam it shrinks needed and unneeded rows alike and raised the task
loss long before it pruned, so ``"loss"`` is the default.

Optional class bias (``class_bias=True``, not in the paper): one bias per class, shared by
all experts and not scaled by the gate, ``logit = G_k* W^e_(c,k*) h + b_c``; a pruned class
keeps its bias as its logit (its weights are zero). It exists for the unigram start
(:meth:`init_unigram_bias`): without a bias the head must learn the unigram through its
weights, and a DS head on the captions LM then sat at unigram perplexity.

Routing loss (``routing_loss_weight``, not in the paper). At inference only the chosen expert's
kept classes are candidates, so a context routed to an expert that pruned its target is lost
whatever the rows say (``analyze experts`` reports the share that is not: *coverage*). Eq. 2
trains the gate only through the chosen expert's inverse temperature, which says little about
*which* expert keeps the target. The routing loss ``λ_route * mean(-log Σ_k G_k(h) [k keeps y])``
is the negative log of the gate mass on experts that keep the target ``y``: zero while every
expert keeps every class (the dense phase), and after pruning it moves gate mass, and with it
the argmax, towards experts that can score the target.

Screened heads (:mod:`heads.ds.screening`, ``python -m app convert ds``): a ``DSSoftmax`` whose
experts and kept classes are screened from a trained full softmax and whose rows are that
softmax's own (``gate_scale="unit"``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.base import IGNORE_INDEX, at_least_fp32
from heads.ds.inference import SparseInference
from heads.ds.interface import learning_rate_of, speedup
from heads.ds.storage import PackedExperts
from heads.ds.structure import ExpertSurgery
from heads.registry import register_head
from heads.validation import check_nonnegative, check_positive_int

GATE_SCALES = ("none", "experts", "unit")
LASSO_MODES = ("loss", "proximal")


@register_head("ds_softmax", size_argument="num_experts", family="sparse", bench_size=64)
class DSSoftmax(SparseInference, ExpertSurgery, PackedExperts):
    """Doubly sparse softmax head.

    Eq. 1, gating: ``G(h) = softmax(W^g h)``, ``k* = argmax_k G_k(h)``.
    Eq. 2, chosen expert: ``p(c | h) = softmax_c(G_k*(h) * W^e_(c,k*) h)``. The gate value
    stays inside the softmax as an inverse temperature, so the loss depends on the whole
    gate softmax and every row of ``W^g`` receives gradient although only one expert runs.

    Args:
        in_features: hidden size ``d``.
        num_classes: vocabulary size ``V``.
        num_experts: initial number of experts ``K``; the :class:`heads.ds.Mitosis` callback
            doubles it from this value during training.
        group_lasso_weight: λ of the class-level group lasso, Eq. 3 (sum of row norms).
        expert_lasso_weight: λ of the expert-level group lasso, Eq. 6 (sum of expert norms).
        load_balance_weight: λ_load of the balancing loss (squared CV of importance); the
            :class:`heads.ds.LoadBalancing` callback schedules it (warm-up, end) from this value.
        keep_last_copy: never prune the last kept row of a class (footnote 2), so every class
            stays reachable through some expert.
        init_std: standard deviation of the initial weights.
        ignore_index: target value that contributes zero loss.
        class_bias: add a per-class bias shared by the experts (see the module docstring);
            the task's ``unigram_bias_init`` then starts it at the training unigram.
        gate_scale: ``"none"``: the inverse temperature is the gate value ``G_k*`` (Eq. 2 as
            written); ``"experts"``: ``K * G_k*``, so mitosis preserves the function and the
            temperature does not fall with ``K`` (see the module docstring); ``"unit"``: 1, the
            gate only routes (a head screened from a trained softmax, :mod:`heads.ds.screening`,
            whose rows are the softmax's own; the task loss then trains no gate row).
        lasso_mode: ``"loss"``: the group lassos are terms of the training loss (the paper);
            ``"proximal"``: a proximal shrinkage step after every optimizer step (see the
            module docstring; λ then means norm shrinkage per unit learning rate; measured
            worse than ``"loss"`` under Adam).
        pruned_in_softmax: ``True``: in training and ``log_prob`` each class the chosen expert
            pruned scores logit 0 (its bias), Eq. 4 as written; ``False``: the chosen expert's
            softmax runs over its kept classes only, as at inference, and a target it pruned is
            scored as in Eq. 4 (see the module docstring).
        routing_loss_weight: λ_route of the routing loss (not in the paper; see the module
            docstring): ``-log Σ_k G_k(h) [expert k keeps the target]``, averaged over tokens;
            the :class:`heads.ds.RoutingLoss` callback can hold it at 0 before a given epoch.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        num_experts: int = 2,
        group_lasso_weight: float = 0.0,
        expert_lasso_weight: float = 0.0,
        load_balance_weight: float = 0.0,
        keep_last_copy: bool = True,
        init_std: float = 0.02,
        ignore_index: int = IGNORE_INDEX,
        class_bias: bool = False,
        gate_scale: str = "none",
        lasso_mode: str = "loss",
        pruned_in_softmax: bool = True,
        routing_loss_weight: float = 0.0,
    ) -> None:
        super().__init__(in_features, num_classes, ignore_index)
        check_positive_int(num_experts, "num_experts", "DSSoftmax")
        self.group_lasso_weight = check_nonnegative(group_lasso_weight, "group_lasso_weight", "DSSoftmax")
        self.expert_lasso_weight = check_nonnegative(expert_lasso_weight, "expert_lasso_weight", "DSSoftmax")
        self.load_balance_weight = check_nonnegative(load_balance_weight, "load_balance_weight", "DSSoftmax")
        self.routing_loss_weight = check_nonnegative(routing_loss_weight, "routing_loss_weight", "DSSoftmax")
        self.keep_last_copy = bool(keep_last_copy)
        if gate_scale not in GATE_SCALES:
            raise ValueError(
                f"DSSoftmax needs gate_scale in {GATE_SCALES}, got {gate_scale!r} (set head.init_args.gate_scale)"
            )
        self.gate_scale = gate_scale
        if lasso_mode not in LASSO_MODES:
            raise ValueError(
                f"DSSoftmax needs lasso_mode in {LASSO_MODES}, got {lasso_mode!r} (set head.init_args.lasso_mode)"
            )
        self.lasso_mode = lasso_mode
        self.pruned_in_softmax = bool(pruned_in_softmax)
        if not float(init_std) > 0.0:
            raise ValueError(f"DSSoftmax needs init_std > 0, got {init_std!r} (set head.init_args.init_std, e.g. 0.02)")
        self.initial_experts = int(num_experts)
        self._allocate(num_experts, init_std, class_bias)
        self._routing_counts = torch.zeros(num_experts, dtype=torch.long)  # not a buffer: DDP would overwrite it
        self._importance: Tensor | None = None
        self._routing_nll: Tensor | None = None
        self._coverage: Tensor | None = None  # of the last forward's valid targets (stats)
        self._keepers: Tensor | None = None  # (V, K) float, 1 where expert k keeps class c (routing loss)

    # ------------------------------------------------------------------ structure
    def _replace(self, gate_weight: Tensor, expert_weight: Tensor, class_index: Tensor, offsets: Tensor) -> tuple[nn.Parameter, nn.Parameter]:
        replaced = super()._replace(gate_weight, expert_weight, class_index, offsets)
        self._importance = self._routing_nll = None
        if self._routing_counts.shape[0] != self.num_experts:
            self._routing_counts = torch.zeros(self.num_experts, dtype=torch.long)
        return replaced

    def clear_inference_cache(self) -> None:
        super().clear_inference_cache()
        self._keepers = None

    def structure(self) -> dict[str, Any]:
        """Sizes needed to rebuild the parameters before a state dict is loaded, and which
        softmax the head trains with (``pruned_in_softmax`` changes with a rewind)."""
        return {**super().structure(), "pruned_in_softmax": self.pruned_in_softmax}

    def load_structure(self, structure: dict[str, Any]) -> None:
        super().load_structure(structure)
        self.pruned_in_softmax = bool(structure.get("pruned_in_softmax", self.pruned_in_softmax))

    # ------------------------------------------------------------------ gating
    def route(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Eq. 1: chosen expert and its gate value per context.

        Shape:
            hidden ``(N, d)`` -> expert ``(N,)`` long, gate ``(N,)`` (differentiable).
        """
        expert, gate, _ = self._route(hidden)
        return expert, gate

    def _route(self, hidden: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`route` plus the whole ``(N, K)`` gate softmax (the routing loss needs it).

        The counters (importance, routing counts; they feed load balancing, :meth:`stats` and the
        theoretical speed-up) see training passes only, and only the contexts ``valid`` marks
        (targets other than ``ignore_index``); evaluation, ``log_prob`` and ``topk`` leave them alone.
        """
        gates = torch.softmax(at_least_fp32(F.linear(hidden, self.gate_weight)), dim=-1)  # (N, K)
        gate, expert = gates.max(dim=-1)
        if self.training and torch.is_grad_enabled():
            counted = gates if valid is None else gates * valid.unsqueeze(1).to(gates.dtype)
            self._importance = counted.sum(0)  # (K,) Importance(X) = Σ_x G(x), Shazeer et al. 2017
        if self.training:
            with torch.no_grad():
                # scatter_add, not bincount of expert[valid]: no data-dependent shape, so torch.compile
                # traces it without a graph break
                routed = torch.ones_like(expert) if valid is None else valid.to(expert.dtype)
                self._routing_counts += torch.zeros(self.num_experts, dtype=expert.dtype, device=expert.device).scatter_add_(0, expert, routed).cpu()
        return expert, gate, gates

    def inverse_temperature(self, gate: Tensor) -> Tensor:
        """Eq. 2's factor on the chosen expert's logits: ``G_k*``, ``K * G_k*`` or 1 (``gate_scale``)."""
        if self.gate_scale == "unit":
            return torch.ones_like(gate)
        return gate * self.num_experts if self.gate_scale == "experts" else gate

    def routing_counts(self) -> Tensor:
        return self._routing_counts

    def last_importance(self) -> Tensor | None:
        return self._importance

    # ------------------------------------------------------------------ contract
    def _expert_logits(self, hidden: Tensor, gate: Tensor, weight: Tensor, classes: Tensor) -> Tensor:
        """Eq. 2 logits of one expert over its kept classes (plus their bias, if any): ``(m, d) -> (m, n_k)``."""
        logits = self.inverse_temperature(gate).unsqueeze(1) * at_least_fp32(F.linear(hidden, weight))
        return logits if self.class_bias is None else logits + self.class_bias[classes]

    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Per-token NLL under Eq. 2 with pruned classes at logit 0 (Eq. 4).

        Shape:
            hidden ``(..., d)``, target ``(...)`` -> ``(...)``.
        """
        flat = hidden.reshape(-1, self.in_features)  # (N, d)
        targets = target.reshape(-1)  # (N,)
        valid = targets != self.ignore_index
        expert, gate, gates = self._route(flat, valid)
        nll = flat.new_zeros(targets.shape, dtype=torch.promote_types(flat.dtype, torch.float32))
        routing = self.routing_loss_weight > 0 and self.training and torch.is_grad_enabled()
        self._routing_nll = self._routing_loss(gates[valid], targets[valid]) if routing else None
        experts = self._expert_rows()  # once per pass: one split node in the graph
        covered = torch.zeros((), dtype=torch.long, device=flat.device)
        for k in torch.unique(expert).tolist():
            rows = (expert == k).nonzero().squeeze(1)  # (m,)
            weight, classes = experts[k]
            logits = self._expert_logits(flat[rows], gate[rows], weight, classes)  # (m, n_k)
            n_k = classes.numel()
            log_z = torch.logsumexp(logits, dim=1)  # (m,)
            t = targets[rows].clamp_min(0)
            pos = torch.searchsorted(classes, t).clamp_max(n_k - 1)  # classes is sorted per expert
            found = classes[pos] == t
            covered += (found & valid[rows]).sum()
            target_logit = logits.gather(1, pos.unsqueeze(1)).squeeze(1)
            pruned_logit = self.class_bias[t].to(target_logit) if self.class_bias is not None else torch.zeros_like(target_logit)
            target_logit = torch.where(found, target_logit, pruned_logit)  # a pruned target scores its bias (0)
            if n_k < self.num_classes:
                eq4_log_z = torch.logaddexp(log_z, self._pruned_log_mass(classes).to(log_z))  # every pruned class in
                # Eq. 4 throughout, or kept classes only with a pruned target scored under Eq. 4 (module docstring)
                log_z = eq4_log_z if self.pruned_in_softmax else torch.where(found, log_z, eq4_log_z)
            nll = nll.index_put((rows,), log_z - target_logit)
        self._coverage = covered / valid.sum().clamp_min(1)  # share of targets the chosen expert keeps
        return nll.masked_fill(~valid, 0.0).view(target.shape)

    def _routing_loss(self, gates: Tensor, targets: Tensor) -> Tensor:
        """Mean over tokens of ``-log Σ_k G_k [k keeps the target]`` (gates ``(n, K)``, targets
        ``(n,)``); tokens whose target no expert keeps (``keep_last_copy=False``) are left out."""
        if self._keepers is None:  # dropped with the other structure caches (clear_inference_cache)
            self._keepers = self.kept_mask().t().to(gates.dtype).contiguous()  # (V, K)
        keepers = self._keepers[targets]  # (n, K)
        mass = (gates * keepers).sum(1)  # (n,)
        reachable = keepers.amax(1)  # (n,) 1 where some expert keeps the target
        return -(mass.clamp_min(1e-30).log() * reachable).sum() / reachable.sum().clamp_min(1.0)  # no host sync

    def _pruned_log_mass(self, classes: Tensor) -> Tensor:
        """``log Σ exp(logit)`` over the classes an expert pruned (``classes`` are its kept ones):
        ``log(V - n_k)`` with logit 0, or the log-sum-exp of their biases."""
        if self.class_bias is None:
            return torch.tensor(math.log(self.num_classes - classes.numel()))
        return torch.logsumexp(at_least_fp32(self.class_bias).index_fill(0, classes, -math.inf), dim=0)

    def log_prob(self, hidden: Tensor) -> Tensor:
        """Eq. 2/4 log-probabilities over all classes (pruned ones at logit 0; with
        ``pruned_in_softmax=False``, over the chosen expert's kept classes, the others at ``-inf``).

        Shape: ``(..., d) -> (..., V)``.
        """
        if torch.compiler.is_compiling():  # torch.export / torch.compile (heads/ds/inference.py)
            return self._log_prob_traceable(hidden)
        flat = hidden.reshape(-1, self.in_features)  # (N, d)
        expert, gate = self.route(flat)
        logits = flat.new_zeros(flat.shape[0], self.num_classes, dtype=torch.promote_types(flat.dtype, torch.float32))  # (N, V)
        if not self.pruned_in_softmax:
            logits.fill_(-math.inf)  # only the chosen expert's kept classes get a score
        elif self.class_bias is not None:
            logits = logits + self.class_bias.to(logits)  # pruned classes score their bias
        experts = self._expert_rows()
        for k in torch.unique(expert).tolist():
            rows = (expert == k).nonzero().squeeze(1)
            weight, classes = experts[k]
            expert_logits = self._expert_logits(flat[rows], gate[rows], weight, classes)
            logits[rows.unsqueeze(1), classes.unsqueeze(0)] = expert_logits
        return torch.log_softmax(logits, dim=-1).view(*hidden.shape[:-1], self.num_classes)

    def class_bias_parameter(self) -> Tensor | None:
        """The shared class bias (``class_bias=True``) the unigram start sets; None without one."""
        return self.class_bias

    # ------------------------------------------------------------------ regularisers
    def regularization(self) -> dict[str, Tensor]:
        """Weighted group lassos (Eq. 3, Eq. 6) and the load-balancing loss.

        Load balancing: the paper's Eq. 5 writes ``L_load = -CV(importance)``, but minimising
        ``-CV`` would *increase* the spread of expert importance, i.e. push towards one expert
        taking everything. Balancing needs the opposite, so, as in Shazeer et al. (2017), we
        minimise ``λ_load * CV(importance)^2``, which is zero when all experts carry the same
        gate mass and is smooth at that optimum (CV itself has a kink there).
        """
        losses: dict[str, Tensor] = {}
        if self.lasso_mode == "loss" and (self.group_lasso_weight > 0 or self.expert_lasso_weight > 0):
            squared = at_least_fp32(self.expert_weight).pow(2).sum(1)  # (R,)
            if self.group_lasso_weight > 0:
                # Eq. 3: Σ_k Σ_c ||W^e_(c,k)||_2 drives whole class rows to zero
                losses["group_lasso"] = self.group_lasso_weight * squared.clamp_min(1e-12).sqrt().sum()
            if self.expert_lasso_weight > 0:
                # Eq. 6: Σ_k ||W^e_k||_2 lets an unneeded expert shrink as a whole
                per_expert = self._per_expert_sum(squared)
                losses["expert_lasso"] = self.expert_lasso_weight * per_expert.clamp_min(1e-12).sqrt().sum()
        if self.routing_loss_weight > 0 and self._routing_nll is not None and self.training:
            losses["routing"] = self.routing_loss_weight * self._routing_nll
        importance = self._importance
        if self.load_balance_weight > 0 and importance is not None and self.training:
            cv_squared = importance.var(unbiased=False) / importance.mean().pow(2).clamp_min(1e-12)
            losses["load_balance"] = self.load_balance_weight * cv_squared
        return losses

    @torch.no_grad()
    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``lasso_mode="proximal"``: shrink rows (Eq. 3), then experts (Eq. 6), by ``η λ`` in norm.

        Also drops the inference cache: fused optimizers update the weights without bumping
        their version counters, which the cache's key relies on otherwise.
        """
        self._inference_cache = None
        if self.lasso_mode != "proximal" or not (self.group_lasso_weight > 0 or self.expert_lasso_weight > 0):
            return
        lr = learning_rate_of(optimizer, self.expert_weight)
        if lr is None or lr <= 0:
            return
        self.proximal_lasso(lr * self.group_lasso_weight, lr * self.expert_lasso_weight)

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict[str, Tensor | float]:
        rows = self.rows_per_expert().float()
        counts = self._routing_counts.float()
        stats: dict[str, Tensor | float] = {
            "num_experts": float(self.num_experts),
            "kept_fraction": float(rows.sum()) / (self.num_experts * self.num_classes),
            "mean_classes_per_expert": float(rows.mean()),
        }
        if counts.sum() > 0:
            utilisation = counts / counts.sum()
            stats["theoretical_speedup"] = speedup(utilisation, rows.cpu() / self.num_classes)
        if self._coverage is not None:
            # the ceiling of top-k accuracy at inference, where only the chosen expert's kept classes compete
            stats["coverage"] = self._coverage
        return stats

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_experts={self.num_experts}, kept_rows={self.expert_weight.shape[0]}"
