"""What ``python -m app bench train`` measures: the presets (the seeds' model dimensions), the
heads by spec (``mos:15``), one network per head (:class:`Workload`) and its peak memory per
step, in this process or a fresh one, and the largest batch under a memory budget."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from app.tools.common import (
    count_flops, limit_mmap_threshold, lstm_flops, peak_growth_bytes, probe_in_subprocess, reset_peak_rss,
    restore_mmap_threshold, rss_bytes,
)
from heads import DSSoftmax
from heads.base import OutputHead
from heads.ds.build import pruned_head, random_kept_mask
from heads.registry import COMPARED_FAMILIES, check_heads, create_head, head_class, head_entry, list_heads, size_argument


@dataclass
class Preset:
    """Model dimensions of a seed setting and the CPU-scale batch."""

    model: str  # "lstm" (AWD-LSTM language model) or "transformer" (encoder-decoder)
    vocab: int
    embedding: int  # d: the input embedding / class-embedding width
    hidden: int  # inner LSTM width or Transformer feed-forward width
    layers: int
    last_hidden: int  # g: width of the encoder output the head receives
    batch: int  # sequences (LM) or sentence pairs (translation) per step
    length: int  # BPTT window (LM) or target length (translation)
    paper_batch: str


PRESETS = {
    # AWD-LSTM-MoS on PTB (Yang et al. 2018): 280/960/620, 3 layers, batch 12 x BPTT 70.
    "ptb": Preset("lstm", 10_000, 280, 960, 3, 620, 6, 70, "12 x 70"),
    # AWD-LSTM-MoS on WikiText-2: 300/1150/650, 3 layers, batch 15 x 70.
    "wikitext2": Preset("lstm", 33_278, 300, 1150, 3, 650, 4, 70, "15 x 70"),
    # One Billion Word with a 100k vocabulary: a 2-layer LSTM, d = 512 (our CPU-scale choice).
    "1b": Preset("lstm", 100_000, 512, 1024, 2, 1024, 2, 35, "(GPU-scale)"),
    # WMT En-De, Transformer base: d = 512, FFN 2048, 6 + 6 layers, 32k BPE; ~25-token sentences.
    "wmt": Preset("transformer", 32_000, 512, 2048, 6, 512, 8, 25, "~4096 tokens/GPU"),
}



# ---------------------------------------------------------------------------- heads
def train_heads() -> list[str]:
    """The heads ``bench train`` measures: the registry's trainable compared (``bottleneck``, ``clustered``) and ``sparse`` heads."""
    return list_heads((*COMPARED_FAMILIES, "sparse"), trainable=True)


def default_specs() -> list[str]:
    """Every :func:`train_heads` head, written ``name:K`` where it declares a ``bench_size``."""
    return [f"{name}:{head_entry(name).bench_size}" if head_entry(name).bench_size else name for name in train_heads()]


def is_sparse_experts(name: str) -> bool:
    """DS-Softmax is measured in its pruned compact form (:func:`compact_ds`), as after training."""
    return issubclass(head_class(name), DSSoftmax)


def parse_head(spec: str) -> tuple[str, int | None]:
    """``"mos:15"`` -> ``("mos", 15)``; a bare name takes its declared ``bench_size``
    (``"ds_softmax"`` -> ``("ds_softmax", 64)``, ``"softmax"`` -> ``("softmax", None)``)."""
    name, _, number = spec.strip().partition(":")
    check_heads([name], train_heads(), "--heads", hint=" (optionally name:K, e.g. mos:15)")
    if number and (not number.isdigit() or int(number) < 1):
        raise ValueError(f"head {spec!r} needs a positive integer K after ':' (e.g. mos:15)")
    if number and size_argument(name) is None:
        raise ValueError(f"head {spec!r}: {name} takes no K (write {name})")
    return name, int(number) if number else head_entry(name).bench_size


def check_redundancy(redundancy: float, K: int) -> None:
    if not 1.0 <= redundancy <= K:
        raise ValueError(f"bench train needs 1 <= ds redundancy <= K={K}, got {redundancy} (set --ds-redundancy)")


