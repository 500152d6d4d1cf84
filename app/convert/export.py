"""Write a trained model's inference path as an ONNX file or a ``torch.export`` program (heads/export.py).

    python -m app convert export --ckpt_path last.ckpt --output head.onnx --method topk --k 10
    python -m app convert export --ckpt_path last.ckpt --output lm.onnx --part network

The format follows the output's suffix (``.onnx`` or ``.pt2``; ``--format`` for any other name).
``--part head`` (the default) maps hidden states ``(N, in_features)`` (any ``N``) to the head's
``topk`` (log-probabilities and class ids, each ``(N, k)``) or ``log_prob`` (``(N, num_classes)``);
``--part network`` maps a language model's token ids and recurrent state to the same at every
position and the new state (tasks.language_model.NextTokenInference). The file holds the weights and
runs without this project: in onnxruntime, or with ``torch.export.load(path).module()``.

ONNX is translated from the ``torch.export`` program by torch's dynamo-based exporter, never by
the TorchScript one. Before anything is written the file's bytes are loaded back as a user loads
them (onnxruntime, or ``torch.export.load``) and run on sample batches, an expert of DS-Softmax
left without contexts among them; an answer more than ``heads.export.TOLERANCE`` from the eager
model's is one error line and nothing is written. The file is written atomically.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

import torch
from torch import Tensor, nn

from app.checkpoint_io import read_checkpoint, restore
from app.tools.common import DEFAULT_TASK, add_config_argument
from datamodules.files import check_output_file, write_atomically
from heads.base import OutputHead
from heads.export import (
    FORMATS, METHODS, ONNX_EXTRA, TOLERANCE, HeadInference, check_export_arguments, check_onnx_exporter, difference, example_hidden, export_head,
    flat_tensors, load_program, onnx_model, output_names, pt2_bytes,
)

#: What ``--part`` exports.
PARTS = ("head", "network")


def file_format(output: str, chosen: str | None) -> str:
    """The format ``--format`` names, else the one the output's suffix names; one ``ValueError``
    for an unknown suffix without ``--format`` or a suffix that contradicts it."""
    suffix = os.path.splitext(output)[1].lower()
    by_suffix = next((name for name, known in FORMATS.items() if suffix == known), None)
    if chosen is not None and chosen not in FORMATS:
        raise ValueError(f"unknown export format {chosen!r}: valid formats are {', '.join(FORMATS)} (set --format)")
    if chosen is None and by_suffix is None:
        raise ValueError(
            f"--output {output} names no export format: end it in {' or '.join(FORMATS.values())}, or set --format "
            f"{'|'.join(FORMATS)}"
        )
    if chosen is not None and by_suffix is not None and chosen != by_suffix:
        raise ValueError(f"--format {chosen} but --output {output} ends in {suffix}: give matching ones (or another suffix)")
    return chosen or by_suffix


def verify(load: Callable[..., tuple[Tensor, ...]], eager: nn.Module, samples: list[tuple[Any, ...]], what: str) -> float:
    """The largest difference between the file's answers and the eager module's on ``samples``;
    a ``ValueError`` naming the sample when it exceeds :data:`heads.export.TOLERANCE` or the file
    fails to run on it."""
    worst = 0.0
    for inputs in samples:
        shape = "x".join(str(n) for n in flat_tensors(inputs)[0].shape)
        with torch.no_grad():
            want = flat_tensors(eager(*inputs))
        try:
            got = load(*inputs)
        except Exception as error:  # noqa: BLE001 - a file that fails to run is refused like one that answers wrong
            reason = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__).strip()
            raise ValueError(
                f"the exported {what} fails on a {shape} sample ({type(error).__name__}: {reason[:300]}): nothing written; "
                f"report it with the checkpoint, or try the other --format"
            ) from None
        diff = difference(got, want)
        if not diff <= TOLERANCE:
            raise ValueError(
                f"the exported {what} differs from the eager model by {diff:.3g} > {TOLERANCE:g} on a {shape} sample: "
                f"nothing written; report it with the checkpoint, or try the other --format"
            )
        worst = max(worst, diff)
    return worst


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m app convert export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt_path", required=True, help="checkpoint of a run (python -m app fit)")
    parser.add_argument("--output", required=True, help="where to write the file: NAME.onnx (ONNX) or NAME.pt2 (torch.export)")
    parser.add_argument("--format", default=None, help=f"{' or '.join(FORMATS)}; by default the output's suffix decides")
    parser.add_argument("--part", default="head", help="head: hidden states in (default); network: a language model's token ids and state in")
    parser.add_argument("--method", default="topk", help=f"inference method to export: {' or '.join(METHODS)} (default topk)")
    parser.add_argument("--k", type=int, default=10, help="classes topk returns (default 10)")
    parser.add_argument("--window", type=int, default=1,
                        help="--part network with a recurrent encoder: tokens per call, fixed in the file (default 1: one step); "
                             "a stateless encoder (Transformer) takes 1 to max_length")
    add_config_argument(parser)
    args = parser.parse_args(argv)
    # before the checkpoint is read
    if args.method not in METHODS:
        raise ValueError(f"unknown export method {args.method!r}: valid methods are {', '.join(METHODS)} (set --method)")
    if args.part not in PARTS:
        raise ValueError(f"unknown export part {args.part!r}: valid parts are {', '.join(PARTS)} (set --part)")
    if args.window < 1:
        raise ValueError(f"--window must be >= 1 token, got {args.window} (set --window)")
    fmt = file_format(args.output, args.format)
    if fmt == "onnx":
        check_onnx_exporter()
    if os.path.abspath(args.output) == os.path.abspath(args.ckpt_path):
        raise ValueError(f"--output {args.output} is the input checkpoint: write the program to a new path")
    check_output_file(args.output, "output")  # a directory, or in one that cannot be created or takes no file
    checkpoint = read_checkpoint(args.ckpt_path)
    if not any(str(key).startswith("head.") for key in checkpoint.get("state_dict") or {}):
        raise ValueError(
            f"checkpoint {args.ckpt_path} holds no output head (no head.* weights in its state_dict): "
            f"pass a checkpoint of a run (python -m app fit)"
        )
    model, _ = restore(args.ckpt_path, checkpoint, default_task=DEFAULT_TASK, data=False, config=args.config)
    head = getattr(model, "head", None)
    if not isinstance(head, OutputHead):
        raise ValueError(f"checkpoint {args.ckpt_path} restores {type(model).__name__} without an output head: pass a checkpoint of a run (python -m app fit)")
    model = model.float().eval()
    check_export_arguments(head, args.method, args.k)
    if args.part == "head":
        eager, program, samples, input_names, shapes = export_head_part(head, args.method, args.k)
    else:
        eager, program, samples, input_names, shapes = export_network_part(model, args.ckpt_path, args.method, args.k, args.window)
    names = output_names(args.method) + tuple(f"next_{name}" for name in input_names[1:])
    data = traced(lambda: onnx_model(program, input_names, names), "torch.onnx (dynamo)", args.part) if fmt == "onnx" else pt2_bytes(program)
    load = load_program(data, fmt)
    runner = "onnxruntime" if fmt == "onnx" else "torch.export.load"
    if load is None:  # ONNX without onnxruntime: the traced program is checked, the file itself is not run
        load, runner = load_program(pt2_bytes(program), "pt2"), f"torch.export.load (not run in onnxruntime: {ONNX_EXTRA})"
    worst = verify(load, eager, samples, f"{args.part} {args.method} of {type(head).__name__}")
    write_atomically(args.output, data, "exported file")
    load_hint = f"onnxruntime.InferenceSession({args.output!r})" if fmt == "onnx" else f"torch.export.load({args.output!r}).module()"
    print(f"wrote {args.output}: {type(head).__name__} {args.method}, {shapes}; "
          f"max difference from eager {worst:.2g} in {runner}; load with {load_hint}")
    return 0


def traced(export: Callable[[], Any], exporter: str, part: str) -> Any:
    """``export()``, any failure of the tracer or the translator as one ``ValueError`` line."""
    try:
        return export()
    except ValueError:  # the project's own refusals are one line already
        raise
    except Exception as error:  # noqa: BLE001 - every tracer failure is the same refusal
        reason = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__).strip()
        other = "export the head alone with --part head" if part == "network" else "report it with the checkpoint"
        raise ValueError(f"{exporter} cannot export the {part} ({type(error).__name__}: {reason[:300]}): {other}") from None


def export_head_part(head: OutputHead, method: str, k: int):
    """The head's inference module, its ``torch.export`` program, sample inputs (a batch and one
    context), ONNX input names and the shapes in words."""
    program = traced(lambda: export_head(head, method, k), "torch.export", "head")
    samples = [(example_hidden(head, batch, seed=batch),) for batch in (1, 7)]
    out = f"(N, {head.num_classes})" if method == "log_prob" else f"(log_probs, indices), each (N, {k})"
    return HeadInference(head, method, k), program, samples, ["hidden"], f"hidden (N, {head.in_features}) -> {out}, N free"


def export_network_part(model: nn.Module, ckpt_path: str, method: str, k: int, window: int):
    """:func:`export_head_part` for a language model's network with its head (token ids and state in)."""
    from tasks.language_model import LanguageModel, NextTokenInference, export_network

    if not isinstance(model, LanguageModel):
        raise ValueError(
            f"--part network exports a language model (tasks.LanguageModel), but {ckpt_path} restores "
            f"{type(model).__name__}: export its head alone with --part head"
        )
    eager = NextTokenInference(model, method, k)
    stateless = eager.encoder.max_length is not None
    if stateless and window > eager.encoder.max_length:
        raise ValueError(f"--window {window} exceeds the encoder's max_length {eager.encoder.max_length} (set --window)")
    program = traced(lambda: export_network(model, method, k, window), "torch.export", "network")
    windows = sorted({window, 1, min(max(window, 2), eager.encoder.max_length)}) if stateless else [window]
    samples = [eager.example_inputs(batch, t, seed=batch) for batch in (1, 3) for t in windows]
    state = samples[0][1]
    input_names = ["tokens", *(f"state_{i}" for i in range(len(flat_tensors(state))))]
    time = "T free up to " + str(eager.encoder.max_length) if stateless else f"T = {window}"
    out = f"log_probs (B, T, {model.head.num_classes})" if method == "log_prob" else f"log_probs, indices (B, T, {k})"
    one, three = flat_tensors(samples[0][1]), flat_tensors(samples[-1][1])  # the state of 1 and of 3 streams
    state_shapes = ", ".join("(" + ", ".join("B" if m != n else str(m) for m, n in zip(a.shape, b.shape)) + ")" for a, b in zip(one, three))
    state_words = f" + state_0..{len(one) - 1} {state_shapes}" if one else ""
    return eager, program, samples, input_names, f"tokens (B, T){state_words} -> {out}{' + next state' if state is not None else ''}, B free, {time}, state zeros to start"
