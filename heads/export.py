"""A head's inference path as a :func:`torch.export` program: ``log_prob`` or ``topk`` over a batch
of hidden states whose size is left free.

    program = heads.export.export_head(head, method="topk", k=10)
    torch.export.save(program, "head.pt2")
    log_probs, indices = torch.export.load("head.pt2").module()(hidden)  # hidden (N, in_features)

The program goes on to ONNX through torch's dynamo-based exporter (:func:`onnx_model`, needs the
``export`` extra) and both files are run back against the eager module (:func:`load_program`,
:func:`difference`) before anything is written (``python -m app convert export``).

Every registered head exports both methods (tests/test_export.py). Heads whose eager path relies
on caches or on sizes read from the data (DS-Softmax's sparse ``topk``, Hybrid-LightRNN's early
stop) trace a formulation without them when :func:`torch.compiler.is_compiling` says a tracer is
running; the exported program answers what the eager head answers.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from heads.base import OutputHead

#: The inference methods a head exports.
METHODS = ("log_prob", "topk")

#: The file formats an exported program is written in, with the suffix that chooses each.
FORMATS = {"onnx": ".onnx", "pt2": ".pt2"}

#: The largest absolute difference from the eager module an exported file may answer with.
TOLERANCE = 1e-5

#: What to install for ONNX export and its check in onnxruntime.
ONNX_EXTRA = "pip install 'headbench[export]' (onnx, onnxruntime, onnxscript)"


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


def output_names(method: str) -> tuple[str, ...]:
    """Names of a method's outputs in an ONNX file, in the order the program returns them."""
    return ("log_probs",) if method == "log_prob" else ("log_probs", "indices")


def check_onnx_exporter() -> None:
    """One ``ValueError`` naming the package to install when torch's ONNX exporter lacks one."""
    try:
        import onnx  # noqa: F401  (the exporter's own dependencies)
        import onnxscript  # noqa: F401
    except ImportError as error:
        raise ValueError(f"ONNX export needs the {error.name} package: {ONNX_EXTRA}, or write --format pt2") from None


def onnx_model(program: torch.export.ExportedProgram, input_names: Sequence[str], output_names: Sequence[str]) -> bytes:
    """The ONNX model (serialised ``ModelProto``) of an exported program, translated by torch's
    dynamo-based exporter (``torch.onnx.export(program, dynamo=True)``): the graph, dynamic sizes
    and weights ``torch.export`` traced, nothing traced again. The TorchScript-based exporter is
    never used: it traces the eager path with Python-side sizes frozen (DS-Softmax's routing
    counts), which answers silently wrong for another batch.

    ONNX files hold at most 2 GB (a protobuf limit): a larger program is one ``ValueError``.
    """
    check_onnx_exporter()
    size = sum(t.numel() * t.element_size() for t in (*program.parameters(), *program.buffers()))
    if size >= 2**31:
        raise ValueError(f"the program holds {size / 2**30:.1f} GiB of weights, over ONNX's 2 GiB file limit: write --format pt2")
    with quiet_onnx_exporter_notes():
        onnx_program = torch.onnx.export(
            program, dynamo=True, input_names=list(input_names), output_names=list(output_names), verbose=False
        )
    return onnx_program.model_proto.SerializeToString()


#: Log records of the ONNX exporter's libraries that are notes on its own translation, by logger
#: and the start of the message: an attribute torch's translation builds from an empty list (the
#: IR types it as integers, the type ONNX expects there), and an optimisation the optimizer
#: passes up (a constant ``Split`` is computed at run time instead of folded). Neither is
#: something a user can change, nor a sign the file is wrong: every written file is run against
#: the eager model (onnxruntime) before it is kept.
ONNX_EXPORTER_NOTES = {
    "onnx_ir._convenience": ("Attribute type is ambiguous because it is an empty sequence.",),
    "onnxscript.optimizer._constant_folding": ("Skipping constant folding for op ",),
}


class _DropExporterNotes(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


@contextlib.contextmanager
def quiet_onnx_exporter_notes() -> Iterator[None]:
    """Drop :data:`ONNX_EXPORTER_NOTES` while the exporter runs (a filter on the logger that emits
    each, removed afterwards); anything else the exporter logs or warns is shown."""
    added = [(logging.getLogger(name), _DropExporterNotes(starts)) for name, starts in ONNX_EXPORTER_NOTES.items()]
    for logger, note_filter in added:
        logger.addFilter(note_filter)
    try:
        yield
    finally:
        for logger, note_filter in added:
            logger.removeFilter(note_filter)


def pt2_bytes(program: torch.export.ExportedProgram) -> bytes:
    """The program as ``torch.export.save`` writes it (a ``.pt2`` file)."""
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def load_program(data: bytes, file_format: str) -> Callable[..., tuple[Tensor, ...]] | None:
    """The written file as a user loads it, called with the program's flat inputs and returning its
    flat outputs: ``torch.export.load(...).module()`` for ``pt2``, an onnxruntime ``InferenceSession`` for
    ``onnx`` (``None`` when onnxruntime is not installed)."""
    if file_format == "pt2":
        module = torch.export.load(io.BytesIO(data)).module()

        def run_pt2(*inputs: Tensor) -> tuple[Tensor, ...]:
            with torch.no_grad():
                outputs = module(*inputs)
            return flat_tensors(outputs)

        return run_pt2
    try:
        import onnxruntime
    except ImportError:
        return None
    runner = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    names = [node.name for node in runner.get_inputs()]

    def run_onnx(*inputs: Tensor) -> tuple[Tensor, ...]:
        flat = flat_tensors(inputs)
        return tuple(torch.from_numpy(out) for out in runner.run(None, {n: t.numpy() for n, t in zip(names, flat)}))

    return run_onnx


def flat_tensors(value: object) -> tuple[Tensor, ...]:
    """The tensors of nested tuples and lists in order, ``None`` left out: how an ONNX file lists
    a program's inputs and outputs (a recurrent state's ``(h, c)`` per layer)."""
    if isinstance(value, Tensor):
        return (value,)
    if isinstance(value, (tuple, list)):
        return tuple(t for item in value for t in flat_tensors(item))
    assert value is None, type(value)
    return ()


def difference(got: Sequence[Tensor], want: Sequence[Tensor]) -> float:
    """The largest absolute difference between two answers, output by output: ``inf`` for a
    different shape, number of outputs, ``±inf``/NaN pattern or integer (class id) output, else the
    largest difference of the finite floating-point values."""
    if len(got) != len(want):
        return math.inf
    worst = 0.0
    for a, b in zip(got, want):
        a = a.to(b.device)
        if a.shape != b.shape:
            return math.inf
        if not b.is_floating_point():
            if not torch.equal(a.to(b.dtype), b):
                return math.inf
            continue
        a = a.to(b.dtype)
        finite = b.isfinite()
        if not torch.equal(finite, a.isfinite()) or not torch.equal(a[~finite].nan_to_num(), b[~finite].nan_to_num()):
            return math.inf
        if finite.any():
            worst = max(worst, float((a[finite] - b[finite]).abs().max()))
    return worst
