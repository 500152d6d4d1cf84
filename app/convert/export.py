"""Write a trained head's inference path as a ``torch.export`` program (heads/export.py).

    python -m app convert export --ckpt_path last.ckpt --output head.pt2 --method topk --k 10

The program maps hidden states ``(N, in_features)`` (any ``N``) to the head's ``topk``
(log-probabilities and class ids, each ``(N, k)``) or ``log_prob`` (``(N, num_classes)``) and holds
the head's weights; load it with ``torch.export.load(path).module()``, without this project. It is
checked against the head's own outputs before it is written, and written atomically.
"""

from __future__ import annotations

import argparse
import io
import os

import torch

from app.checkpoint_io import read_checkpoint
from app.runtime.directories import check_writable_directory
from app.tools.common import DEFAULT_TASK, add_config_argument, restore_checkpoint
from datamodules.files import write_atomically
from heads.base import OutputHead
from heads.export import METHODS, check_export_arguments, example_hidden, export_head


def check_program(program: torch.export.ExportedProgram, head: OutputHead, method: str, k: int) -> None:
    """The program, saved and loaded back, answers what the eager head answers on random hidden
    states (one context and a batch); a ``ValueError`` otherwise."""
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    for batch in (1, 7):
        hidden = example_hidden(head, batch, seed=batch)
        with torch.no_grad():
            got, want = loaded(hidden), (head.log_prob(hidden) if method == "log_prob" else head.topk(hidden, k))
        got, want = (got,) if method == "log_prob" else got, (want,) if method == "log_prob" else want
        for a, b in zip(got, want):
            if a.shape != b.shape or not torch.allclose(a, b, atol=1e-5, rtol=1e-4, equal_nan=True):
                raise ValueError(
                    f"the exported {method} of {type(head).__name__} does not reproduce the head on a batch of {batch} "
                    f"(shapes {tuple(a.shape)} vs {tuple(b.shape)}): nothing written; report it with the checkpoint"
                )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m app convert export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt_path", required=True, help="checkpoint of a run (python -m app fit)")
    parser.add_argument("--output", required=True, help="where to write the program (.pt2)")
    parser.add_argument("--method", default="topk", help=f"inference method to export: {' or '.join(METHODS)} (default topk)")
    parser.add_argument("--k", type=int, default=10, help="classes topk returns (default 10)")
    add_config_argument(parser)
    args = parser.parse_args(argv)
    if args.method not in METHODS:  # before the checkpoint is read
        raise ValueError(f"unknown export method {args.method!r}: valid methods are {', '.join(METHODS)} (set --method)")
    if os.path.abspath(args.output) == os.path.abspath(args.ckpt_path):
        raise ValueError(f"--output {args.output} is the input checkpoint: write the program to a new path")
    check_writable_directory(os.path.dirname(os.path.abspath(args.output)), "output")
    checkpoint = read_checkpoint(args.ckpt_path)
    if not any(str(key).startswith("head.") for key in checkpoint.get("state_dict") or {}):
        raise ValueError(
            f"checkpoint {args.ckpt_path} holds no output head (no head.* weights in its state_dict): "
            f"pass a checkpoint of a run (python -m app fit)"
        )
    model, _ = restore_checkpoint(args.ckpt_path, checkpoint, default_task=DEFAULT_TASK, data=False, config=args.config)
    head = getattr(model, "head", None)
    if not isinstance(head, OutputHead):
        raise ValueError(f"checkpoint {args.ckpt_path} restores {type(model).__name__} without an output head: pass a checkpoint of a run (python -m app fit)")
    head = head.float().eval()
    check_export_arguments(head, args.method, args.k)
    program = export_head(head, args.method, args.k)
    check_program(program, head, args.method, args.k)
    write_atomically(args.output, lambda handle: torch.export.save(program, handle), "exported program")
    shape = f"(N, {head.num_classes})" if args.method == "log_prob" else f"(log_probs, indices), each (N, {args.k})"
    print(f"wrote {args.output}: {type(head).__name__} {args.method} of hidden (N, {head.in_features}) -> {shape}, N free; "
          f"load with torch.export.load({args.output!r}).module()")
    return 0
