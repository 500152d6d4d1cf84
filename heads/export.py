"""A head's inference path as a :func:`torch.export` program: ``log_prob`` or ``topk`` over a batch
of hidden states whose size is left free.

    program = heads.export.export_head(head, method="topk", k=10)
    torch.export.save(program, "head.pt2")
    log_probs, indices = torch.export.load("head.pt2").module()(hidden)  # hidden (N, in_features)

Every registered head exports both methods (tests/test_export.py). Heads whose eager path relies
on caches or on sizes read from the data (DS-Softmax's sparse ``topk``, Hybrid-LightRNN's early
stop) trace a formulation without them when :func:`torch.compiler.is_compiling` says a tracer is
running; the exported program answers what the eager head answers.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from heads.base import OutputHead

#: The inference methods a head exports.
METHODS = ("log_prob", "topk")


class HeadInference(nn.Module):
    """One inference method of a head as a module's ``forward`` (what :func:`torch.export.export` traces).

    Args:
        head: a trained head; it is put in eval mode.
        method: ``"log_prob"`` (normalised log-probabilities over all classes) or ``"topk"``.
        k: number of classes ``topk`` returns (ignored by ``log_prob``).

    Shape:
        hidden ``(N, in_features)`` -> ``log_prob``: ``(N, num_classes)``;
        ``topk``: ``(log_probs, indices)``, each ``(N, k)``.
    """

    def __init__(self, head: OutputHead, method: str = "topk", k: int = 10) -> None:
        super().__init__()
        check_export_arguments(head, method, k)
        self.head = head.eval()
        self.method = method
        self.k = k

    def forward(self, hidden: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        if self.method == "log_prob":
            return self.head.log_prob(hidden)
        values, indices = self.head.topk(hidden, self.k)  # a plain tuple: torch.return_types do not serialise
        return values, indices


def check_export_arguments(head: object, method: str, k: int) -> None:
    """One ``ValueError`` naming the value, the rule and the fix for an argument export refuses."""
    if not isinstance(head, OutputHead):
        raise ValueError(f"export needs an output head (heads.base.OutputHead), got {type(head).__name__}")
    if method not in METHODS:
        raise ValueError(f"unknown export method {method!r}: valid methods are {', '.join(METHODS)} (set --method)")
    if getattr(head, "code_inputs", False):  # heads.lightrnn.HybridLightRNNCodes
        raise ValueError(
            f"{type(head).__name__} reads codes, so its word distribution needs the network, not one hidden state: "
            f"it cannot be exported alone (export an output-only heads.HybridLightRNN model instead)"
        )
    if method == "topk" and not (isinstance(k, int) and 1 <= k <= head.num_classes):
        raise ValueError(
            f"topk needs 1 <= k <= num_classes={head.num_classes} of the {type(head).__name__} head, got k={k} (set --k)"
        )


def example_hidden(head: OutputHead, batch: int = 4, seed: int = 0) -> Tensor:
    """Random hidden states ``(batch, in_features)`` in the dtype of the head's weights (float32 without any)."""
    dtype = next((t.dtype for t in (*head.parameters(), *head.buffers()) if t.is_floating_point()), torch.float32)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, head.in_features, generator=generator).to(dtype)


def export_head(head: OutputHead, method: str = "topk", k: int = 10) -> torch.export.ExportedProgram:
    """:func:`torch.export.export` of ``head``'s ``method`` on CPU with a free batch size.

    The head is put in eval mode (dropout off, inference caches allowed); the program holds its
    weights. Load it with ``torch.export.load(path).module()``.
    """
    module = HeadInference(head, method, k)
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        return torch.export.export(module, (example_hidden(head),), dynamic_shapes={"hidden": {0: batch}})
