"""``python -m app bench translation``: decoding throughput (sentences/s) of a translation model
per output head, greedy and beam search, and with ``--train-tokens`` the time of one training
step (forward, backward, Adam update) on a batch of that many target tokens.

Every head sits on the same encoder-decoder (same sizes, same random source batch) and every
variant decodes exactly ``--length`` tokens per sentence (EOS is suppressed until the budget),
so all do identical decoder work and differ only in the head. A step is scored as ``translate``
scores it, by the head's ``topk`` for the tokens the search can select (1 for greedy, ``2K`` for a
beam of ``K``: :func:`tasks.decoding.head_candidates`); ``--scoring log_prob`` (or ``both``) also
times the full ``log_prob``, what decoding used before (not for ``codes-mos3``, whose decoder reads
codes and scores a step by visiting code rows through the decoder). Variants are timed
in ONE process, interleaved repeat by repeat after a warm-up, and the median is reported with
its ratio to softmax, so the ratios are measured under the same machine load.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time

import torch

from app.tools.common import interleaved_times
from heads.lightrnn import HybridLightRNNCodes
from heads.registry import COMPARED_FAMILIES, check_heads, list_heads, size_argument, head_factory as registry_head_factory
from datamodules.translation import BOS_ID, EOS_ID
from tasks.code_search import CodeStep
from tasks.decoding import Candidates, beam_search, greedy_search, head_candidates
from tasks.translation import TranslationTask

#: The size a registered head is given, by its size argument: K = 9 mixture components (as
#: configs/translation/iwslt14_de_en_transformer_base_mos.yaml); Mixtape keeps its 4 gates.
SIZES = {"num_components": 9}
#: Seed 002's settings beyond the registered heads: name -> (registered head or class, init arguments).
COMPOSITES = {
    "mos3": ("mos", {"num_components": 3}),
    # seed 002's cheaper MoS: MoS-3 over Hybrid-LightRNN codes, 30% of the words exclusive
    # (configs/heads/hybrid_lightrnn_mos.yaml's share)
    "hybrid-mos3": ("hybrid_lightrnn", {"exclusive_fraction": 0.3, "inner": registry_head_factory("mos", num_components=3)}),
    # the same over code inputs (seed 002 Eq. 4): the decoder reads codes, a step visits code rows
    # through the decoder (tasks/code_search.py); scored by its candidates only (no log_prob)
    "codes-mos3": (HybridLightRNNCodes, {"exclusive_fraction": 0.3, "inner": registry_head_factory("mos", num_components=3)}),
}


def bench_heads() -> list[str]:
    """The names ``--heads`` takes: every registered head, then :data:`COMPOSITES`."""
    return [*list_heads(), *COMPOSITES]


def head_factory(name: str):
    """A registered head (sized by :data:`SIZES`) or a composite, as a factory ``(in_features, num_classes) -> head``."""
    if name in COMPOSITES:
        head, settings = COMPOSITES[name]
        return registry_head_factory(head, **settings)
    size = SIZES.get(size_argument(name))
    return registry_head_factory(name, size=size)


def decode_once(task: TranslationTask, source: torch.Tensor, lengths: torch.Tensor, beam: int, length: int,
                scoring: str = "topk") -> None:
    state = task.network.encode(source, lengths)
    width = (1 if beam == 1 else 2 * beam) + 1  # what translate() asks for, plus EOS which is masked below
    code_step = CodeStep(task.network, task.head, width) if task.code_inputs else None
    if code_step is not None:
        state = CodeStep.initial(state, source.size(0), source.device)

    def step(tokens, state):
        if code_step is not None:  # reads the last word's two codes, visits rows through the decoder
            (values, candidates), state = code_step(tokens, state)
            if tokens.size(1) < length:
                values = values.masked_fill(candidates == EOS_ID, -math.inf)
            return Candidates(values, candidates), state
        hidden, state = task.network.decode_step(tokens, state)
        if scoring == "topk":
            values, candidates = head_candidates(task.head, hidden, width)
            if tokens.size(1) < length:  # same number of steps for every head
                values = values.masked_fill(candidates == EOS_ID, -math.inf)
            return Candidates(values, candidates), state
        log_probs = task.head.log_prob(hidden)
        if tokens.size(1) < length:
            log_probs[:, EOS_ID] = -math.inf
        return log_probs, state

    budget = torch.full((source.size(0),), length)
    if beam == 1:
        greedy_search(step, state, source.size(0), BOS_ID, EOS_ID, budget)
    else:
        beam_search(step, state, source.size(0), BOS_ID, EOS_ID, budget, beam_size=beam)


def training_step(task: TranslationTask, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step on the mean token NLL, as ``TranslationTask.training_step`` takes it."""
    optimizer.zero_grad(set_to_none=True)
    nll = task.token_nll(batch)
    (nll.sum() / batch["target_output"].numel()).backward()
    optimizer.step()


