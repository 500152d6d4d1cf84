"""Token-weighted metrics from summed statistics.

Averages of per-batch averages are wrong when batches hold different numbers of tokens
(the last TBPTT window, padded rows): every metric here keeps sums and counts, reduced
with ``sum`` across DDP ranks by torchmetrics, and divides once at the end.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric


class TokenMetrics(Metric):
    """Mean NLL, perplexity and top-k accuracy over all non-ignored tokens.

    ``update(nll, target, topk_indices=None)`` takes per-token NLL ``(...)``, targets
    ``(...)`` (``ignore_index`` positions skipped) and optionally the ``(..., k_max)``
    best classes, best first.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, topk: Sequence[int] = (1, 5, 10), ignore_index: int = -100) -> None:
        super().__init__()
        self.ks = tuple(sorted(topk))
        self.ignore_index = ignore_index
        self.add_state("nll_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("correct", torch.zeros(len(self.ks), dtype=torch.long), dist_reduce_fx="sum")

    @property
    def max_k(self) -> int:
        return self.ks[-1] if self.ks else 0

    def update(self, nll: Tensor, target: Tensor, topk_indices: Tensor | None = None) -> None:
        valid = target != self.ignore_index
        self.nll_sum += nll.detach()[valid].double().sum()
        self.tokens += valid.sum()
        if topk_indices is not None and self.ks:
            hits = topk_indices == target.unsqueeze(-1)  # (..., k_max)
            for i, k in enumerate(self.ks):
                self.correct[i] += (hits[..., :k].any(-1) & valid).sum()

    def compute(self) -> dict[str, Tensor]:
        tokens = self.tokens.clamp_min(1).double()
        loss = self.nll_sum / tokens
        out = {"loss": loss.float(), "ppl": torch.exp(loss.clamp_max(math.log(1e30))).float()}
        if self.ks:
            for i, k in enumerate(self.ks):
                out[f"acc@{k}"] = (self.correct[i].double() / tokens).float()
        out["tokens"] = self.tokens.float()
        return out
