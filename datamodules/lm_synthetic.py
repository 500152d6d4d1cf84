"""A generated language whose true next-token distribution is high-rank (the embedded default).

Generative story (the one Yang et al., 2018, "Breaking the Softmax Bottleneck", Sec. 2-3,
use to argue that natural language is high-rank): a sentence is generated word by word
while a latent *topic* ``z_t`` in ``{1..K}`` drifts along a Markov chain,

    z_1 ~ Uniform(K),        z_t = z_{t-1} with prob. rho, else ~ Uniform(K)   (t > 1)
    after every word (not before the first): end the sentence with prob. q = 1/mean_length
    otherwise  x_t ~ p_z(. | x_{t-1}) = softmax_w( (a[x_{t-1}] R_z + b_z) . e_w / tau + u_w )

with a previous-word vector ``a`` (sentence start uses the vector of ``<eos>``), a random
rotation ``R_z`` and offset ``b_z`` per topic, output word vectors ``e`` (all of size
``generator_dim`` = d) and a Zipfian unigram log-prior ``u_w = -s log(w + 1)`` so word
frequencies follow Zipf's law (frequency order matters for Mixtape and DS-Softmax).

Why it is high-rank: a learner sees words, not topics, so the best possible prediction is
the *filtered mixture* ``P(x_t | x_<t) = (1 - q) sum_z P(z_t | x_<t) p_z(x_t | x_{t-1})``
(plus ``q`` on ``<eos>``). Each component ``log p_z`` is a rank-(d+1) bilinear form, but the
log of a mixture is not: stacked over many histories the log-probability matrix has rank
far above d + 1 (it is a Mixture of Softmaxes, Eq. 6 of the MoS paper, with the topic
posterior as the mixture weights). The rotations make the K components read the previous
word differently (with only an additive ``b_z`` the mixture stays close to rank d + 1),
and the posterior never collapses because the topic re-draws with probability ``1 - rho``
at every step. A softmax head whose hidden size is below that rank cannot represent the
matrix whatever the encoder does. :meth:`SyntheticLanguage.log_prob_matrix` exposes it for
rank analyses and the tests check its numerical rank.

True entropy: ``P(z_t | x_<t)`` is computed exactly with the HMM forward algorithm (reset at
each sentence start, since sentences are independent), so ``true_entropy`` is the exact mean
of ``-log P(x_t | x_<t)`` over the test *targets* (every test token but the first, matching
what :class:`TBPTTStream` scores). ``exp(true_entropy)`` is the best perplexity any model can
reach; runs report ``ppl / true_ppl``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from datamodules.lm import SPECIALS, LanguageModelingDataModule, check_positive
from datamodules.vocab import Vocabulary

SPLIT_INDEX = {"train": 1, "valid": 2, "test": 3}


def _logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    peak = x.max(axis=axis, keepdims=True)
    return np.squeeze(peak, axis) + np.log(np.exp(x - peak).sum(axis=axis))


class SyntheticLanguage:
    """The generator of :class:`SyntheticLM` in generator ids: words ``0..W-1``, ``<eos>`` = W.

    Args:
        num_words: W, number of words (the vocabulary adds ``<unk>`` and ``<eos>``).
        num_topics: K, latent topics = mixture components of the true distribution.
        generator_dim: d, size of the word/topic vectors (rank of each component).
        topic_persistence: rho, probability that the topic stays the same at the next word.
        temperature: tau, divides the bilinear logits (lower = peakier components).
        zipf_exponent: s of the unigram log-prior ``-s log(rank)``.
        mean_sentence_length: expected words per sentence (1 / end probability).
        seed: seed of the parameters.
    """

    def __init__(
        self,
        num_words: int,
        num_topics: int,
        generator_dim: int,
        topic_persistence: float,
        temperature: float,
        zipf_exponent: float,
        mean_sentence_length: float,
        seed: int,
    ) -> None:
        self.W, self.K, self.d = num_words, num_topics, generator_dim
        self.eos = num_words
        self.rho, self.tau = topic_persistence, temperature
        self.end_prob = 1.0 / mean_sentence_length
        rng = np.random.default_rng([seed, 0])
        self.prev_vectors = rng.standard_normal((num_words + 1, generator_dim))  # a: (W+1, d), row W = <eos>
        self.topic_vectors = rng.standard_normal((num_topics, generator_dim))  # b: (K, d)
        # A random rotation per topic, so topics differ in how the previous word is read,
        # not only by an additive shift: each component is a different bilinear form.
        gaussian = rng.standard_normal((num_topics, generator_dim, generator_dim))
        self.topic_rotations = np.linalg.qr(gaussian)[0]  # R: (K, d, d)
        # Every (previous word, topic) context vector, tabulated once: (W+1, K, d).
        self.contexts = np.einsum("pd,kde->pke", self.prev_vectors, self.topic_rotations) + self.topic_vectors
        # e scaled by 1/sqrt(d) so a logit's spread does not grow with d.
        self.word_vectors = rng.standard_normal((num_words, generator_dim)) / math.sqrt(generator_dim)  # (W, d)
        self.unigram = -zipf_exponent * np.log(np.arange(1, num_words + 1))  # u: (W,)
        # log Z[prev, z] of every component, so a single word's log-prob costs O(d).
        self.log_normaliser = np.stack(
            [_logsumexp(self._logits(np.arange(num_words + 1), np.full(num_words + 1, z)), axis=1) for z in range(num_topics)],
            axis=1,
        )  # (W+1, K)
        # Sampling copies with 1/tau folded in (see _cdf_rows).
        self.contexts32 = (self.contexts / self.tau).astype(np.float32)
        self.word_vectors32 = self.word_vectors.astype(np.float32)
        self.unigram32 = self.unigram.astype(np.float32)
        self.log_normaliser32 = self.log_normaliser.astype(np.float32)

    def _logits(self, prev: np.ndarray, topic: np.ndarray) -> np.ndarray:
        """Unnormalised component logits for (prev, topic) pairs. Shape: (N,), (N,) -> (N, W)."""
        context = self.contexts[prev, topic]  # a[prev] R_z + b_z: (N, d)
        return context @ self.word_vectors.T / self.tau + self.unigram

    def _component_log_prob(self, prev: np.ndarray, word: np.ndarray) -> np.ndarray:
        """log p_z(word | prev) for every topic z. Shape: (N,), (N,) -> (N, K)."""
        e = self.word_vectors[word]  # (N, d)
        bilinear = np.einsum("nkd,nd->nk", self.contexts[prev], e)  # (N, K)
        return bilinear / self.tau + self.unigram[word][:, None] - self.log_normaliser[prev]

    def _drift(self, log_posterior: np.ndarray) -> np.ndarray:
        """One step of the topic chain in log space: P(z') = rho P(z) + (1 - rho) / K."""
        if self.rho >= 1.0:
            return log_posterior
        if self.rho <= 0.0:
            return np.full_like(log_posterior, -math.log(self.K))
        return np.logaddexp(log_posterior + math.log(self.rho), math.log((1.0 - self.rho) / self.K))

    # ------------------------------------------------------------------ sampling
    #: Largest (W+1) * K * W for which the CDF of every component is tabulated (64 MB float32).
    MAX_TABLE_ENTRIES = 1 << 24

    def _cdf_table(self) -> np.ndarray | None:
        """Normalised CDF of every component p_z(. | prev), rows ``prev * K + z``: ((W+1)K, W).

        With the table, drawing a word is a binary search (O(log W)) instead of building a
        W-wide distribution per token; for very large vocabularies it is skipped.
        """
        if not hasattr(self, "_cdf"):
            self._cdf = None
            if (self.W + 1) * self.K * self.W <= self.MAX_TABLE_ENTRIES:
                self._cdf = self._cdf_rows(np.repeat(np.arange(self.W + 1), self.K), np.tile(np.arange(self.K), self.W + 1))
        return self._cdf

    def _cdf_rows(self, prev: np.ndarray, topic: np.ndarray) -> np.ndarray:
        """Normalised float32 CDFs of p_z(. | prev). Shape: (N,), (N,) -> (N, W).

        float32 halves the memory traffic; the sampling error (~1e-7 per probability) is far
        below anything measured, and the entropy uses the exact float64 path anyway.
        """
        logits = self.contexts32[prev, topic] @ self.word_vectors32.T  # (N, W)
        logits += self.unigram32 - self.log_normaliser32[prev, topic][:, None]
        cdf = np.cumsum(np.exp(logits, out=logits), axis=1)
        cdf /= cdf[:, -1:]
        return cdf

    def _draw_words(self, prev: np.ndarray, topic: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One word per (prev, topic) by inverse-CDF sampling with a vectorised binary search."""
        table = self._cdf_table()
        if table is None:
            table, rows = self._cdf_rows(prev, topic), np.arange(prev.size)
        else:
            rows = prev * self.K + topic
        draw = rng.random(prev.size, dtype=np.float32)
        low, high = np.zeros(prev.size, dtype=np.int64), np.full(prev.size, self.W - 1)
        while True:  # invariant: the first index with cdf >= draw lies in [low, high]
            searching = low < high
            if not searching.any():
                return low
            middle = (low + high) // 2
            right = table[rows, middle] < draw
            low = np.where(searching & right, middle + 1, low)
            high = np.where(searching & ~right, middle, high)

    def sample_sentences(self, num_sentences: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Independent sentences generated in parallel, each its words then ``<eos>``.

        Returns the concatenated stream ``(L,)`` and the sentence lengths ``(S,)``.
        """
        sentence_ids, tokens = [], []  # per step: which sentences emitted which token
        active = np.arange(num_sentences)
        prev = np.full(num_sentences, self.eos)
        topic = rng.integers(0, self.K, num_sentences)
        position = 0
        while active.size:
            if position > 0:
                # Topic drift (Markov chain), then the end-of-sentence coin.
                redraw = rng.random(active.size) >= self.rho
                topic[redraw] = rng.integers(0, self.K, int(redraw.sum()))
                ended = rng.random(active.size) < self.end_prob
                sentence_ids.append(active[ended])
                tokens.append(np.full(int(ended.sum()), self.eos))
                active, prev, topic = active[~ended], prev[~ended], topic[~ended]
                if not active.size:
                    break
            prev = self._draw_words(prev, topic, rng)
            sentence_ids.append(active)
            tokens.append(prev)
            position += 1
        ids = np.concatenate(sentence_ids)
        # A stable sort by sentence keeps each sentence's tokens in emission order.
        order = np.argsort(ids, kind="stable")
        return np.concatenate(tokens)[order], np.bincount(ids, minlength=num_sentences)

    def sample(self, num_tokens: int, rng: np.random.Generator) -> np.ndarray:
        """Whole sentences until at least ``num_tokens`` tokens (``<eos>`` included)."""
        per_sentence = 1.0 / self.end_prob + 1.0
        chunks: list[np.ndarray] = []
        total = 0
        while total < num_tokens:
            need = max(16, int(1.1 * (num_tokens - total) / per_sentence) + 1)
            stream, lengths = self.sample_sentences(need, rng)
            # Keep whole sentences up to the first one that reaches the budget.
            ends = np.cumsum(lengths)
            enough = np.flatnonzero(total + ends >= num_tokens)
            stop = int(ends[enough[0]]) if enough.size else stream.size
            chunks.append(stream[:stop])
            total += stop
        return np.concatenate(chunks)

    # ------------------------------------------------------------------ true distribution
    def _sentences_matrix(self, stream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Pad a stream of whole sentences into (S, T) with -1; also return the lengths."""
        ends = np.flatnonzero(stream == self.eos)
        if ends.size == 0 or ends[-1] != stream.size - 1:
            raise ValueError("a synthetic stream must end with <eos> (whole sentences only)")
        starts = np.concatenate([[0], ends[:-1] + 1])
        lengths = ends - starts + 1
        padded = np.full((lengths.size, int(lengths.max())), -1, dtype=np.int64)
        column = np.arange(stream.size) - np.repeat(starts, lengths)
        padded[np.repeat(np.arange(lengths.size), lengths), column] = stream
        return padded, lengths

    def token_log_probs(self, stream: np.ndarray) -> np.ndarray:
        """Exact ``log P(x_t | x_<t)`` of every token of a stream (forward algorithm).

        Shape: ``(L,)`` generator ids -> ``(L,)`` float64.
        """
        padded, lengths = self._sentences_matrix(stream)  # (S, T)
        S, T = padded.shape
        out = np.zeros((S, T))
        log_prior = np.full((S, self.K), -math.log(self.K))  # log P(z_1) (S, K)
        for t in range(T):
            rows = np.flatnonzero(lengths > t)
            token = padded[rows, t]
            if t > 0:
                is_end = token == self.eos
                out[rows[is_end], t] = math.log(self.end_prob)
                rows, token = rows[~is_end], token[~is_end]
                if not rows.size:
                    continue
            prev = padded[rows, t - 1] if t > 0 else np.full(rows.size, self.eos)
            joint = log_prior[rows] + self._component_log_prob(prev, token)  # log P(z_t, x_t | x_<t) (N, K)
            evidence = _logsumexp(joint, axis=1)  # (N,)
            out[rows, t] = evidence + (math.log1p(-self.end_prob) if t > 0 else 0.0)
            posterior = joint - evidence[:, None]  # log P(z_t | x_<=t) (N, K)
            log_prior[rows] = self._drift(posterior)
        return out[padded >= 0]

    def log_prob_matrix(self, stream: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Full true next-token log-distribution after each of ``positions`` (word positions).

        Row i is ``log P(x_{p+1} = w | x_<=p)`` over words w (``<eos>`` excluded) for p =
        positions[i]; requires ``stream[p]`` to be a word (not a sentence end).
        Shape: ``(N,)`` -> ``(N, W)``.
        """
        padded, lengths = self._sentences_matrix(stream)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        sentence = np.searchsorted(starts, positions, side="right") - 1
        rows = []
        for s, p in zip(sentence.tolist(), positions.tolist()):
            words = stream[starts[s] : p + 1]
            if words[-1] == self.eos:
                raise ValueError(f"position {p} is a sentence end; choose positions of words")
            log_prior = np.full(self.K, -math.log(self.K))
            for t, w in enumerate(words):
                prev = self.eos if t == 0 else words[t - 1]
                joint = log_prior + self._component_log_prob(np.array([prev]), np.array([w]))[0]
                posterior = joint - _logsumexp(joint[None], axis=1)[0]
                log_prior = self._drift(posterior)
            components = self._logits(np.full(self.K, words[-1]), np.arange(self.K)) - self.log_normaliser[words[-1]][:, None]
            rows.append(math.log1p(-self.end_prob) + _logsumexp(log_prior[:, None] + components, axis=0))
        return np.stack(rows)


class SyntheticLM(LanguageModelingDataModule):
    """Generated high-rank language (see the module docstring for the generative story).

    Deterministic by ``seed``: the generator's parameters and every split are drawn from
    numpy generators seeded with ``[seed, 0]`` and ``[seed, split]``, so changing
    ``train_tokens`` never changes the test split.

    Args:
        vocab_size: number of classes including ``<unk>`` (never generated) and ``<eos>``.
        num_topics: K latent topics (mixture components of the true distribution).
        generator_dim: d of the generator's vectors; each component has rank <= d + 1.
        topic_persistence: probability the topic stays the same from one word to the next.
        temperature: divides the generator's bilinear logits.
        zipf_exponent: exponent of the Zipfian unigram prior.
        mean_sentence_length: expected words per sentence.
        train_tokens / valid_tokens / test_tokens: minimum tokens per split (whole sentences).
        batch_size / eval_batch_size / bptt / variable_bptt / seed / num_workers: see
            :class:`LanguageModelingDataModule`.
    """

    def __init__(
        self,
        vocab_size: int = 500,
        num_topics: int = 8,
        generator_dim: int = 16,
        topic_persistence: float = 0.8,
        temperature: float = 0.5,
        zipf_exponent: float = 1.0,
        mean_sentence_length: float = 20.0,
        train_tokens: int = 500_000,
        valid_tokens: int = 20_000,
        test_tokens: int = 20_000,
        batch_size: int = 20,
        eval_batch_size: int = 10,
        bptt: int = 35,
        variable_bptt: bool = False,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, eval_batch_size, bptt, variable_bptt, seed, num_workers)
        self.save_hyperparameters()
        name = type(self).__name__
        check_positive(vocab_size, "vocab_size", name, minimum=len(SPECIALS) + 2)
        check_positive(num_topics, "num_topics", name)
        check_positive(generator_dim, "generator_dim", name)
        for key, value in (("train_tokens", train_tokens), ("valid_tokens", valid_tokens), ("test_tokens", test_tokens)):
            check_positive(value, key, name, minimum=2)
        if not 0.0 <= topic_persistence <= 1.0:
            raise ValueError(
                f"{name} needs topic_persistence in [0, 1], got {topic_persistence} (set data.init_args.topic_persistence)"
            )
        if not temperature > 0:
            raise ValueError(f"{name} needs temperature > 0, got {temperature} (set data.init_args.temperature)")
        if not zipf_exponent >= 0:
            raise ValueError(f"{name} needs zipf_exponent >= 0, got {zipf_exponent} (set data.init_args.zipf_exponent)")
        if not mean_sentence_length >= 1.0:
            raise ValueError(
                f"{name} needs mean_sentence_length >= 1, got {mean_sentence_length} (set data.init_args.mean_sentence_length)"
            )
        self.vocab_size = vocab_size
        self.generator_args = dict(
            num_words=vocab_size - len(SPECIALS),
            num_topics=num_topics,
            generator_dim=generator_dim,
            topic_persistence=float(topic_persistence),
            temperature=float(temperature),
            zipf_exponent=float(zipf_exponent),
            mean_sentence_length=float(mean_sentence_length),
            seed=seed,
        )
        self.split_tokens = {"train": train_tokens, "valid": valid_tokens, "test": test_tokens}
        self._language: SyntheticLanguage | None = None
        self._generated: dict[str, np.ndarray] = {}

    @property
    def num_classes(self) -> int:
        # Known without generating anything: every generator word is in the vocabulary.
        return self.vocab_size

    @property
    def language(self) -> SyntheticLanguage:
        if self._language is None:
            self._language = SyntheticLanguage(**self.generator_args)
        return self._language

    def generated(self, split: str) -> np.ndarray:
        """``(L,)`` generator ids of a split (words ``0..W-1``, ``<eos>`` = W)."""
        if split not in self._generated:
            rng = np.random.default_rng([self.seed, SPLIT_INDEX[split]])
            self._generated[split] = self.language.sample(self.split_tokens[split], rng)
        return self._generated[split]

    def generator_to_vocab(self) -> np.ndarray:
        """Map generator ids to vocabulary ids. Shape: ``(W+1,)``."""
        language, vocab = self.language, self.vocabulary
        mapping = np.array([vocab.stoi[f"w{w}"] for w in range(language.W)] + [vocab.stoi["<eos>"]])
        return mapping

    def _build_vocabulary(self) -> Vocabulary:
        W = self.language.W
        counts = np.bincount(self.generated("train"), minlength=W + 1)
        # Every word is listed (count 0 if unseen) so the size is vocab_size whatever the seed;
        # generator order breaks ties, which is also the Zipf-prior order.
        ordered = {f"w{w}": int(counts[w]) for w in range(W)}
        ordered["<eos>"] = int(counts[W])
        return Vocabulary(ordered, specials=SPECIALS, min_count=0)

    def _build_split(self, split: str) -> Tensor:
        return torch.from_numpy(self.generator_to_vocab()[self.generated(split)])

    def _compute_true_entropy(self) -> float:
        # Targets of the evaluation stream are test tokens 1..L-1 (token 0 has no history).
        log_probs = self.language.token_log_probs(self.generated("test"))
        return float(-log_probs[1:].mean())
