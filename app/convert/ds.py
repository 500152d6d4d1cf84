"""Screen a trained full-softmax checkpoint into a DS-Softmax checkpoint (heads/ds/screening.py).

    python -m app convert ds --ckpt_path softmax.ckpt --num_experts 16 --flops_reduction 10 --output ds16.ckpt
    python -m app test --config <the task's config> --config configs/heads/ds_screened.yaml --ckpt_path ds16.ckpt
    (classification tasks: configs/heads/ds_screened_classifier.yaml)

The output is the same task with its head replaced: gate rows are k-means centroids of the
training contexts, each expert keeps the classes the softmax targets or ranks in its top ``--top``
there, and every kept row is the softmax's own. It holds model weights only (no optimizer state):
evaluate, predict or analyze it (``analyze experts``); it is not a run to resume.
"""

from __future__ import annotations

import argparse
import inspect
import os
from typing import Any

import torch
from torch import Tensor

from app.checkpoint_io import AtomicCheckpointIO, in_memory, read_checkpoint, restore
from app.tools.common import DEFAULT_TASK, add_config_argument, batch_hidden
from datamodules.files import check_output_file
from datamodules.fingerprint import class_path
from heads.ds import DSSoftmax
from heads.ds.screening import screen_softmax
from heads.softmax import Softmax


@torch.no_grad()
def task_contexts(model: Any, loader: Any, max_tokens: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Hidden states ``(N, d)`` and targets ``(N,)`` of up to ``max_tokens`` tokens of ``loader``, in
    eval mode: a random subset of about that many (``generator``; the screening), or without a
    generator the first ones in order (an evaluation). A language model carries its recurrent state
    from batch to batch (the streams are contiguous), so the contexts are the ones ``test`` scores."""
    from tasks.language_model import LanguageModel

    model.eval()
    carry = isinstance(model, LanguageModel)
    state, rate, hidden, targets, seen = None, None, [], [], 0
    for batch in loader:
        target = batch[model.target_key].reshape(-1)
        if carry:
            h, _, state = model.encode(batch["input"].to(model.device), state)
        else:
            h = batch_hidden(model, batch)
        h = h.reshape(target.numel(), -1).float().cpu()
        if rate is None:  # from the first batch's size: the share of tokens to keep
            try:
                rate = 1.0 if generator is None else min(1.0, max_tokens / max(1, target.numel() * len(loader)))
            except TypeError:  # a loader without a length: keep every token (up to max_tokens)
                rate = 1.0
        keep = target >= 0
        if generator is not None:
            keep &= torch.rand(target.numel(), generator=generator) < rate
        hidden.append(h[keep])
        targets.append(target[keep])
        seen += int(keep.sum())
        if generator is None and seen >= max_tokens:
            break
    return torch.cat(hidden)[:max_tokens], torch.cat(targets)[:max_tokens]


def screen_model(
    model: Any, datamodule: Any, num_experts: int, flops_reduction: float | None, min_count: float | None,
    top: int = 5, max_tokens: int = 1_000_000, iterations: int = 15, seed: int = 0, where: str = "the checkpoint",
) -> tuple[DSSoftmax, dict[str, Any]]:
    """The DS-Softmax head screened from ``model``'s full softmax on its training contexts
    (:func:`heads.ds.screening.screen_softmax`), and the screening's report: what ``convert ds``
    writes and ``bench ds`` measures. ``where`` names the checkpoint in the errors."""
    head = model.head
    if type(head) is not Softmax or head.projection is not None:
        raise ValueError(
            f"convert ds needs a checkpoint whose head is a full softmax (heads.Softmax, no projection), got "
            f"{type(head).__name__} in {where}: train one without a head config (the task's default head)"
        )
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    datamodule.setup("fit")
    hidden, targets = task_contexts(model, datamodule.train_dataloader(), max_tokens, generator)
    if hidden.shape[0] < num_experts:
        raise ValueError(f"--num_experts {num_experts} is more than the {hidden.shape[0]} training tokens collected: use fewer experts")
    decoder = head.decoder
    return screen_softmax(decoder.weight, decoder.bias, hidden, targets, num_experts, flops_reduction, min_count, top, iterations, generator)


def converted_checkpoint(checkpoint: dict[str, Any], head: torch.nn.Module, report: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with its head's weights, hyper-parameters and structure replaced by ``head``'s,
    and without the training state that belonged to the softmax (optimizer, schedulers, loops)."""
    out = {k: v for k, v in checkpoint.items() if k not in ("optimizer_states", "lr_schedulers", "loops", "callbacks")}
    state = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("head.")}
    state.update({f"head.{k}": v.detach().clone() for k, v in head.state_dict().items()})
    out["state_dict"] = state
    hparams = dict(checkpoint["hyper_parameters"])
    if "tie_weights" in hparams:  # language models: one row per (expert, class), nothing to tie to the input embedding
        hparams["tie_weights"] = False
    # every argument, as fit saves them (a reader refuses a part whose saved arguments lack one)
    defaults = {name: parameter.default for name, parameter in inspect.signature(DSSoftmax.__init__).parameters.items()
                if parameter.default is not inspect.Parameter.empty}
    hparams["head"] = {
        "class_path": "heads.DSSoftmax",
        "init_args": {**defaults, "num_experts": head.num_experts, "class_bias": head.class_bias is not None,
                      "gate_scale": "unit", "pruned_in_softmax": False, "ignore_index": head.ignore_index},
    }
    out["hyper_parameters"] = hparams
    out["head_structure"] = head.structure()
    if "headbench" in checkpoint:  # same task and data, another head
        out["headbench"] = {**checkpoint["headbench"], "head": class_path(head)}
    out["ds_screening"] = report
    return out


