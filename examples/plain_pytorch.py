"""Heads as a library: Mixtape, MoS and DS-Softmax on a tiny GRU language model, trained with a
plain PyTorch loop (no Lightning).

    python examples/plain_pytorch.py --steps 120

Each head owns its loss (docs/library.md): ``head(hidden, target)`` is the per-token negative
log-likelihood (zero where the target is ``heads.base.IGNORE_INDEX``), ``head.regularization()``
the head's weighted auxiliary losses to add, ``head.after_optimizer_step(optimizer)`` what the head
does after each step, and ``head.topk(hidden, k)`` its inference path. DS-Softmax's structure
changes are plain calls: ``clone_experts`` (mitosis) and ``prune`` (group-lasso pruning), each
given the optimizer so its state follows the new parameters.

The data is a generated language whose next token is a noisy function of the current one, with
token ids in decreasing frequency (Mixtape's gate sharing relies on that order). Prints the
held-out loss of each head before and after training.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone without installing

import heads  # noqa: E402
from heads.base import IGNORE_INDEX  # noqa: E402

VOCAB, WIDTH = 60, 32


class TinyLM(nn.Module):
    """Embedding -> GRU -> any head: the head is the only part that knows the vocabulary's distribution."""

    def __init__(self, head: heads.OutputHead) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.rnn = nn.GRU(WIDTH, WIDTH, batch_first=True)
        self.head = head

    def hidden(self, tokens: Tensor) -> Tensor:
        """Shape: tokens ``(B, T)`` -> hidden states ``(B, T, WIDTH)``."""
        output, _ = self.rnn(self.embedding(tokens))
        return output

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean NLL per scored token plus the head's auxiliary losses."""
        nll = self.head(self.hidden(tokens), targets)  # (B, T), 0 where targets == IGNORE_INDEX
        loss = nll.sum() / (targets != IGNORE_INDEX).sum().clamp_min(1)
        return loss + sum(self.head.regularization().values())


def language(batch: int, length: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Token windows ``(B, T)`` and their next tokens: token ``t + 1`` is ``3 t + 1 mod V`` with
    probability 0.8, else a draw from a Zipf-like unigram (low ids frequent)."""
    unigram = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float)
    tokens = torch.empty(batch, length + 1, dtype=torch.long)
    tokens[:, 0] = torch.multinomial(unigram, batch, replacement=True, generator=generator)
    for t in range(length):
        follow = (3 * tokens[:, t] + 1) % VOCAB
        noise = torch.multinomial(unigram, batch, replacement=True, generator=generator)
        tokens[:, t + 1] = torch.where(torch.rand(batch, generator=generator) < 0.8, follow, noise)
    targets = tokens[:, 1:].clone()
    targets[:, 0] = IGNORE_INDEX  # positions a head does not score are marked, not cut
    return tokens[:, :-1], targets


@torch.no_grad()
def held_out_loss(model: TinyLM, tokens: Tensor, targets: Tensor) -> float:
    model.eval()
    nll = model.head(model.hidden(tokens), targets)
    model.train()
    return float(nll.sum() / (targets != IGNORE_INDEX).sum())


def train(name: str, make_head: Callable[[], heads.OutputHead], steps: int, seed: int) -> tuple[float, float]:
    torch.manual_seed(seed)  # before the head is built, so its initialisation is seeded too
    head = make_head()
    generator = torch.Generator().manual_seed(seed)
    model = TinyLM(head)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    valid = language(32, 12, torch.Generator().manual_seed(seed + 1))
    before = held_out_loss(model, *valid)
    for step in range(1, steps + 1):
        loss = model(*language(16, 12, generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        head.after_optimizer_step(optimizer)  # DS-Softmax: drops its inference cache
        if isinstance(head, heads.DSSoftmax) and step == steps // 3:
            head.clone_experts(generator=generator, optimizers=[optimizer])  # mitosis: K -> 2K, Adam state carried
        if isinstance(head, heads.DSSoftmax) and step == 2 * steps // 3:
            head.prune(threshold=0.05, optimizers=[optimizer])  # drop rows the group lasso shrank
    after = held_out_loss(model, *valid)
    extra = ""
    if isinstance(head, heads.DSSoftmax):
        extra = f" ({head.num_experts} experts, {head.expert_weight.shape[0]} of {head.num_experts * VOCAB} rows kept)"
    model.eval()
    with torch.no_grad():
        _, best = head.topk(model.hidden(valid[0][:1])[:, -1], k=3)  # the inference path: 3 best next tokens
    print(f"{name}: held-out loss {before:.3f} -> {after:.3f}{extra}; top-3 next tokens {best[0].tolist()}")
    return before, after


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (``--steps 0`` or ``-3`` would train nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 (optimizer steps per head), got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=120, help="optimizer steps per head (>= 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name, make_head in (
        ("Mixtape", lambda: heads.Mixtape(WIDTH, VOCAB, num_gates=4, gate_dim=16, frequent_fraction=0.1)),
        ("MoS", lambda: heads.MoS(WIDTH, VOCAB, num_components=3)),
        ("DSSoftmax", lambda: heads.DSSoftmax(WIDTH, VOCAB, num_experts=2, group_lasso_weight=0.01, class_bias=True)),
    ):
        train(name, make_head, args.steps, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
