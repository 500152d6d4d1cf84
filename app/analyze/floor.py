"""``python -m app analyze floor``: the best perplexity a width-``d`` softmax can reach on the synthetic language.

The synthetic language's true next-token distribution ``P_i`` after each test context ``i`` is
known exactly (forward algorithm, :meth:`datamodules.lm_synthetic.SyntheticLanguage.log_prob_matrix`).
A softmax head whose class embeddings are ``d`` wide outputs ``q_i = softmax(c_i E^T + b)`` for
*some* context vector ``c_i``, whatever the encoder computes: its log-probability rows have rank
at most ``d + 1`` (the softmax bottleneck, Yang et al. 2018 §2.1). This tool fits the context
vectors ``c_i`` (one free vector per context, i.e. a perfect encoder), the class embeddings ``E``
and the bias ``b`` to minimise the mean cross-entropy ``-sum_x P_i(x) log q_i(x)`` over ``T`` test
contexts, and reports, per width,

    floor = exp(mean cross-entropy of the fit - mean true entropy)

the ratio ``ppl / true ppl`` below which no softmax (and no Mixture of Contexts, which is a
softmax over one mixed context) of that width can go on those contexts. The fit is numerical
(Adam, float64, several restarts): it can only overestimate the optimum cross-entropy, so the
printed floor is an upper estimate; the table also prints the floor after half the iterations
so convergence can be judged. MoS, Mixtape and SigSoftmax are not bound by it: a trained model
of width ``d`` whose test ``ppl / true ppl`` is below the floor has broken the bottleneck.

Usage::

    python -m app analyze floor --config configs/lm/synthetic.yaml --widths 8 16 32
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import torch
from torch import Tensor

from app.checkpoint_io.policy import read_config_files
from app.tools.common import check_report_files
from datamodules.lm_synthetic import SyntheticLM
from datamodules.files import write_atomically


def true_distributions(data: SyntheticLM, contexts: int, seed: int = 0) -> Tensor:
    """``(T, W + 1)`` exact next-token log-probabilities (words, then ``<eos>``) after ``T`` test word positions."""
    language, stream = data.language, data.generated("test")
    words = np.flatnonzero(stream[:-1] != language.eos)  # positions whose next token is scored from a word
    if words.size == 0:
        raise ValueError("the synthetic test split has no word positions (raise data.init_args.test_tokens)")
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(words, size=min(contexts, words.size), replace=False))
    log_words = torch.from_numpy(language.log_prob_matrix(stream, chosen))  # (T, W), sums to 1 - q
    log_end = torch.full((log_words.shape[0], 1), math.log(language.end_prob), dtype=torch.float64)
    return torch.cat([log_words, log_end], 1)  # (T, W + 1)


def fit_softmax(log_p: Tensor, width: int, iterations: int, restarts: int = 2, seed: int = 0) -> tuple[float, float]:
    """Best mean cross-entropy of a width-``width`` softmax to the rows of ``log_p``, after
    ``iterations // 2`` and after ``iterations`` Adam steps (best over ``restarts`` initialisations)."""
    p = log_p.exp()
    T, V = log_p.shape
    best_half = best = math.inf
    for restart in range(restarts):
        generator = torch.Generator().manual_seed(seed + restart)
        contexts = (torch.randn(T, width, generator=generator, dtype=torch.float64) * 0.1).requires_grad_()
        embeddings = (torch.randn(V, width, generator=generator, dtype=torch.float64) * 0.1).requires_grad_()
        bias = log_p.mean(0).clone().requires_grad_()  # start at the mean log-distribution
        optimizer = torch.optim.Adam([contexts, embeddings, bias], lr=0.05)
        for step in range(1, iterations + 1):
            log_q = torch.log_softmax(contexts @ embeddings.t() + bias, dim=1)  # (T, V)
            cross_entropy = -(p * log_q).sum(1).mean()
            optimizer.zero_grad()
            cross_entropy.backward()
            optimizer.step()
            if step == iterations // 2:
                best_half = min(best_half, float(cross_entropy.detach()))
        with torch.no_grad():
            final = float(-(p * torch.log_softmax(contexts @ embeddings.t() + bias, dim=1)).sum(1).mean())
        best = min(best, final)
    return best_half, best


def load_data(config: str) -> SyntheticLM:
    data = read_config_files([config]).get("data") or {}
    if not str(data.get("class_path", "")).endswith("SyntheticLM"):
        raise ValueError(
            f"analyze floor needs a config whose data is datamodules.SyntheticLM (the only language whose true "
            f"distribution is known), got {data.get('class_path')!r} in {config}"
        )
    return SyntheticLM(**(data.get("init_args") or {}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app analyze floor", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/lm/synthetic.yaml", help="task config with a SyntheticLM data section")
    parser.add_argument("--widths", type=int, nargs="+", default=[8, 16, 32], help="class-embedding widths d")
    parser.add_argument("--contexts", type=int, default=2000, help="T, test contexts in the fit")
    parser.add_argument("--iterations", type=int, default=3000, help="Adam steps per restart")
    parser.add_argument("--restarts", type=int, default=2, help="random initialisations per width (best kept)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file (atomically)")
    args = parser.parse_args(argv)
    check_report_files(args)  # before anything is measured
    for key in ("contexts", "iterations", "restarts"):
        if getattr(args, key) < 1:
            raise ValueError(f"analyze floor needs --{key} >= 1, got {getattr(args, key)}")
    if any(w < 1 for w in args.widths):
        raise ValueError(f"analyze floor needs every --widths value >= 1, got {args.widths}")
    data = load_data(args.config)
    log_p = true_distributions(data, args.contexts)
    entropy = float(-(log_p.exp() * log_p).sum(1).mean())
    print(f"{args.config}: {log_p.shape[0]} test contexts, {log_p.shape[1]} classes, "
          f"true perplexity on them {math.exp(entropy):.2f}")
    print("| width d | best softmax ppl / true ppl | after half the iterations |")
    print("|---:|---:|---:|")
    rows = []
    for width in args.widths:
        half, best = fit_softmax(log_p, width, args.iterations, args.restarts)
        rows.append({"width": width, "floor": math.exp(best - entropy), "floor_half": math.exp(half - entropy)})
        print(f"| {width} | {rows[-1]['floor']:.3f} | {rows[-1]['floor_half']:.3f} |", flush=True)
    if args.json:
        write_atomically(args.json, json.dumps({"true_entropy": entropy, "contexts": log_p.shape[0], "rows": rows}, indent=2))
    return 0