def compact_ds(g: int, V: int, K: int, redundancy: float, seed: int) -> DSSoftmax:
    """A pruned DS-Softmax built directly in its compact form (no dense ``K x V x g`` tensor)."""
    check_redundancy(redundancy, K)
    generator = torch.Generator().manual_seed(seed)
    keep = random_kept_mask(K, V, redundancy, generator)
    gate = torch.randn(K, g, generator=generator) * 0.02
    return pruned_head(keep, gate, rows=torch.randn(int(keep.sum()), g, generator=generator) * 0.02)


def make_head(spec: str, g: int, V: int, d: int, redundancy: float = 1.5, seed: int = 0) -> OutputHead:
    """The head for ``spec`` on encoder output width ``g``, class-embedding width ``d``."""
    name, K = parse_head(spec)
    if is_sparse_experts(name):
        return compact_ds(g, V, K, redundancy, seed)
    return create_head(name, g, V, size=K, embedding_dim=d)  # K unset: the head's own default (Mixtape 4)


# ---------------------------------------------------------------------------- workloads
def zipf_ids(shape: tuple[int, ...], V: int, generator: torch.Generator) -> Tensor:
    """Class ids with a Zipf distribution (frequent ids frequent, as Mixtape's gate sharing expects)."""
    ranks = torch.arange(1, V + 1, dtype=torch.float64)
    return torch.multinomial(1.0 / ranks, math.prod(shape), replacement=True, generator=generator).view(shape)


