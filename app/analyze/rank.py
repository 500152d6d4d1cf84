"""``python -m app analyze rank``: is a trained head's log-probability matrix high-rank?

For each checkpoint, the hidden states of ``T`` contexts from a data split go through the head;
their log-probability vectors are stacked into a ``T x V`` matrix ``A`` (Yang et al. 2018, §2.1:
a softmax over ``d``-wide contexts gives ``rank(A) <= d + 1``). Printed per checkpoint:

* the empirical rank: the number of singular values above the tolerance
  ``sigma_max * max(T, V) * eps`` (``eps`` the machine epsilon of the matrix's dtype; the
  rule of Numerical Recipes §2.6 and ``numpy.linalg.matrix_rank``), with the tolerance itself;
* the normalised singular-value CDF (MoS App. C.1, Fig. 1): the fraction of singular values
  ``sigma_i / sigma_max <= x``, saved as a PNG and a TensorBoard figure;
* the expected pairwise KL divergence between contexts, ``E_{i != j} KL(p_i || p_j)``
  (MoS App. C.1, Table 11), which is large when the head can express very different
  distributions for different contexts.

Sources: ``--ckpt_path`` checkpoints written by ``tasks.language_model.LanguageModel`` (the model and
datamodule are rebuilt from the checkpoint alone), or ``--log_probs`` files holding a saved
``T x V`` tensor (``torch.save``) for matrices computed elsewhere.
"""

from __future__ import annotations

import argparse
import copy
import io
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import Tensor

from app.checkpoint_io.reading import read_tensor_file
from app.checkpoint_io import restore
from app.tools.common import add_config_argument, write_output
from app.runtime.directories import check_writable_directory


# ---------------------------------------------------------------------- linear algebra
@dataclass
class RankResult:
    rank: int
    tolerance: float
    singular_values: Tensor  # (min(T, V),), descending


def empirical_rank(matrix: Tensor) -> RankResult:
    """Numerical rank of a ``T x V`` matrix with the tolerance ``sigma_max * max(T, V) * eps``.

    ``eps`` is the machine epsilon of ``matrix.dtype`` (2.2e-16 for float64, 1.2e-7 for
    float32): the singular values of a rank-``r`` matrix stored in that precision are only
    known to about that much, so anything below is indistinguishable from zero.
    """
    if matrix.dim() != 2 or min(matrix.shape) == 0:
        raise ValueError(f"empirical_rank needs a non-empty 2-D matrix, got shape {tuple(matrix.shape)}")
    if not matrix.is_floating_point():
        matrix = matrix.double()
    singular_values = torch.linalg.svdvals(matrix)  # (min(T, V),), descending
    eps = torch.finfo(matrix.dtype).eps
    tolerance = float(singular_values[0]) * max(matrix.shape) * eps
    return RankResult(int((singular_values > tolerance).sum()), tolerance, singular_values)


def singular_value_cdf(singular_values: Tensor) -> tuple[Tensor, Tensor]:
    """Normalised singular values ``sigma_i / sigma_max`` (ascending) and the cumulative
    fraction of singular values at or below each (MoS App. C.1)."""
    values = (singular_values / singular_values.max()).sort().values  # (n,), ascending
    fraction = torch.arange(1, values.numel() + 1, dtype=values.dtype) / values.numel()
    return values, fraction


def expected_pairwise_kl(log_probs: Tensor, block: int = 1024) -> float:
    """``E_{i != j} KL(p_i || p_j)`` over all ordered pairs of rows of ``log_probs`` ``(T, V)``.

    ``KL(p_i || p_j) = sum_v p_iv log p_iv - sum_v p_iv log p_jv``, so all pairs come from
    one ``T x T`` product ``P (log P)^T``, computed in row blocks.
    """
    T = log_probs.shape[0]
    if T < 2:
        raise ValueError(f"expected_pairwise_kl needs at least 2 contexts, got {T}")
    log_probs = log_probs.double()
    probs = log_probs.exp()  # (T, V)
    # 0 * log 0 = 0: clamp -inf log-probabilities where p is exactly zero.
    safe_log = log_probs.clamp_min(torch.finfo(torch.float64).min)
    neg_entropy = (probs * safe_log).sum(-1)  # (T,): sum_v p_iv log p_iv
    total = 0.0
    for start in range(0, T, block):
        cross = probs[start : start + block] @ safe_log.t()  # (b, T): sum_v p_iv log p_jv
        kl = neg_entropy[start : start + block, None] - cross  # (b, T)
        total += float(kl.sum() - kl.diagonal(offset=start).sum())
    return total / (T * (T - 1))


