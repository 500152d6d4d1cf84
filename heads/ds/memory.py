"""Training memory of a DS-Softmax head as §3.6 / App. B of Liao et al. count it.

The memory needed to *train* the head is its parameters, one gradient per trainable parameter
(what the backward pass allocates) and the optimizer's state for them (Adam: two moments). The
reference is a full softmax of the same ``V`` and ``d`` (weight ``V x d`` plus bias ``V``) trained
with the same optimizer: its parameters, gradients and the same number of optimizer slots per
parameter. :func:`training_memory` returns both and their ratio; :func:`plot_memory` draws the
ratio against training progress with the clonings marked (the paper's Fig. 6a).
"""

from __future__ import annotations

import io
from typing import Any, Iterable

import torch
from torch import Tensor, nn


def _bytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer], module: nn.Module) -> int:
    """Bytes of tensor state the optimizers hold for ``module``'s parameters."""
    params = {id(p) for p in module.parameters()}
    return sum(
        _bytes(v for v in state.values() if isinstance(v, Tensor))
        for optimizer in optimizers for param, state in optimizer.state.items() if id(param) in params
    )


def optimizer_slots(optimizers: Iterable[torch.optim.Optimizer], param: Tensor) -> int:
    """Parameter-sized state tensors the optimizers keep for ``param`` (Adam: 2, SGD with
    momentum: 1; 0 before the first step)."""
    return sum(
        1 for optimizer in optimizers for value in optimizer.state.get(param, {}).values()
        if isinstance(value, Tensor) and value.shape == param.shape
    )


def training_memory(head: Any, optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, float]:
    """The head's parameter, gradient and optimizer-state bytes, their sum, the same for a full
    softmax of the head's ``V`` and ``d`` with the same optimizer, and the ratio of the two."""
    optimizers = list(optimizers)
    params = list(head.parameters())
    param_bytes = _bytes(params)
    grad_bytes = _bytes(p for p in params if p.requires_grad)
    state_bytes = optimizer_state_bytes(optimizers, head)
    total = param_bytes + grad_bytes + state_bytes
    element = head.expert_weight.element_size()
    softmax_params = (head.num_classes * head.in_features + head.num_classes) * element
    reference = softmax_params * (2 + optimizer_slots(optimizers, head.expert_weight))
    return {
        "param_bytes": float(param_bytes),
        "grad_bytes": float(grad_bytes),
        "optimizer_bytes": float(state_bytes),
        "bytes": float(total),
        "full_softmax_bytes": float(reference),
        "ratio": total / reference,
    }


def plot_memory(steps: list[float], ratios: list[float], clonings: list[dict[str, float]]) -> bytes:
    """PNG of the memory ratio against the optimizer step, each cloning a dashed line labelled
    with the number of experts it produced, the peak marked."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        axes.plot(steps, ratios, color="tab:blue", linewidth=1.2, label="DS-Softmax head")
        axes.axhline(1.0, color="grey", linewidth=0.8, label="full softmax")
        top = max(ratios + [row["ratio"] for row in clonings] + [1.0])
        for row in clonings:
            axes.axvline(row["step"], color="tab:orange", linestyle="--", linewidth=0.8)
            axes.text(row["step"], top * 1.02, f"K={int(row['num_experts'])}", rotation=90, fontsize=7,
                      ha="right", va="bottom", color="tab:orange")
        if ratios:
            peak = max(range(len(ratios)), key=ratios.__getitem__)
            axes.plot([steps[peak]], [ratios[peak]], "o", color="tab:red", label=f"peak {ratios[peak]:.2f}x")
        axes.set_xlabel("optimizer step")
        axes.set_ylabel("head memory / full softmax\n(params + grads + optimizer state)")
        axes.set_ylim(0, top * 1.15)
        axes.set_title("Mitosis training: head memory (clonings dashed)")
        axes.legend(loc="lower right", fontsize=8)
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        return buffer.getvalue()
    finally:
        plt.close(figure)


def png_to_chw(png: bytes) -> Tensor:
    """``(3, H, W)`` uint8 image of a PNG (for TensorBoard's ``add_image``)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import image

    array = image.imread(io.BytesIO(png), format="png")  # (H, W, 4) floats in [0, 1]
    return (torch.from_numpy(array[..., :3].copy()) * 255).round().to(torch.uint8).permute(2, 0, 1)