class Workload:
    """One head's network, optimizer and batch: ``output_step`` and ``whole_step`` closures."""

    def __init__(self, spec: str, preset: Preset, batch: int, redundancy: float, seed: int = 0, whole: bool = True, output: bool = True) -> None:
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        p, V, B, T = preset, preset.vocab, batch, preset.length
        self.spec, self.batch, self.tokens = spec, B, B * T
        self.target = zipf_ids((B, T), V, generator)  # (B, T)
        self.lstm_layers: list[nn.LSTM] = []
        self.model: nn.Module | None = None
        if whole:
            if p.model == "lstm":
                self._build_lm(spec, p, redundancy, seed)
                self.inputs = zipf_ids((B, T), V, generator)  # (B, T)
            else:
                self._build_seq2seq(spec, p, redundancy, seed)
                self.source = zipf_ids((B, T), V, generator).clamp_min(4)  # (B, S), above the specials
                self.source_lengths = torch.full((B,), T)
                self.target_input = zipf_ids((B, T), V, generator).clamp_min(4)  # (B, T)
        if output:
            # A separate (untied) head on random encoder outputs: the output layer alone.
            self.head = make_head(spec, p.last_hidden, V, p.embedding, redundancy, seed).train()
            self.hidden = torch.randn(B, T, p.last_hidden, requires_grad=True)  # (B, T, g)
            self.head_optimizer = torch.optim.SGD(self.head.parameters(), lr=1e-3)

    def _build_lm(self, spec: str, p: Preset, redundancy: float, seed: int) -> None:
        from tasks.encoders import AWDLSTMEncoder
        from tasks.language_model import LanguageModel

        model = LanguageModel(
            num_classes=p.vocab, head=lambda g, V: make_head(spec, g, V, p.embedding, redundancy, seed),
            encoder=functools.partial(AWDLSTMEncoder, embedding_dim=p.embedding, hidden_size=p.hidden, num_layers=p.layers,
                                      last_hidden_size=p.last_hidden),
            tie_weights=False,
        )
        if model.head.output_embedding_dim == p.embedding:
            model.head.tie_to(model.encoder.embedding)  # AWD-LSTM ties the class embeddings
        self.model = model.train()
        self.lstm_layers = list(model.encoder.layers)
        # AWD-LSTM trains with SGD (then averaged SGD).
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def _build_seq2seq(self, spec: str, p: Preset, redundancy: float, seed: int) -> None:
        from tasks.encoders import TransformerSeq2Seq

        network = TransformerSeq2Seq(p.vocab, p.vocab, p.embedding, 8, p.hidden, p.layers, dropout=0.1)
        head = make_head(spec, p.embedding, p.vocab, p.embedding, redundancy, seed)
        if head.output_embedding_dim == p.embedding:
            head.tie_to(network.target_embedding)
        self.model = nn.ModuleDict({"network": network, "head": head}).train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)  # Vaswani et al.: Adam

    def whole_loss(self) -> Tensor:
        if self.lstm_layers:
            hidden, _, _ = self.model.encode(self.inputs)  # (B, T, g)
            return self.model.head(hidden, self.target).mean()
        network, head = self.model["network"], self.model["head"]
        state = network.encode(self.source, self.source_lengths)
        return head(network.decode(self.target_input, state), self.target).mean()

    def whole_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.whole_loss().backward()
        self.optimizer.step()

    def output_step(self) -> None:
        self.head_optimizer.zero_grad(set_to_none=True)
        self.hidden.grad = None
        self.head(self.hidden, self.target).mean().backward()
        self.head_optimizer.step()

    def whole_flops(self) -> int:
        uncounted = sum(lstm_flops(layer, self.tokens) for layer in self.lstm_layers)
        return count_flops(self.whole_step) + uncounted

    def static_bytes(self) -> int:
        """Parameters and optimizer state (momentum / Adam moments), counted exactly."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        for state in self.optimizer.state.values():
            tensors += [t for t in state.values() if isinstance(t, Tensor)]
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def whole_peak_bytes(spec: str, preset: Preset, batch: int, redundancy: float) -> int:
    """Peak memory of one whole-network step at ``batch``: counted state + measured step peak.

    Every allocation is its own mapping during the probe (:func:`limit_mmap_threshold`), so freed
    memory leaves the process and the RSS high-water mark is the step's true peak; the allocator
    is put back for timing afterwards.
    """
    limit_mmap_threshold()
    try:
        work = Workload(spec, preset, batch, redundancy, output=False)
        work.whole_step()  # warm-up: optimizer state, thread pools, kernels' scratch
        work.optimizer.zero_grad(set_to_none=True)
        reset_peak_rss()
        before = rss_bytes()
        work.whole_step()
        step_peak = peak_growth_bytes(before)
        return work.static_bytes() + step_peak
    finally:
        restore_mmap_threshold()


def isolated_peak_bytes(spec: str, preset: Preset, batch: int, redundancy: float, threads: int = 1) -> int:
    """:func:`whole_peak_bytes` in a fresh interpreter.

    In one long-lived process the heap pages earlier probes and timings left behind (with huge
    pages, not always returnable) make later probes under-count, unequally across heads (see
    docs/benchmarks.md). A fresh process per probe measures every head from the same
    clean state.
    """
    args = ["--memory-probe", spec, "--probe-batch", str(batch), "--probe-preset", json.dumps(asdict(preset)),
            "--ds-redundancy", str(redundancy)]
    try:
        return int(probe_in_subprocess("app.bench.train", args, threads)["peak_bytes"])
    except RuntimeError as error:
        raise RuntimeError(f"memory probe of {spec} at batch {batch} failed: {error}") from None


def largest_batch(spec: str, preset: Preset, budget: int, redundancy: float, max_batch: int, probe: Callable = whole_peak_bytes, max_probes: int = 6) -> tuple[int, int]:
    """The largest batch whose whole-network step fits ``budget`` bytes, and its measured peak.

    Two probes fit ``peak(B) = a + b B`` and the solved batch is probed; while the largest
    fitting batch ``lo`` and the smallest failing one ``hi`` are more than one apart, the next
    probe interpolates between them (regula falsi), at most ``max_probes`` probes after the
    first two. Returns ``(0, peak at batch 1)`` if not even one instance fits.
    """
    points = {1: probe(spec, preset, 1, redundancy)}
    if max_batch >= 2:
        points[2] = probe(spec, preset, 2, redundancy)
    slope = max(points.get(2, points[1] * 2) - points[1], 1)
    batch = max(1, min(max_batch, int((budget - (points[1] - slope)) // slope)))
    for _ in range(max_probes):
        if batch not in points:
            points[batch] = probe(spec, preset, batch, redundancy)
        lo = max((b for b, m in points.items() if m <= budget), default=0)
        hi = min((b for b, m in points.items() if m > budget), default=None)
        if hi is None or hi - lo <= 1:
            break
        m_lo = points[lo] if lo else points[1] - slope
        batch = lo + int((budget - m_lo) * (hi - lo) / (points[hi] - m_lo))
        batch = min(max(batch, lo + 1), hi - 1)
    lo = max((b for b, m in points.items() if m <= budget), default=0)
    return lo, points[lo] if lo else points[1]
