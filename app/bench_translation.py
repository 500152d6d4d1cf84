"""``python -m app bench translation``: decoding throughput (sentences/s) of a translation model
per output head, greedy and beam search.

Every head sits on the same encoder-decoder (same sizes, same random source batch) and every
variant decodes exactly ``--length`` tokens per sentence (EOS is suppressed until the budget),
so all do identical decoder work and differ only in the head's ``log_prob``. Variants are timed
in ONE process, interleaved repeat by repeat after a warm-up, and the median is reported with
its ratio to softmax, so the ratios are measured under the same machine load.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from datamodules.translation import BOS_ID, EOS_ID
from tasks.decoding import beam_search, greedy_search
from tasks.translation import TranslationTask

HEAD_SETTINGS = {
    "softmax": {},
    "moc": {"class_path": "heads.MixtureOfContexts", "init_args": {"num_components": 9}},
    "mos": {"class_path": "heads.MixtureOfSoftmaxes", "init_args": {"num_components": 9}},
    "mixtape": {"class_path": "heads.Mixtape", "init_args": {"num_gates": 4}},
    "sigsoftmax": {},
}


def head_factory(name: str):
    from heads.registry import head_class

    settings = HEAD_SETTINGS.get(name, {}).get("init_args", {})
    cls = head_class(name)
    return lambda in_features, num_classes: cls(in_features, num_classes, **settings)


def decode_once(task: TranslationTask, source: torch.Tensor, lengths: torch.Tensor, beam: int, length: int) -> None:
    state = task.model.encode(source, lengths)

    def step(tokens, state):
        hidden, state = task.model.decode_step(tokens, state)
        log_probs = task.head.log_prob(hidden)
        if tokens.size(1) < length:
            log_probs[:, EOS_ID] = -math.inf  # same number of steps for every head
        return log_probs, state

    budget = torch.full((source.size(0),), length)
    if beam == 1:
        greedy_search(step, state, source.size(0), BOS_ID, EOS_ID, budget)
    else:
        beam_search(step, state, source.size(0), BOS_ID, EOS_ID, budget, beam_size=beam)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m app bench translation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", default="softmax,mos,mixtape,sigsoftmax,moc", help="comma-separated head names")
    parser.add_argument("--architecture", default="lstm", choices=["lstm", "transformer"])
    parser.add_argument("--vocab", type=int, default=6000, help="target (and source) vocabulary size")
    parser.add_argument("--hidden", type=int, default=256, help="embedding / hidden / d_model width")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sentences", type=int, default=32)
    parser.add_argument("--source-length", type=int, default=14)
    parser.add_argument("--length", type=int, default=16, help="tokens generated per sentence")
    parser.add_argument("--beams", default="1,5", help="comma-separated beam sizes (1 = greedy)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    names = [n for n in args.heads.split(",") if n]
    beams = [int(b) for b in args.beams.split(",")]
    tasks = {}
    for name in names:
        task = TranslationTask(num_classes=args.vocab, source_vocab_size=args.vocab, head=head_factory(name),
                               architecture=args.architecture, embed_dim=args.hidden, hidden_size=args.hidden,
                               num_layers=args.layers, num_heads=4, ffn_dim=4 * args.hidden)
        tasks[name] = task.eval()
    source = torch.randint(4, args.vocab, (args.sentences, args.source_length))
    source[:, -1] = EOS_ID
    lengths = torch.full((args.sentences,), args.source_length)
    times: dict[tuple[str, int], list[float]] = {(n, b): [] for n in names for b in beams}
    with torch.inference_mode():
        for name in names:  # warm-up
            decode_once(tasks[name], source[:2], lengths[:2], max(beams), 3)
        for _ in range(args.repeats):
            for beam in beams:
                for name in names:
                    start = time.perf_counter()
                    decode_once(tasks[name], source, lengths, beam, args.length)
                    times[(name, beam)].append(time.perf_counter() - start)
    print(f"# {args.architecture}, hidden {args.hidden}, {args.layers} layers, V={args.vocab}, {args.sentences} sentences "
          f"x {args.length} tokens, median of {args.repeats}, threads={torch.get_num_threads()}")
    print("| head | " + " | ".join(f"{'greedy' if b == 1 else f'beam {b}'} sent/s | ratio to softmax" for b in beams) + " |")
    print("|---|" + "---|---|" * len(beams))
    for name in names:
        cells = []
        for beam in beams:
            rate = args.sentences / statistics.median(times[(name, beam)])
            base = args.sentences / statistics.median(times[(names[0], beam)])
            cells += [f"{rate:.1f}", f"{rate / base:.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0