def training_batch(vocab: int, sentences: int, source_length: int, target_length: int) -> dict:
    """Random full-length sentences (no padding): every head sees the same tokens."""
    source = torch.randint(4, vocab, (sentences, source_length))
    source[:, -1] = EOS_ID
    target = torch.randint(4, vocab, (sentences, target_length + 1))
    target[:, 0], target[:, -1] = BOS_ID, EOS_ID
    return {"source": source, "source_lengths": torch.full((sentences,), source_length),
            "target_input": target[:, :-1].contiguous(), "target_output": target[:, 1:].contiguous()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m app bench translation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", default=",".join(list_heads(COMPARED_FAMILIES)),
                        help=f"comma-separated head names ({', '.join(bench_heads())})")
    parser.add_argument("--scoring", default="topk", choices=["topk", "log_prob", "both"],
                        help="score steps by the head's topk (as translate does), by the full log_prob, or time both")
    parser.add_argument("--architecture", default="lstm", choices=["lstm", "transformer"])
    parser.add_argument("--vocab", type=int, default=6000, help="target (and source) vocabulary size")
    parser.add_argument("--hidden", type=int, default=256, help="embedding / hidden / d_model width")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sentences", type=int, default=32)
    parser.add_argument("--source-length", type=int, default=14)
    parser.add_argument("--length", type=int, default=16, help="tokens generated per sentence")
    parser.add_argument("--beams", default="1,5", help="comma-separated beam sizes (1 = greedy)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-tokens", type=int, default=0,
                        help="also time a training step on a batch of this many target tokens (0: decoding only; "
                             "3000 = the Multi30k configs' max_tokens)")
    args = parser.parse_args(argv)
    for key in ("vocab", "hidden", "layers", "sentences", "source_length", "length", "repeats"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.train_tokens < 0:
        parser.error(f"--train-tokens must be >= 0 (0 skips the training step), got {args.train_tokens}")
    torch.manual_seed(0)
    heads = [n for n in args.heads.split(",") if n]
    try:
        check_heads(heads, bench_heads(), "--heads")
    except ValueError as error:
        parser.error(str(error))
    beams = [int(b) for b in args.beams.split(",")]
    scorings = ["topk", "log_prob"] if args.scoring == "both" else [args.scoring]
    tasks, scoring_of = {}, {}
    for head in heads:
        from functools import partial

        from tasks.encoders.seq2seq import LuongAttentionSeq2Seq
        from tasks.encoders.transformer_seq2seq import TransformerSeq2Seq

        network = (partial(TransformerSeq2Seq, d_model=args.hidden, num_heads=4, ffn_dim=4 * args.hidden, num_layers=args.layers)
                   if args.architecture == "transformer" else
                   partial(LuongAttentionSeq2Seq, embed_dim=args.hidden, hidden_size=args.hidden, num_layers=args.layers))
        task = TranslationTask(num_classes=args.vocab, source_vocab_size=args.vocab, head=head_factory(head), network=network).eval()
        for scoring in scorings:
            if task.code_inputs and scoring == "log_prob":
                continue  # a code decoder has no word log_prob from one state
            name = head if len(scorings) == 1 else f"{head} ({scoring})"
            tasks[name], scoring_of[name] = task, scoring
    names = list(tasks)
    source = torch.randint(4, args.vocab, (args.sentences, args.source_length))
    source[:, -1] = EOS_ID
    lengths = torch.full((args.sentences,), args.source_length)
    times: dict[tuple[str, int], list[float]] = {(n, b): [] for n in names for b in beams}
    with torch.inference_mode():
        for name in names:  # warm-up
            decode_once(tasks[name], source[:2], lengths[:2], max(beams), 3, scoring_of[name])
        for _ in range(args.repeats):
            for beam in beams:
                for name in names:
                    start = time.perf_counter()
                    decode_once(tasks[name], source, lengths, beam, args.length, scoring_of[name])
                    times[(name, beam)].append(time.perf_counter() - start)
    print(f"# {args.architecture}, hidden {args.hidden}, {args.layers} layers, V={args.vocab}, {args.sentences} sentences "
          f"x {args.length} tokens, median of {args.repeats}, threads={torch.get_num_threads()}, steps scored by {args.scoring}")
    print("| head | " + " | ".join(f"{'greedy' if b == 1 else f'beam {b}'} sent/s | ratio to {names[0]}" for b in beams) + " |")
    print("|---|" + "---|---|" * len(beams))
    for name in names:
        cells = []
        for beam in beams:
            rate = args.sentences / statistics.median(times[(name, beam)])
            base = args.sentences / statistics.median(times[(names[0], beam)])
            cells += [f"{rate:.1f}", f"{rate / base:.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.train_tokens:
        print_training_times({head: tasks[head if len(scorings) == 1 else f"{head} ({scorings[0]})"] for head in heads}, args)
    return 0


def print_training_times(tasks: dict[str, TranslationTask], args: argparse.Namespace) -> None:
    """Training step per head, interleaved repeat by repeat after one warm-up step (Adam's state)."""
    sentences = max(1, args.train_tokens // args.length)
    batch = training_batch(args.vocab, sentences, args.source_length, args.length)
    optimizers = {}
    for name, task in tasks.items():
        task.train()
        optimizers[name] = torch.optim.Adam(task.parameters(), lr=1e-4)
    steps = {name: functools.partial(training_step, task, batch, optimizers[name]) for name, task in tasks.items()}
    times = interleaved_times(steps, warmup=1, repeats=args.repeats)
    names = list(tasks)
    base = statistics.median(times[names[0]])
    print(f"\n# training step: {sentences} sentences x {args.length} target tokens, forward + backward + Adam, "
          f"median of {args.repeats} interleaved")
    print(f"| head | ms per step | ratio to {names[0]} |")
    print("|---|---|---|")
    for name in names:
        median = statistics.median(times[name])
        print(f"| {name} | {median * 1e3:.0f} | {median / base:.2f} |")