@dataclass
class MatrixReport:
    name: str
    shape: tuple[int, int]
    rank: int
    tolerance: float
    bound: int | None  # d + 1 (+1 with a class bias) for heads with one d-wide context, else None
    expected_kl: float
    singular_values: Tensor


def analyse_matrix(name: str, log_probs: Tensor, bound: int | None = None) -> MatrixReport:
    """Rank, tolerance and expected pairwise KL of one ``T x V`` log-probability matrix."""
    result = empirical_rank(log_probs)
    return MatrixReport(
        name, tuple(log_probs.shape), result.rank, result.tolerance, bound, expected_pairwise_kl(log_probs),
        result.singular_values,
    )


def format_table(reports: Iterable[MatrixReport]) -> str:
    lines = [
        "| source | T x V | empirical rank | tolerance | rank bound | expected pairwise KL (nats) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in reports:
        lines.append(
            f"| {r.name} | {r.shape[0]} x {r.shape[1]} | {r.rank} | {r.tolerance:.3g} "
            f"| {'-' if r.bound is None else r.bound} | {r.expected_kl:.3f} |"
        )
    return "\n".join(lines)


def cdf_figure(reports: Iterable[MatrixReport]):
    """Matplotlib figure of the normalised singular-value CDFs, one curve per source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    for r in reports:
        values, fraction = singular_value_cdf(r.singular_values)
        values = values.clamp_min(1e-18)  # exact zeros cannot sit on a log axis
        ax.plot(values.numpy(), 100 * fraction.numpy(), label=f"{r.name} (rank {r.rank})")
    # Log scale: the all-ones direction (every log-probability is negative) makes sigma_1 dominate,
    # so on a linear axis every curve is a step at 0.
    ax.set_xscale("log")
    ax.set_xlabel("normalised singular value sigma_i / sigma_1 (log scale)")
    ax.set_ylabel("cumulative percentage")
    ax.set_title("Singular-value CDF of the log-probability matrix")
    ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------- checkpoints
def load_checkpoint(path: str, config: list[str] | None = None) -> tuple[Any, Any]:
    """Rebuild a language model and its datamodule from a checkpoint alone (read through the
    project's one reader, :func:`app.checkpoint_io.read_checkpoint`)."""
    from tasks.language_model import LanguageModel

    model, datamodule = restore(path, default_task=LanguageModel, config=config)
    if not isinstance(model, LanguageModel):
        raise ValueError(f"analyze rank needs a language-model checkpoint (tasks.LanguageModel), got {type(model).__name__} in {path}")
    return model, datamodule


def head_bound(head: Any) -> int | None:
    """Rank bound of heads whose logits are linear in one ``d``-wide context (softmax, MoC):
    ``d + 1`` (the context part plus the row-wise normaliser), plus one for a class bias
    (the rank-one term ``1 b^T``)."""
    from heads import MixtureOfContexts, Softmax

    if isinstance(head, (Softmax, MixtureOfContexts)):
        return head.output_embedding_dim + 1 + int(head.decoder.bias is not None)
    return None


@torch.no_grad()
def checkpoint_log_probs(path: str, split: str, max_contexts: int, config: list[str] | None = None) -> tuple[Tensor, Any]:
    """Stack up to ``max_contexts`` log-probability vectors of a split into ``(T, V)`` (float64)."""
    model, datamodule = load_checkpoint(path, config)
    model.eval()
    datamodule.prepare_data()
    datamodule.setup("test" if split == "test" else "fit")
    loader = {"train": datamodule.train_dataloader, "val": datamodule.val_dataloader,
              "test": datamodule.test_dataloader}[split]()
    # A float64 copy of the head: with tied weights the class embeddings are the encoder's input
    # embedding, which must stay float32 for the encoder.
    head = copy.deepcopy(model.head).double()
    rows, count = [], 0
    for batch in loader:
        hidden = model.hidden_states(batch)  # (B, T, H)
        keep = batch["target"].reshape(-1) != -100
        flat = hidden.reshape(-1, hidden.shape[-1])[keep][: max_contexts - count]  # (n, H)
        rows.append(head.log_prob(flat.double()))
        count += flat.shape[0]
        if count >= max_contexts:
            break
    if not rows:
        raise ValueError(f"split {split!r} of {path} gave no contexts")
    return torch.cat(rows), model.head


# ---------------------------------------------------------------------- CLI
def source_name(path: str) -> str:
    """A short label: the run directory for ``<run>/version_N/checkpoints/x.ckpt``, else the file name."""
    parts = os.path.normpath(path).split(os.sep)
    if "checkpoints" in parts and parts.index("checkpoints") >= 2:
        run = parts[parts.index("checkpoints") - 2]
        return f"{run}/{parts[-1]}"
    return os.path.basename(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app analyze rank", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt_path", nargs="*", default=[], help="LanguageModel checkpoints to compare")
    parser.add_argument("--log_probs", nargs="*", default=[], help="saved (T, V) log-probability tensors (torch.save)")
    parser.add_argument("--split", choices=("train", "val", "test"), default="test")
    add_config_argument(parser)
    parser.add_argument("--max_contexts", type=int, default=2000, help="T, contexts stacked per checkpoint")
    parser.add_argument("--output_dir", default="runs/rank", help="where the PNG and TensorBoard events go")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.ckpt_path and not args.log_probs:
        parser.error("give at least one --ckpt_path or --log_probs file")
    if args.max_contexts < 2:
        parser.error(f"--max_contexts must be >= 2, got {args.max_contexts}")
    # before the analysis runs, not after it: an unwritable directory is one line at once
    check_writable_directory(args.output_dir, "output_dir")
    reports = []
    for path in args.ckpt_path:
        log_probs, head = checkpoint_log_probs(path, args.split, args.max_contexts, args.config)
        name = f"{source_name(path)} ({type(head).__name__})"
        reports.append(analyse_matrix(name, log_probs, head_bound(head)))
    for path in args.log_probs:
        matrix = read_tensor_file(path, "--log_probs")
        if not isinstance(matrix, Tensor) or matrix.dim() != 2 or not matrix.is_floating_point():
            got = f"a {matrix.dtype} tensor of shape {tuple(matrix.shape)}" if isinstance(matrix, Tensor) else type(matrix).__name__
            raise ValueError(f"--log_probs {path} must hold one 2-D floating-point tensor of log-probabilities (T, V), got {got}")
        if bool((matrix.isnan() | (matrix == math.inf)).any()):
            raise ValueError(f"--log_probs {path} holds NaN or +Inf values: log-probabilities are finite or -inf (zero probability)")
        reports.append(analyse_matrix(os.path.basename(path), matrix[: args.max_contexts]))
    print("empirical rank: singular values above sigma_max * max(T, V) * eps (eps of the matrix dtype)")
    print(format_table(reports))
    figure = cdf_figure(reports)
    png = os.path.join(args.output_dir, "singular_value_cdf.png")
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=100)
    write_output(png, image.getvalue(), "--output_dir")
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(args.output_dir) as writer:
        writer.add_figure("rank/singular_value_cdf", figure)
        for r in reports:
            writer.add_text(f"rank/{r.name}", f"rank {r.rank} (tolerance {r.tolerance:.3g}), E[KL] {r.expected_kl:.4f}")
    print(f"singular-value CDF: {png} (and TensorBoard events in {args.output_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
