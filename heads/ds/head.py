"""DS-Softmax: a sparse mixture of sparse experts (Doubly Sparse softmax, Liao et al. 2019).

A gating network picks one of ``K`` experts per context; each expert is a softmax over a
*subset* of the vocabulary. Group lasso drives whole class rows of an expert to zero, and
rows whose norm falls below a threshold are removed for good, so at inference a context
pays for the gate plus the chosen expert's kept rows instead of all ``V`` classes. This file
holds the whole head, top to bottom: the packed storage of the kept rows, routing, the loss,
sparse inference, the regularisers and the structure changes (pruning, mitosis).

Packed storage. The kept rows of all experts are packed into one ``(R, d)`` matrix, expert
``k`` owning rows ``expert_offsets[k]:expert_offsets[k+1]`` with its classes ascending, and
``class_index`` says which class each row scores. Pruning removes rows and mitosis appends
clones, so memory is proportional to the kept entries, never to ``K * V``. Structure metadata
(:meth:`DSSoftmax.structure`) lets a checkpoint resize a fresh head before its weights load; the
index buffers a state dict brings are checked before anything is copied
(:func:`packed_structure_problem`), so an edited checkpoint is one ``ValueError`` line, never an
``IndexError`` inside ``forward`` or a row silently scoring another class.

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
  classes, so its perplexity is not comparable with a softmax's. A head screened from a trained
  softmax (:mod:`heads.ds.screening`) uses it: its rows come from a dense model, in which the
  classes an expert does not serve had strongly negative logits, and Eq. 4 would move them to
  0, above the targets' own logits.

Gate scale (``gate_scale``). Eq. 2 uses the chosen gate value ``G_k*`` as the inverse
temperature. ``G`` is a softmax over ``K`` experts, so it starts near ``1/K``, and each mitosis
step halves it for a parent and its clone: the logits shrink ``K``-fold and the expert rows
must grow to compensate, which under Adam (a step of ~lr per coordinate) makes learning in
logit space ``K`` times slower. ``gate_scale="experts"`` uses ``K * G_k*`` instead: the same
model family (``W`` rescaled by the constant ``K``), but the inverse temperature starts near 1
and a noiseless mitosis step leaves every logit unchanged. ``"none"`` (the default) is the
paper's Eq. 2 as written.

Group lassos. Eq. 3 (rows) and Eq. 6 (experts) are terms of the training loss, as in the
paper, and the optimizer follows their gradient. Under Adam that gradient is normalised per
coordinate like any other, so the lasso moves a row with little task gradient (a copy in an
expert its class is rarely routed to) towards zero by about ``lr`` per coordinate per step,
while a row with a steady task gradient hardly feels it: the pruning is selective.

Optional class bias (``class_bias=True``, not in the paper): one bias per class, shared by
all experts and not scaled by the gate, ``logit = G_k* W^e_(c,k*) h + b_c``; a pruned class
keeps its bias as its logit (its weights are zero). It exists for the unigram start
(:meth:`OutputHead.init_unigram_bias`): without a bias the head must learn the unigram through
its weights.

Routing loss (``routing_loss_weight``, not in the paper). At inference only the chosen expert's
kept classes are candidates, so a context routed to an expert that pruned its target is lost
whatever the rows say (``analyze experts`` reports the share that is not: *coverage*). Eq. 2
trains the gate only through the chosen expert's inverse temperature, which says little about
*which* expert keeps the target. The routing loss ``λ_route * mean(-log Σ_k G_k(h) [k keeps y])``
is the negative log of the gate mass on experts that keep the target ``y``: zero while every
expert keeps every class (the dense phase), and after pruning it moves gate mass, and with it
the argmax, towards experts that can score the target.

Sparse inference. Two inference caches, both dropped when the storage is re-allocated
(:meth:`DSSoftmax.clear_inference_cache`), keep the batch ``topk`` to one matmul per used
expert: a ``(K, n_max)`` table of each expert's classes and a transposed copy of the rows.
Under ``torch.export`` / ``torch.compile`` (:func:`torch.compiler.is_compiling`) ``topk`` and
``log_prob`` run ``_topk_traceable`` / ``_log_prob_traceable``: the same computation without
the caches and Python-side sizes the eager paths use (a cached view picked by ``int(expert)``,
``bincount(...).tolist()``, a ``(K, n_max)`` table), which a tracer cannot follow. Each
expert's rows and contexts are taken by ``narrow`` with sizes read from ``expert_offsets`` and
the routing counts (unbacked sizes), and each expert's block is normalised and ranked on its
own, its width padded by ``k`` slots at ``-inf`` so the result has ``k`` columns whatever the
expert keeps. It still touches only the chosen experts' rows.

Structure changes (:meth:`DSSoftmax.prune`, :meth:`DSSoftmax.clone_experts`) re-allocate the
packed parameters and return :data:`heads.ds.interface.ParameterRemap` triples; given plain
PyTorch optimizers they carry each row's state over themselves. Screened heads
(:mod:`heads.ds.screening`, ``python -m app convert ds``) are ``DSSoftmax`` heads whose experts
and kept classes are screened from a trained full softmax (``gate_scale="unit"``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.base import IGNORE_INDEX, OutputHead, at_least_fp32
from heads.ds.interface import ParameterRemap, carry_optimizer_state, speedup
from heads.registry import register_head
from heads.validation import check_nonnegative, check_positive_int

GATE_SCALES = ("none", "experts", "unit")


@register_head("ds_softmax", size_argument="num_experts", family="sparse", bench_size=64)
class DSSoftmax(OutputHead):
    """Doubly sparse softmax head.

    Eq. 1, gating: ``G(h) = softmax(W^g h)``, ``k* = argmax_k G_k(h)``.
    Eq. 2, chosen expert: ``p(c | h) = softmax_c(G_k*(h) * W^e_(c,k*) h)``. The gate value
    stays inside the softmax as an inverse temperature, so the loss depends on the whole
    gate softmax and every row of ``W^g`` receives gradient although only one expert runs.

    Args:
        in_features: hidden size ``d``.
        num_classes: vocabulary size ``V``.
        num_experts: initial number of experts ``K``; mitosis (:meth:`clone_experts`, driven by
            the ``tasks.callbacks.Mitosis`` callback) doubles it from this value during training.
        group_lasso_weight: λ of the class-level group lasso, Eq. 3 (sum of row norms).
        expert_lasso_weight: λ of the expert-level group lasso, Eq. 6 (sum of expert norms).
        load_balance_weight: λ_load of the balancing loss (squared CV of importance); the
            ``tasks.callbacks.LoadBalancing`` callback schedules it (warm-up, end) from this value.
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
        pruned_in_softmax: ``True``: in training and ``log_prob`` each class the chosen expert
            pruned scores logit 0 (its bias), Eq. 4 as written; ``False``: the chosen expert's
            softmax runs over its kept classes only, as at inference, and a target it pruned is
            scored as in Eq. 4 (see the module docstring).
        routing_loss_weight: λ_route of the routing loss (not in the paper; see the module
            docstring): ``-log Σ_k G_k(h) [expert k keeps the target]``, averaged over tokens;
            the ``tasks.callbacks.RoutingLoss`` callback can hold it at 0 before a given epoch.
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
    # ------------------------------------------------------------------ packed storage
    def _allocate(self, num_experts: int, init_std: float, class_bias: bool) -> None:
        """Dense start: every expert keeps all ``V`` classes; rows are packed expert by expert."""
        K, V, d = num_experts, self.num_classes, self.in_features
        self.gate_weight = nn.Parameter(torch.randn(K, d) * init_std)  # W^g, (K, d)
        self.expert_weight = nn.Parameter(torch.randn(K * V, d) * init_std)  # packed W^e, (R, d)
        self.register_buffer("class_index", torch.arange(V).repeat(K))  # (R,)
        self.register_buffer("expert_offsets", torch.arange(K + 1) * V)  # (K+1,)
        self.class_bias = nn.Parameter(torch.zeros(V)) if class_bias else None  # b, (V,)
        self._views: list[tuple[Tensor, Tensor]] | None = None
        self._bounds: list[int] = []
        self._classes_padded: Tensor | None = None
        self._inference_cache: tuple[tuple[int, ...], list[tuple[Tensor, Tensor | None]]] | None = None
        self._structure_pinned = False

    @property
    def num_experts(self) -> int:
        return self.gate_weight.shape[0]

    def rows_per_expert(self) -> Tensor:
        """Kept classes of each expert, ``(K,)``."""
        return self.expert_offsets.diff()

    def kept_mask(self) -> Tensor:
        """Dense ``(K, V)`` view of which classes each expert keeps (for analysis only)."""
        mask = torch.zeros(self.num_experts, self.num_classes, dtype=torch.bool, device=self.class_index.device)
        mask[self._expert_of_row(), self.class_index] = True
        return mask

    def dense_expert_weight(self) -> Tensor:
        """``(K, V, d)`` weights with pruned rows as zeros (reference implementations and tests)."""
        dense = self.expert_weight.new_zeros(self.num_experts, self.num_classes, self.in_features)
        dense[self._expert_of_row(), self.class_index] = self.expert_weight
        return dense

    def _expert_of_row(self) -> Tensor:
        return torch.repeat_interleave(torch.arange(self.num_experts, device=self.class_index.device), self.rows_per_expert())

    def _expert_rows(self) -> list[tuple[Tensor, Tensor]]:
        """Per expert, ``(n_k, d)`` kept rows and ``(n_k,)`` their classes (sorted).

        Without autograd (inference) the slices are cached: they are views sharing storage with
        the packed parameter, so they stay valid across optimizer steps and in-place
        ``load_state_dict``; re-allocation (structure change, ``.to``) clears the cache.
        With autograd the pieces are split afresh so each step builds its own graph.
        """
        if self._views is None:
            self._classes_padded = None
            bounds = self.expert_offsets.tolist()
            with torch.no_grad():
                self._views = [
                    (self.expert_weight[bounds[k] : bounds[k + 1]], self.class_index[bounds[k] : bounds[k + 1]])
                    for k in range(self.num_experts)
                ]
            self._bounds = bounds
        if torch.is_grad_enabled() and self.expert_weight.requires_grad:
            # One split, not K slices: each slice's backward would allocate a gradient of the
            # whole packed matrix, while split's backward concatenates the K pieces once.
            sizes = [b - a for a, b in zip(self._bounds[:-1], self._bounds[1:])]
            return [(weight, classes) for weight, (_, classes) in zip(self.expert_weight.split(sizes), self._views)]
        return self._views

    def clear_inference_cache(self) -> None:
        """Drop the structure caches: row views, class table, the routing loss's keeper table and
        the transposed copy of the rows the batch ``topk`` keeps (as large as the kept rows; call
        this to free it)."""
        self._views = None
        self._inference_cache = None
        self._keepers = None

    def train(self, mode: bool = True) -> "DSSoftmax":
        if mode:
            self._inference_cache = None  # training updates the weights (see _inference_rows)
        return super().train(mode)

    def _apply(self, fn, recurse=True):
        self.clear_inference_cache()  # .to() / .cuda() / .half() re-allocate the storage the views point at
        return super()._apply(fn, recurse)

    def _per_expert_sum(self, per_row: Tensor) -> Tensor:
        """``(K,)`` sums of a per-row quantity over each expert's rows."""
        return per_row.new_zeros(self.num_experts).index_add(0, self._expert_of_row(), per_row)

    def memory_bytes(self) -> int:
        """Bytes of the head's parameters and buffers (proportional to kept rows)."""
        tensors = list(self.parameters()) + list(self.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)


    # ------------------------------------------------------------------ re-allocation
    def _replace(self, gate_weight: Tensor, expert_weight: Tensor, class_index: Tensor, offsets: Tensor) -> tuple[nn.Parameter, nn.Parameter]:
        """Re-allocate the parameters and index buffers with new contents; returns the old
        parameters (callers turn them into :data:`heads.ds.interface.ParameterRemap` triples).
        The per-pass routing statistics start again (the routing counts at the new size)."""
        old_gate, old_expert = self.gate_weight, self.expert_weight
        self.gate_weight = nn.Parameter(gate_weight.detach().clone(), requires_grad=old_gate.requires_grad)
        self.expert_weight = nn.Parameter(expert_weight.detach().clone(), requires_grad=old_expert.requires_grad)
        self.class_index = class_index.to(self.class_index.device)
        self.expert_offsets = offsets.to(self.expert_offsets.device)
        self.clear_inference_cache()
        self._importance = self._routing_nll = None
        if self._routing_counts.shape[0] != self.num_experts:
            self._routing_counts = torch.zeros(self.num_experts, dtype=torch.long)
        return old_gate, old_expert

    @torch.no_grad()
    def set_experts(self, gate_weight: Tensor, expert_weight: Tensor, class_index: Tensor, expert_offsets: Tensor) -> None:
        """Give the head experts built elsewhere (:mod:`heads.ds.build`):
        ``gate_weight (K, d)``, packed rows ``(R, d)`` with their classes ``(R,)``, expert ``k``
        owning rows ``expert_offsets[k]:expert_offsets[k+1]``, classes ascending inside an expert.
        The parameters are re-allocated (build the optimizer afterwards)."""
        K, d, V = gate_weight.shape[0], self.in_features, self.num_classes
        offsets = expert_offsets.long()
        R = expert_weight.shape[0]
        rows = offsets.diff() if offsets.numel() == K + 1 else None
        problem = None
        if gate_weight.shape != (K, d) or K < 1 or expert_weight.shape != (R, d) or class_index.shape != (R,):
            problem = f"shapes gate {tuple(gate_weight.shape)}, rows {tuple(expert_weight.shape)}, classes {tuple(class_index.shape)} (need (K, {d}), (R, {d}), (R,))"
        elif rows is None or int(offsets[0]) != 0 or int(offsets[-1]) != R or bool((rows < 1).any()):
            problem = f"expert_offsets {offsets.tolist()[:8]}... must run from 0 to {R} over {K} non-empty experts"
        elif R and not (0 <= int(class_index.min()) and int(class_index.max()) < V):
            problem = f"class ids outside 0..{V - 1}"
        else:
            expert_of_row = torch.repeat_interleave(torch.arange(K), rows)
            keys = expert_of_row * V + class_index.long().cpu()
            if bool((keys.diff() <= 0).any()):
                problem = "classes must be ascending and distinct inside each expert"
        if problem is not None:
            raise ValueError(f"DSSoftmax.set_experts: {problem}; build the arguments as heads.ds.build does")
        self._replace(gate_weight.to(self.gate_weight), expert_weight.to(self.expert_weight), class_index.long(), offsets)

    def structure(self) -> dict[str, Any]:
        """Sizes needed to rebuild the parameters before a state dict is loaded, and which
        softmax the head trains with (``pruned_in_softmax``, so it travels with a checkpoint)."""
        return {
            "num_experts": self.num_experts,
            "num_classes": self.num_classes,
            "in_features": self.in_features,
            "rows_per_expert": self.rows_per_expert().tolist(),
            "pruned_in_softmax": self.pruned_in_softmax,
        }

    def load_structure(self, structure: dict[str, Any]) -> None:
        """Resize parameters and index buffers to ``structure`` (values come from the state dict)."""
        for key, value in structure.items():  # what structure() writes: counts, a list of counts, a flag
            kind = {"rows_per_expert": list, "pruned_in_softmax": bool}.get(key, int)
            valid = isinstance(value, kind) and (kind is bool or not isinstance(value, bool)) and (
                kind is not list or all(isinstance(n, int) and not isinstance(n, bool) for n in value))
            if not valid:
                wanted = {list: "a list of integers", bool: "true or false"}.get(kind, "an integer")
                raise ValueError(
                    f"DSSoftmax checkpoint structure has {key}={str(value)[:40]}, not {wanted}: the checkpoint is corrupt "
                    f"or was not written by DSSoftmax"
                )
        rows = [int(n) for n in structure.get("rows_per_expert", [])]
        K = int(structure.get("num_experts", -1))
        for key, mine in (("num_classes", self.num_classes), ("in_features", self.in_features)):
            if int(structure.get(key, mine)) != mine:
                raise ValueError(
                    f"DSSoftmax checkpoint structure has {key}={structure[key]} but this head has {mine} "
                    f"(build the model with the data and encoder the checkpoint was trained with)"
                )
        if K < 1 or len(rows) != K or any(not 1 <= n <= self.num_classes for n in rows):
            raise ValueError(
                f"DSSoftmax checkpoint structure is inconsistent: num_experts={K} with rows_per_expert of "
                f"length {len(rows)} (each must be in 1..{self.num_classes}); the checkpoint is corrupt or "
                f"was not written by DSSoftmax"
            )
        counts = torch.tensor(rows)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        device = self.expert_weight.device
        self._structure_pinned = True  # the next load_state_dict must match these sizes exactly
        self._replace(
            torch.zeros(K, self.in_features, device=device),
            torch.zeros(int(offsets[-1]), self.in_features, device=device),
            torch.zeros(int(offsets[-1]), dtype=torch.long),
            offsets,
        )
        self.pruned_in_softmax = bool(structure.get("pruned_in_softmax", self.pruned_in_softmax))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        names = ("gate_weight", "expert_weight", "class_index", "expert_offsets")
        incoming = {name: state_dict.get(prefix + name) for name in names}
        mismatch = [n for n, t in incoming.items() if t is not None and t.shape != getattr(self, n).shape]
        if mismatch and self._structure_pinned:
            # load_structure() set the sizes from the checkpoint's metadata: the weights must agree.
            # One line instead of PyTorch's multi-line size-mismatch report.
            name = mismatch[0]
            raise ValueError(
                f"DSSoftmax {name} in the checkpoint has shape {tuple(incoming[name].shape)} but the "
                f"expert structure says {tuple(getattr(self, name).shape)}: the checkpoint's head_structure "
                f"does not match its weights (re-save it from a run, or load it with the matching head)"
            )
        # The index buffers decide which rows are read and which classes they score: checked, as
        # the head will hold them, before anything is copied (a class id out of range would be an
        # IndexError deep in forward, a negative one would silently score another class).
        held = {name: incoming[name] if incoming[name] is not None else getattr(self, name) for name in names}
        problem = packed_structure_problem(
            held["class_index"], held["expert_offsets"], num_experts=_length(held["gate_weight"]),
            num_rows=_length(held["expert_weight"]), num_classes=self.num_classes, prefix=prefix,
            pinned_offsets=self.expert_offsets if self._structure_pinned else None,
        )
        if problem is not None:
            self._structure_pinned = False
            raise ValueError(f"DSSoftmax {problem}: the checkpoint is damaged or was edited (use another checkpoint of the run)")
        if mismatch and all(t is not None for t in incoming.values()):
            # A plain state dict (no metadata, e.g. DDP-spawn handing weights back to the main
            # process) still carries the whole structure in expert_offsets and class_index.
            rows = held["expert_offsets"].diff().tolist()
            self.load_structure({"num_experts": len(rows), "rows_per_expert": rows, "num_classes": self.num_classes,
                                 "in_features": self.in_features})
        self._structure_pinned = False
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        self.clear_inference_cache()


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
        if torch.compiler.is_compiling():  # torch.export / torch.compile (module docstring)
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

    # ------------------------------------------------------------------ sparse inference (§2.2)
    def topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Sparse inference (§2.2): the ``k`` best of the chosen expert's kept classes.

        Only the gate and the chosen expert's rows are touched. Log-probabilities are
        normalised over that expert's kept classes. If an expert keeps fewer than ``k``
        classes, the missing slots hold index ``-1`` with log-probability ``-inf``.

        Shape:
            hidden ``(..., d)`` -> ``(log_probs, indices)``, each ``(..., k)``.
        """
        if torch.is_grad_enabled():  # entered only when needed: a no_grad context costs more than a small kernel
            with torch.no_grad():
                return self._topk(hidden, k)
        return self._topk(hidden, k)

    def _topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        if torch.compiler.is_compiling():  # torch.export / torch.compile: no caches, no host-side sizes
            values, indices = self._topk_traceable(hidden.reshape(-1, self.in_features), k)
            return values.view(*hidden.shape[:-1], k), indices.view(*hidden.shape[:-1], k)
        if hidden.shape[0] == 1 and hidden.dim() == 2:
            return self._topk_single(hidden.view(-1), k)
        flat = hidden.reshape(-1, self.in_features)  # (N, d)
        gate, expert = torch.softmax(at_least_fp32(F.linear(flat, self.gate_weight)), dim=-1).max(dim=-1)  # Eq. 1
        order = torch.argsort(expert)  # group contexts by expert: one matmul per used expert
        # Eq. 2: scaling h by the gate equals scaling the logits, and costs d instead of n_k
        scaled = flat[order] * self.inverse_temperature(gate[order]).unsqueeze(1).to(flat.dtype)  # (N, d), expert-major
        counts = torch.bincount(expert, minlength=self.num_experts).tolist()
        views = self._expert_rows()
        class_table = self._class_table()  # (K, n_max), -1 past each expert's kept classes
        # Each expert's logits go into one (N, n_max) buffer padded with -inf, so the per-expert
        # loop is a single matmul and the normalisation and top-k run once for the batch.
        logits = flat.new_full((flat.shape[0], class_table.shape[1]), -math.inf, dtype=torch.promote_types(flat.dtype, torch.float32))
        # (d, n_e) copies of the rows make these small matmuls ~2x faster (_inference_rows)
        transposed = self._inference_rows() if scaled.dtype == logits.dtype == self.expert_weight.dtype else None
        start = 0
        for e, m in enumerate(counts):
            if m:
                weight, classes = views[e]
                block = logits[start : start + m, : weight.shape[0]]  # (m, n_e)
                if transposed is None:
                    block.copy_(F.linear(scaled[start : start + m], weight, self.class_bias[classes] if self.class_bias is not None else None))
                elif transposed[e][1] is None:
                    torch.mm(scaled[start : start + m], transposed[e][0], out=block)
                else:
                    torch.addmm(transposed[e][1], scaled[start : start + m], transposed[e][0], out=block)
                start += m
        j = min(k, class_table.shape[1])
        log_probs = torch.log_softmax(logits, dim=1)
        # top-1 (greedy decoding, the benchmark) by max: ~2x faster than topk(1) on CPU
        values, pos = log_probs.max(dim=1, keepdim=True) if j == 1 else log_probs.topk(j, dim=1)  # (N, j), expert-major
        indices = class_table[expert[order].unsqueeze(1), pos]  # -1 where the expert ran out of classes
        values = values.masked_fill(indices < 0, -math.inf)
        if j < k:
            values = F.pad(values, (0, k - j), value=-math.inf)
            indices = F.pad(indices, (0, k - j), value=-1)
        unsort = torch.argsort(order)
        values, indices = values[unsort], indices[unsort]  # (N, k), back in input order
        return values.view(*hidden.shape[:-1], k), indices.view(*hidden.shape[:-1], k)

    def _topk_single(self, h: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """:meth:`topk` of one context ``h (d,)`` -> ``(1, k)`` each: the latency path of the paper's
        speed-up claim. Its kernels are tiny, so each Python-level tensor call (about 1 us) costs
        a sizeable part of the kept-row matmul: the path keeps to about eleven of them
        (the reason for its shape)."""
        scores = torch.mv(self.gate_weight, h)  # (K,) gate logits
        expert = int(scores.argmax())  # the gate's argmax is its softmax's argmax (Eq. 1)
        weight, classes = self._expert_rows()[expert]
        # Eq. 2: scaling h by the gate equals scaling the logits, on d instead of n_k numbers
        scaled = h * self.inverse_temperature(torch.softmax(scores, 0)[expert])
        if self.class_bias is None:
            logits = torch.mv(weight, scaled)
        else:
            logits = torch.addmv(self.class_bias.index_select(0, classes), weight, scaled)
        log_probs = torch.log_softmax(at_least_fp32(logits), 0).view(1, -1)  # (1, n_e)
        if k == 1:  # greedy decoding: max is about twice as fast as topk(1)
            values, pos = log_probs.max(1, keepdim=True)
            return values, classes.view(1, -1).gather(1, pos)
        j = min(k, classes.numel())
        values, pos = log_probs.topk(j, dim=1)
        indices = classes.view(1, -1).gather(1, pos)
        if j < k:
            values = F.pad(values, (0, k - j), value=-math.inf)
            indices = F.pad(indices, (0, k - j), value=-1)
        return values, indices

    def _traced_experts(self, expert: Tensor) -> tuple[Tensor, list[tuple[Tensor, Tensor, int, int]]]:
        """For the traceable paths: the order grouping contexts by expert ``(N,)`` and, per
        expert, its kept rows ``(n_e, d)``, their classes ``(n_e,)``, where its contexts start in
        that order and how many there are. Sizes are read from tensors (unbacked under export);
        the loop runs over all ``K`` experts, a fixed number, and an unused one costs empty ops."""
        R, N = self.expert_weight.shape[0], expert.shape[0]
        order = torch.argsort(expert)  # group contexts by expert
        counts = torch.zeros_like(self.expert_offsets[1:]).index_add_(0, expert, torch.ones_like(expert))  # (K,), bincount of fixed size
        bounds, sizes = self.expert_offsets.tolist(), counts.tolist()
        blocks, start = [], 0
        for e in range(self.num_experts):
            a, n, m = bounds[e], bounds[e + 1] - bounds[e], sizes[e]
            # the packed storage's invariants, stated for the tracer
            torch._check(a >= 0)
            torch._check(n >= 1)
            torch._check(a + n <= R)
            torch._check(m >= 0)
            torch._check(start + m <= N)
            blocks.append((self.expert_weight.narrow(0, a, n), self.class_index.narrow(0, a, n), start, m))
            start = start + m
        return order, blocks

    def _topk_traceable(self, flat: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """:meth:`topk` of ``flat (N, d)`` as a tracer can follow it (module docstring): per
        expert, its contexts' logits over its kept classes, normalised and ranked block by block.

        Shape:
            flat ``(N, d)`` -> ``(log_probs, indices)``, each ``(N, k)``.
        """
        gate, expert = torch.softmax(at_least_fp32(F.linear(flat, self.gate_weight)), dim=-1).max(dim=-1)  # Eq. 1
        order, blocks = self._traced_experts(expert)
        # Eq. 2: scaling h by the gate equals scaling the logits
        scaled = flat[order] * self.inverse_temperature(gate[order]).unsqueeze(1).to(flat.dtype)  # (N, d), expert-major
        dtype = torch.promote_types(flat.dtype, torch.float32)
        values = flat.new_full((flat.shape[0], k), -math.inf, dtype=dtype)  # (N, k), expert-major
        indices = torch.full((flat.shape[0], k), -1, dtype=torch.long, device=flat.device)
        for weight, classes, start, m in blocks:
            bias = self.class_bias.index_select(0, classes) if self.class_bias is not None else None
            logits = F.linear(scaled.narrow(0, start, m), weight, bias)  # (m, n_e)
            log_probs = F.pad(torch.log_softmax(logits.to(dtype), dim=1), (0, k), value=-math.inf)  # (m, n_e + k)
            top, pos = log_probs.topk(k, dim=1)  # (m, k); a position past n_e is a padding slot
            values = values.slice_scatter(top, 0, start, start + m)
            indices = indices.slice_scatter(F.pad(classes, (0, k), value=-1)[pos], 0, start, start + m)
        unsort = torch.argsort(order)
        return values[unsort], indices[unsort]  # (N, k), back in input order

    def _log_prob_traceable(self, hidden: Tensor) -> Tensor:
        """:meth:`heads.ds.DSSoftmax.log_prob` as a tracer can follow it: each expert's logits
        written into its contexts' rows of the ``(N, V)`` logits.

        Shape: ``(..., d) -> (..., V)``.
        """
        flat = hidden.reshape(-1, self.in_features)  # (N, d)
        gate, expert = torch.softmax(at_least_fp32(F.linear(flat, self.gate_weight)), dim=-1).max(dim=-1)  # Eq. 1
        order, blocks = self._traced_experts(expert)
        logits = flat.new_zeros(flat.shape[0], self.num_classes, dtype=torch.promote_types(flat.dtype, torch.float32))  # (N, V)
        if not self.pruned_in_softmax:
            logits = logits.fill_(-math.inf)  # only the chosen expert's kept classes get a score
        elif self.class_bias is not None:
            logits = logits + self.class_bias.to(logits)  # pruned classes score their bias
        for weight, classes, start, m in blocks:
            rows = order.narrow(0, start, m)  # (m,) this expert's contexts
            expert_logits = self._expert_logits(flat[rows], gate[rows], weight, classes)  # (m, n_e)
            # Both indices expanded to (m, n_e) here, not broadcast by index_put: the ONNX exporter
            # broadcasts index shapes by their maximum, (1, n_e) for an expert with no contexts
            # (m = 0), and onnxruntime then refuses the empty update.
            m_e = expert_logits.shape
            index = (rows.unsqueeze(1).expand(m_e), classes.unsqueeze(0).expand(m_e))  # each (m, n_e)
            logits = logits.index_put(index, expert_logits.to(logits.dtype))
        return torch.log_softmax(logits, dim=-1).view(*hidden.shape[:-1], self.num_classes)

    def _class_table(self) -> Tensor:
        """``(K, n_max)`` class ids of each expert's kept rows, padded with -1 (inference cache)."""
        self._expert_rows()  # refreshes the cache key
        if self._classes_padded is None:
            n_max = max(classes.numel() for _, classes in self._views)
            table = torch.full((self.num_experts, n_max), -1, dtype=torch.long, device=self.class_index.device)
            for e, (_, classes) in enumerate(self._views):
                table[e, : classes.numel()] = classes
            self._classes_padded = table
        return self._classes_padded

    def _inference_rows(self) -> list[tuple[Tensor, Tensor | None]] | None:
        """Per expert, its kept rows transposed ``(d, n_k)`` and their class bias ``(n_k,)`` or None;
        an inference cache for the batch path of :meth:`topk` in eval mode (built on its first
        call), or None (training mode, or where it cannot be kept).

        On CPU BLAS a matmul of a few contexts with ``(d, n_k)`` columns is about twice as fast
        as with ``(n_k, d)`` rows, and the batch path runs
        one such matmul per used expert. The copy costs as much memory as the kept rows and is
        rebuilt when the weights change: its key holds the storage and version counter of the
        rows and the bias, which in-place updates bump (``load_state_dict``, the lasso's
        shrinkage, non-fused optimizers); pruning and mitosis re-allocate and drop it;
        it is not used in training mode, and switching to training mode and every optimizer step
        of a task (``after_optimizer_step``) drop it, since fused optimizers (``fused=True``) and
        writes through ``.data`` bypass version counters: outside a task, after such writes in
        eval mode, call ``clear_inference_cache()``.
        Weights made under ``torch.inference_mode`` have no version counter: nothing is cached.
        """
        weight, bias = self.expert_weight, self.class_bias
        if self.training or weight.is_inference() or (bias is not None and bias.is_inference()):
            return None
        key = (weight.data_ptr(), weight._version) + ((bias.data_ptr(), bias._version) if bias is not None else ())
        if self._inference_cache is None or self._inference_cache[0] != key:
            self._expert_rows()  # sets self._bounds
            with torch.no_grad():
                transposed = weight.detach().t().contiguous()  # (d, R)
                packed_bias = bias.detach()[self.class_index] if bias is not None else None  # (R,)
            bounds = self._bounds
            self._inference_cache = (key, [
                (transposed[:, a:b], packed_bias[a:b] if packed_bias is not None else None)
                for a, b in zip(bounds[:-1], bounds[1:])
            ])
        return self._inference_cache[1]

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
        if self.group_lasso_weight > 0 or self.expert_lasso_weight > 0:
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

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the inference cache: fused optimizers update the weights without bumping their
        version counters, which the cache's key relies on otherwise."""
        self._inference_cache = None

    # ------------------------------------------------------------------ structure changes
    @torch.no_grad()
    def prune(self, threshold: float, optimizers=()) -> list[ParameterRemap]:
        """Remove rows with ``||W^e_(c,k)||_2 < threshold`` (Eq. 4), for good.

        A class's last kept row is never removed when ``keep_last_copy`` (its strongest row
        stays), and every expert keeps at least its strongest row so no expert becomes empty.
        Returns the remap of ``expert_weight`` (empty list when nothing was pruned). The
        ``optimizers`` given (plain PyTorch ones) get the new parameter in place of the old one,
        the kept rows' state carried over; under Lightning use
        ``tasks.callbacks.surgery.apply_structure_change`` with the returned remaps instead.
        """
        remaps = self._prune(threshold)
        carry_optimizer_state(optimizers, remaps)
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
        ``tasks.callbacks.surgery.apply_structure_change`` with the returned remaps instead.
        """
        remaps = self.split_experts(noise, generator)
        carry_optimizer_state(optimizers, remaps)
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


def _length(tensor: Tensor) -> int:
    """Rows of a loaded tensor (0 for a scalar, which the shape checks then refuse)."""
    return tensor.shape[0] if tensor.dim() else 0


def packed_structure_problem(
    class_index: Tensor, expert_offsets: Tensor, num_experts: int, num_rows: int, num_classes: int,
    prefix: str = "", pinned_offsets: Tensor | None = None,
) -> str | None:
    """What is wrong with the index buffers a head would hold after loading a state dict, as the
    clause of an error line naming the buffer (``prefix`` + its name), the value found and the
    rule; ``None`` when they describe a valid packed storage (module docstring) of ``num_rows``
    rows over ``num_experts`` experts and ``num_classes`` classes.

    The rules: integer 1-D tensors; ``expert_offsets`` has ``num_experts + 1`` entries, starts at
    0, increases strictly (no expert is empty) and ends at ``num_rows``; ``class_index`` has
    ``num_rows`` entries, each a class id in ``0..num_classes-1``, ascending and distinct inside
    each expert (``forward`` finds a target by binary search). With ``pinned_offsets`` (the sizes
    :meth:`DSSoftmax.load_structure` took from the checkpoint's metadata) the offsets must be those."""
    offsets_name, classes_name = f"{prefix}expert_offsets", f"{prefix}class_index"
    for name, tensor in ((classes_name, class_index), (offsets_name, expert_offsets)):
        if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
            return f"buffer {name} is a {str(tensor.dtype).removeprefix('torch.')} tensor, but index buffers hold integers"
        if tensor.dim() != 1:
            return f"buffer {name} has shape {tuple(tensor.shape)}, but it must be one-dimensional"
    if class_index.is_meta or expert_offsets.is_meta:
        return None  # no values to check
    offsets, classes = expert_offsets.detach().long().cpu(), class_index.detach().long().cpu()
    if offsets.numel() != num_experts + 1:
        return (f"buffer {offsets_name} has {offsets.numel()} entries, but it must have one per expert plus one "
                f"({num_experts + 1} for {num_experts} experts)")
    if int(offsets[0]) != 0:
        return f"buffer {offsets_name} starts at {int(offsets[0])}, but it must start at 0"
    rows = offsets.diff()  # (K,)
    if bool((rows < 1).any()):
        k = int((rows < 1).nonzero()[0])
        return (f"buffer {offsets_name} goes from {int(offsets[k])} to {int(offsets[k + 1])} at expert {k}, but it must "
                f"increase (every expert keeps at least one class)")
    if int(offsets[-1]) != num_rows:
        return f"buffer {offsets_name} ends at {int(offsets[-1])}, but it must end at the number of packed rows, {num_rows}"
    if pinned_offsets is not None and not torch.equal(offsets, pinned_offsets.detach().long().cpu()):
        return (f"buffer {offsets_name} gives {rows.tolist()[:8]} rows per expert, but the checkpoint's head_structure "
                f"says {pinned_offsets.diff().tolist()[:8]}")
    if classes.numel() != num_rows:
        return f"buffer {classes_name} has {classes.numel()} entries, but there are {num_rows} packed rows (one class each)"
    outside = (classes < 0) | (classes >= num_classes)
    if bool(outside.any()):
        row = int(outside.nonzero()[0])
        return (f"buffer {classes_name} holds {int(classes[row])} at row {row}, but every entry must be a class id "
                f"in 0..{num_classes - 1}")
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts), rows)  # (R,)
    unordered = (expert_of_row * num_classes + classes).diff() <= 0  # (R - 1,)
    if bool(unordered.any()):
        row = int(unordered.nonzero()[0]) + 1
        return (f"buffer {classes_name} holds {int(classes[row])} after {int(classes[row - 1])} at row {row} "
                f"inside expert {int(expert_of_row[row])}, but each expert's classes must be ascending and distinct")
    return None


def _first_strongest(norms: Tensor, group: Tensor, num_groups: int) -> Tensor:
    """``(R,)`` bool: the strongest row of each group, one per group even when norms tie
    (rows the lasso drove to exactly zero, a head built with zeros)."""
    best = torch.full((num_groups,), -1.0, device=norms.device, dtype=norms.dtype).scatter_reduce(0, group, norms, "amax")
    rows = torch.arange(norms.shape[0], device=norms.device)
    candidate = norms == best[group]
    first = torch.full((num_groups,), norms.shape[0], device=norms.device).scatter_reduce(
        0, group[candidate], rows[candidate], "amin")
    return first[group] == rows