def save_verified(checkpoint: dict[str, Any], model_class: type, path: str) -> None:
    """Serialise ``checkpoint``, read it back through the project's one reader and build it as
    ``model_class``, all in memory, then write it with the project's atomic writer
    (:class:`app.checkpoint_io.AtomicCheckpointIO`): a checkpoint that does not load is never
    written, and a failed write leaves the old file untouched."""
    restore(path, read_checkpoint(in_memory(checkpoint)), default_task=model_class, data=False)
    AtomicCheckpointIO().save_checkpoint(checkpoint, path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m app convert ds", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt_path", required=True, help="checkpoint of a task with a full softmax head (heads.Softmax)")
    parser.add_argument("--output", required=True, help="where to write the DS-Softmax checkpoint")
    add_config_argument(parser)
    parser.add_argument("--num_experts", type=int, default=16)
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--flops_reduction", type=float, default=None, help="keep the most classes that still reach this reduction (default 10)")
    target.add_argument("--min_count", type=float, default=None, help="instead: keep a class where it was counted at least this often")
    parser.add_argument("--top", type=int, default=5, help="count a class where the softmax ranks it in its top TOP (besides targets)")
    parser.add_argument("--max_tokens", type=int, default=1_000_000, help="training tokens to screen on (a random subset)")
    parser.add_argument("--iterations", type=int, default=15, help="k-means iterations")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("num_experts", "max_tokens", "iterations", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if os.path.abspath(args.output) == os.path.abspath(args.ckpt_path):
        raise ValueError(f"--output {args.output} is the input checkpoint: write the DS-Softmax checkpoint to a new path")
    flops = 10.0 if args.flops_reduction is None and args.min_count is None else args.flops_reduction
    check_output_file(args.output, "output")  # before the screening runs: a directory, or one that takes no file
    checkpoint = read_checkpoint(args.ckpt_path)
    model, datamodule = restore(args.ckpt_path, checkpoint, default_task=DEFAULT_TASK, config=args.config)
    ds_head, report = screen_model(model, datamodule, args.num_experts, flops, args.min_count, args.top, args.max_tokens,
                                   args.iterations, args.seed, args.ckpt_path)
    save_verified(converted_checkpoint(checkpoint, ds_head, report), type(model), args.output)
    print(f"wrote {args.output}: {report['num_experts']} experts, FLOPs reduction {report['flops_reduction']:.2f}x, "
          f"kept fraction {report['kept_fraction']:.4f}, {report['copies_per_class']:.2f} copies per class, coverage "
          f"{report['coverage']:.4f} of {report['screening_tokens']} training tokens (threshold {report['threshold']:g})")
    return 0
