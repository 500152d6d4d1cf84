"""Language-modeling data sources on tiny generated corpora (no network, well under a minute).

What is proved here: the documented id order (specials, then decreasing train count), unk
mapping, one ``<eos>`` per line, split contents, per-rank contiguous streams that score
every target once, the synthetic language's exact entropy (forward algorithm == brute-force
enumeration of topic paths), its determinism and its high rank, the Multi30K tokenisation,
vocabulary cap and cache, and every bad-input error.
"""

from __future__ import annotations

import gzip
import itertools
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules import LanguageModelingDataModule, Multi30kCaptions, SyntheticLanguage, SyntheticLM, TextCorpus
from datamodules.text import ptb_tokenize, read_corpus

SHARED_MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"

TRAIN = ["the cat sat", " the dog sat on the mat ", "a cat <unk> the dog"]
VALID = ["the cat ran"]
TEST = ["the zebra sat", "dog"]


def write_ptb(directory: Path, train=TRAIN, valid=VALID, test=TEST, names=("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt")):
    directory.mkdir(parents=True, exist_ok=True)
    for name, lines in zip(names, (train, valid, test)):
        (directory / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return directory


class _RankOf:
    """The two attributes of a Trainer the data module reads to pick its shard."""

    def __init__(self, global_rank: int, world_size: int) -> None:
        self.global_rank, self.world_size = global_rank, world_size


def shard_targets(loader) -> tuple[torch.Tensor, torch.Tensor]:
    """Rebuild one rank's rows from its windows; return (inputs, targets) flattened row by row."""
    inputs = torch.cat([batch["input"] for batch in loader], dim=1)  # (B, row_length)
    targets = torch.cat([batch["target"] for batch in loader], dim=1)  # (B, row_length)
    return inputs.reshape(-1), targets.reshape(-1)


# ---------------------------------------------------------------------------------- text corpus
def test_vocabulary_specials_then_decreasing_train_count(tmp_path):
    dm = TextCorpus("ptb", str(write_ptb(tmp_path)))
    itos = dm.vocabulary.itos
    assert itos[:2] == ["<unk>", "<eos>"]
    # the:4, cat:2, sat:2, dog:2 (ties by first appearance), then singletons in order.
    assert itos[2:] == ["the", "cat", "sat", "dog", "on", "mat", "a"]
    assert dm.num_classes == 9 and dm.frequency_ordered is True and dm.true_entropy is None


def test_splits_eos_per_line_and_unk_mapping(tmp_path):
    dm = TextCorpus("ptb", str(write_ptb(tmp_path)))
    dm.setup("fit")
    dm.setup("test")
    vocab = dm.vocabulary
    for split, lines in (("train", TRAIN), ("valid", VALID), ("test", TEST)):
        ids = dm.split(split)
        assert ids.dtype == torch.long and ids.dim() == 1
        assert int((ids == vocab.index("<eos>")).sum()) == len(lines)
        expected = [t if t in vocab else "<unk>" for line in lines for t in line.split() + ["<eos>"]]
        assert vocab.decode(ids.tolist()) == expected
    # "zebra" never occurs in training -> <unk> (id 0); the literal <unk> token is id 0 too.
    assert dm.split("test")[1].item() == 0
    assert dm.split("train")[13].item() == 0


def test_wikitext_blank_lines_skipped_and_custom_names(tmp_path):
    names = ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens")
    write_ptb(tmp_path, train=["", " = Title = ", "", "a b", ""], names=names)
    dm = TextCorpus("wikitext2", str(tmp_path))
    assert dm.vocabulary.decode(dm.split("train").tolist()) == ["=", "Title", "=", "<eos>", "a", "b", "<eos>"]
    custom = write_ptb(tmp_path / "mine", names=("tr.txt", "va.txt", "te.txt"))
    dm = TextCorpus("custom", str(custom), train_file="tr.txt", valid_file="va.txt", test_file="te.txt")
    assert dm.num_classes == 9


def test_two_ranks_cover_every_target_once_in_order(tmp_path):
    lines = [" ".join(f"w{(7 * i + j) % 23}" for j in range(1 + i % 5)) for i in range(60)]
    dm = TextCorpus("ptb", str(write_ptb(tmp_path, train=lines)), batch_size=3, eval_batch_size=2, bptt=4)
    tokens = dm.split("train")
    for loader_name, rows in (("train_dataloader", 3), ("val_dataloader", 2)):
        source = tokens if loader_name == "train_dataloader" else dm.split("valid")
        covered = []
        for rank in (0, 1):
            dm.trainer = _RankOf(rank, 2)
            loader = getattr(dm, loader_name)()
            batches = list(loader)
            assert all(b["input"].shape[0] == rows and b["input"].shape == b["target"].shape for b in batches)
            assert all(b["input"].shape[1] <= 4 for b in batches)
            inputs, targets = shard_targets(batches)
            kept = targets != -100
            # Within a shard, the input at each step is the previous target: the text is contiguous.
            assert torch.equal(inputs[kept][1:], targets[kept][:-1])
            covered.append(targets[kept])
        dm.trainer = None
        assert torch.equal(torch.cat(covered), source[1:])


def test_variable_bptt_train_windows_fixed_eval_windows(tmp_path):
    lines = [" ".join(["x"] * 30)] * 40
    dm = TextCorpus("ptb", str(write_ptb(tmp_path, train=lines, valid=lines)), batch_size=2, bptt=20, variable_bptt=True, seed=3)
    train_lengths = [b["input"].shape[1] for b in dm.train_dataloader()]
    assert len(set(train_lengths)) > 1 and sum(train_lengths) == math.ceil((dm.split("train").numel() - 1) / 2)
    eval_lengths = [b["input"].shape[1] for b in dm.val_dataloader()]
    assert set(eval_lengths[:-1]) == {20} and eval_lengths[-1] <= 20
    pad = [b for b in dm.test_dataloader()][-1]
    assert (pad["input"][pad["target"] == -100] == dm.eos_index).all()


def test_state_for_checkpoint_round_trip(tmp_path):
    dm = TextCorpus("ptb", str(write_ptb(tmp_path)))
    state = dm.state_for_checkpoint()
    fresh = TextCorpus("ptb", str(tmp_path / "elsewhere"))
    fresh.load_state_for_checkpoint(state)
    assert fresh.vocabulary.itos == dm.vocabulary.itos and fresh.num_classes == dm.num_classes
    assert dm.hparams["name"] == "ptb" and dm.hparams["bptt"] == 35


def test_no_io_in_init_and_missing_directory_error(tmp_path):
    missing = tmp_path / "nowhere"
    dm = TextCorpus("ptb", str(missing))  # must not fail: no I/O in __init__
    with pytest.raises(ValueError) as error:
        dm.num_classes
    message = str(error.value)
    assert "\n" not in message and str(missing) in message and "--data.download true" in message
    write_ptb(missing, names=("ptb.train.txt", "ptb.valid.txt", "other.txt"))
    with pytest.raises(ValueError, match=r"ptb\.test\.txt is missing"):
        TextCorpus("ptb", str(missing)).setup("test")


def test_empty_corpus_file_error(tmp_path):
    write_ptb(tmp_path, train=["", "   "])
    with pytest.raises(ValueError, match=r"ptb\.train\.txt is empty") as error:
        TextCorpus("ptb", str(tmp_path)).num_classes
    assert "\n" not in str(error.value)


def test_non_utf8_line_names_file_and_line(tmp_path):
    write_ptb(tmp_path)
    (tmp_path / "ptb.valid.txt").write_bytes(b"fine line\nstill fine\ncaf\xe9 latin-1\n")
    dm = TextCorpus("ptb", str(tmp_path))
    dm.num_classes
    with pytest.raises(ValueError, match=r"ptb\.valid\.txt:3: line is not valid UTF-8") as error:
        dm.setup("fit")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(name="ptbx"), r"name must be one of .* got 'ptbx'"),
        (dict(name="custom"), r"missing \['train', 'valid', 'test'\]"),
        (dict(name="custom", download=True, train_file="a", valid_file="b", test_file="c"), "cannot download"),
        (dict(bptt=0), r"bptt to be an integer >= 1, got 0"),
        (dict(num_workers=2), r"num_workers to be 0 or 1, got 2"),
    ],
)
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern) as error:
        TextCorpus(data_dir="unused", **kwargs)
    assert "\n" not in str(error.value)


def test_read_corpus_reads_gzip_by_content(tmp_path):
    path = tmp_path / "no_gz_suffix.txt"
    path.write_bytes(gzip.compress("é one\ntwo\n".encode()))
    assert read_corpus(path) == ["é one", "two"]


def test_ptb_tokenize_rules():
    assert ptb_tokenize("A man's dog doesn't bark, 3.5 times... in a T-shirt (red).") == [
        "a", "man", "'s", "dog", "does", "n't", "bark", ",", "3.5", "times", "...",
        "in", "a", "t-shirt", "(", "red", ")", ".",
    ]  # fmt: skip
    assert ptb_tokenize("They're at 5 o'clock", lower=False) == ["They", "'re", "at", "5", "o'clock"]


# ---------------------------------------------------------------------------------- synthetic
def tiny_synthetic(**overrides) -> SyntheticLM:
    kwargs = dict(vocab_size=60, num_topics=3, generator_dim=4, train_tokens=3000, valid_tokens=500, test_tokens=2000, seed=5)
    kwargs.update(overrides)
    return SyntheticLM(**kwargs)


def test_synthetic_deterministic_by_seed_and_frequency_ordered():
    a, b, c = tiny_synthetic(), tiny_synthetic(), tiny_synthetic(seed=6)
    assert a.num_classes == 60 and not a._generated  # the size needs no generation
    for split in ("train", "valid", "test"):
        assert torch.equal(a.split(split), b.split(split))
    assert not torch.equal(a.split("train")[:200], c.split("train")[:200])
    assert a.true_entropy == b.true_entropy != c.true_entropy
    itos = a.vocabulary.itos
    assert itos[:2] == ["<unk>", "<eos>"] and len(itos) == 60
    counts = torch.bincount(a.split("train"), minlength=60)
    assert (counts[2:-1] >= counts[3:]).all() and counts[0] == 0
    # Changing the training size leaves the test split alone (separate seeds per split).
    assert np.array_equal(tiny_synthetic(train_tokens=5000).generated("test"), a.generated("test"))


def test_synthetic_true_entropy_finite_below_uniform_and_unigram():
    dm = tiny_synthetic()
    entropy = dm.true_entropy
    train, test = dm.split("train"), dm.split("test")
    unigram = (torch.bincount(train, minlength=60).double() + 1) / (train.numel() + 60)
    unigram_cross_entropy = float(-unigram[test[1:]].log().mean())
    assert math.isfinite(entropy) and 0 < entropy < unigram_cross_entropy < math.log(60)


def _brute_force_sentence_log_prob(lang: SyntheticLanguage, words: list[int], ended: bool) -> float:
    """log P(words [, <eos>]) by summing the generative story over every topic path."""
    total = 0.0
    for path in itertools.product(range(lang.K), repeat=len(words)):
        p = 1.0 / lang.K
        for t, (z, w) in enumerate(zip(path, words)):
            if t > 0:
                stay = lang.rho + (1 - lang.rho) / lang.K if z == path[t - 1] else (1 - lang.rho) / lang.K
                p *= stay * (1 - lang.end_prob)
            prev = lang.eos if t == 0 else words[t - 1]
            logits = lang._logits(np.array([prev]), np.array([z]))[0]
            p *= math.exp(logits[w] - np.logaddexp.reduce(logits))
        total += p
    return math.log(total) + (math.log(lang.end_prob) if ended else 0.0)


@pytest.mark.parametrize("persistence", [0.0, 0.6, 1.0])
def test_forward_algorithm_equals_enumeration_of_topic_paths(persistence):
    lang = SyntheticLanguage(6, 3, 2, persistence, temperature=0.7, zipf_exponent=1.0, mean_sentence_length=3.0, seed=1)
    stream = lang.sample(40, np.random.default_rng(0))
    ours = lang.token_log_probs(stream)
    start, checked = 0, 0
    for end in np.flatnonzero(stream == lang.eos)[:8]:
        words = stream[start:end].tolist()
        if len(words) > 5:  # K^n topic paths: keep the enumeration small
            start = end + 1
            continue
        checked += 1
        for t in range(len(words) + 1):  # prefixes: log P(x_t | x_<t) = log P(x_<=t) - log P(x_<t)
            now = _brute_force_sentence_log_prob(lang, words[: t + 1], ended=t == len(words))
            before = _brute_force_sentence_log_prob(lang, words[:t], ended=False) if t else 0.0
            assert ours[start + t] == pytest.approx(now - before, abs=1e-9), (start, t)
        start = end + 1
    assert checked >= 4


def test_log_prob_matrix_rows_normalised_and_consistent_with_tokens():
    lang = tiny_synthetic().language
    stream = lang.sample(400, np.random.default_rng(2))
    positions = np.flatnonzero((stream[:-1] != lang.eos) & (stream[1:] != lang.eos))[:25]
    rows = lang.log_prob_matrix(stream, positions)  # (25, W)
    # Words share 1 - q of the mass, <eos> the rest.
    np.testing.assert_allclose(np.logaddexp.reduce(rows, axis=1), math.log1p(-lang.end_prob), atol=1e-9)
    np.testing.assert_allclose(rows[np.arange(25), stream[positions + 1]], lang.token_log_probs(stream)[positions + 1], atol=1e-9)


def test_sampler_draws_from_the_distribution_the_entropy_uses():
    # If samples came from another distribution than the one the entropy is computed from,
    # the mean surprisal of the sampled next token would exceed the mean entropy of the
    # predictive distributions (Gibbs' inequality); equal means up to sampling noise.
    lang = SyntheticLanguage(40, 4, 4, 0.7, 0.5, 1.0, 6.0, seed=3)
    rng = np.random.default_rng(4)
    surprisal, entropy = [], []
    stream, lengths = lang.sample_sentences(600, rng)
    for sentence in np.split(stream, np.cumsum(lengths)[:-1]):
        p = int(rng.integers(0, sentence.size - 1))  # one word position per sentence
        row = lang.log_prob_matrix(sentence, np.array([p]))[0]  # words; <eos> has q
        q = lang.end_prob
        entropy.append(-(np.exp(row) * row).sum() - q * math.log(q))
        following = sentence[p + 1]
        surprisal.append(-math.log(q) if following == lang.eos else -row[following])
    gap = np.mean(surprisal) - np.mean(entropy)
    assert abs(gap) < 4 * np.std(surprisal) / math.sqrt(len(surprisal)), gap


def test_synthetic_language_is_high_rank_and_one_topic_is_not():
    d = 6
    ranks = {}
    for topics in (1, 8):
        dm = tiny_synthetic(vocab_size=202, num_topics=topics, generator_dim=d, test_tokens=3000)
        lang = dm.language
        stream = dm.generated("test")
        positions = np.flatnonzero(stream != lang.eos)[:150]
        matrix = lang.log_prob_matrix(stream, positions)  # (150, 200)
        singular = np.linalg.svd(matrix - matrix.mean(axis=1, keepdims=True), compute_uv=False)
        ranks[topics] = int((singular > 1e-8 * singular[0]).sum())
    # One topic: a rank-(d+1) bilinear softmax (d after row-centring). Mixture: far above d + 1,
    # i.e. above the hidden size a bottleneck demo would give a softmax head.
    assert ranks[1] <= d + 1
    assert ranks[8] > 8 * (d + 1), ranks


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(vocab_size=3), r"vocab_size to be an integer >= 4, got 3"),
        (dict(topic_persistence=1.5), r"topic_persistence in \[0, 1\], got 1.5"),
        (dict(temperature=0.0), r"temperature > 0, got 0.0"),
        (dict(mean_sentence_length=0.5), r"mean_sentence_length >= 1"),
        (dict(test_tokens=1), r"test_tokens to be an integer >= 2"),
    ],
)
def test_synthetic_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern) as error:
        SyntheticLM(**kwargs)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_synthetic_default_generation_is_fast():
    start = time.perf_counter()
    dm = SyntheticLM()
    dm.setup("fit")
    assert dm.split("train").numel() >= 500_000  # the default: 500k training tokens
    assert time.perf_counter() - start < 5.0
    assert 0 < dm.true_entropy < math.log(dm.num_classes)


# ---------------------------------------------------------------------------------- multi30k
CAPTIONS = ["A dog's ball.", "Two dogs run, fast!", "A man doesn't sit.", "A rare Zebra."]


def write_multi30k(root: Path, extra: str = "") -> Path:
    for i in range(1, 6):
        for split in ("train", "val"):
            path = root / "task2" / f"{split}.{i}.en.gz"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(gzip.compress("\n".join(CAPTIONS[: 4 if i == 1 else 3] + [extra]).encode()))
    test = root / "task1" / "test_2016_flickr.en.gz"
    test.parent.mkdir(parents=True, exist_ok=True)
    test.write_bytes(gzip.compress(b"A cat's ball.\nTwo men sit.\n"))
    return root


def test_multi30k_tokenised_lowercased_capped_and_cached(tmp_path):
    root = write_multi30k(tmp_path / "m30k")
    cache = tmp_path / "cache"
    dm = Multi30kCaptions(str(root), max_vocab=12, cache_dir=str(cache))
    vocab = dm.vocabulary
    assert len(vocab) == 12 and vocab.itos[:4] == ["<unk>", "<eos>", "a", "."]
    assert "zebra" not in vocab  # seen once: beyond the cap -> <unk>
    # train = 5 files x (3 or 4 captions), one <eos> each.
    assert int((dm.split("train") == vocab.index("<eos>")).sum()) == 16
    # Kept: a . (11 each), then the 5-count tokens in first-appearance order up to the cap.
    assert vocab.itos[4:] == ["dog", "'s", "ball", "two", "dogs", "run", ",", "fast"]
    assert vocab.decode(dm.split("test").tolist()) == ["a", "<unk>", "'s", "ball", ".", "<eos>", "two", "<unk>", "<unk>", ".", "<eos>"]
    assert vocab.decode(dm.split("valid")[:7].tolist()) == ["a", "dog", "'s", "ball", ".", "<eos>", "two"]
    files = list(cache.glob("*.pt"))
    assert len(files) == 1
    again = Multi30kCaptions(str(root), max_vocab=12, cache_dir=str(cache))
    assert again.vocabulary.itos == vocab.itos and torch.equal(again.split("train"), dm.split("train"))
    # Editing a source file changes the cache key (size/mtime), so the ids are rebuilt.
    write_multi30k(root, extra="a new caption")
    rebuilt = Multi30kCaptions(str(root), max_vocab=12, cache_dir=str(cache))
    assert rebuilt.split("train").numel() > dm.split("train").numel() and len(list(cache.glob("*.pt"))) == 2
    assert not any(root.rglob("*.pt"))  # the data directory is never written to


@pytest.mark.parametrize("damage", [b"", b"PK\x03\x04 cut short", "pickle"])
def test_a_damaged_multi30k_cache_is_rebuilt_with_one_warning(tmp_path, caplog, damage):
    """A cache file cut short, overwritten or holding other objects is read as a miss: the ids are
    built again (same as the first build) and the file rewritten; never a traceback."""
    root = write_multi30k(tmp_path / "m30k")
    cache = tmp_path / "cache"
    first = Multi30kCaptions(str(root), max_vocab=12, cache_dir=str(cache))
    expected = first.split("train").clone()
    (file,) = cache.glob("*.pt")
    if damage == "pickle":
        torch.save({"itos": 3, "train": "x"}, file)
    else:
        file.write_bytes(damage)
    again = Multi30kCaptions(str(root), max_vocab=12, cache_dir=str(cache))
    assert torch.equal(again.split("train"), expected) and again.vocabulary.itos == first.vocabulary.itos
    assert "Multi30K id cache" in caplog.text and "rebuilt" in caplog.text
    assert Multi30kCaptions(str(root), max_vocab=12, cache_dir=str(cache)).vocabulary.itos == first.vocabulary.itos


def test_multi30k_missing_directory_error(tmp_path):
    dm = Multi30kCaptions(str(tmp_path / "absent"), cache=False)
    with pytest.raises(ValueError, match=r"absent does not exist; run with --data.download true") as error:
        dm.num_classes
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"max_vocab to be an integer >= 3"):
        Multi30kCaptions(max_vocab=2)


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_MULTI30K.is_dir(), reason="../shared/data/multi30k not present")
def test_multi30k_real_corpus(tmp_path):
    dm = Multi30kCaptions(str(SHARED_MULTI30K), cache_dir=str(tmp_path))
    assert dm.num_classes == 10000
    eos = dm.eos_index
    assert int((dm.split("train") == eos).sum()) == 145_000
    assert int((dm.split("valid") == eos).sum()) == 5 * 1014
    assert int((dm.split("test") == eos).sum()) == 1000
    start = time.perf_counter()
    cached = Multi30kCaptions(str(SHARED_MULTI30K), cache_dir=str(tmp_path))
    assert cached.num_classes == 10000 and time.perf_counter() - start < 3.0


def test_base_class_is_abstract():
    with pytest.raises(NotImplementedError):
        LanguageModelingDataModule().num_classes


def test_sampler_without_cdf_table_draws_the_same_words():
    # Large vocabularies skip the tabulated CDFs; both paths must sample the same language.
    # The random numbers are consumed identically, so streams agree except where a draw
    # falls within float32 rounding of a CDF boundary.
    tabulated = SyntheticLanguage(50, 3, 4, 0.8, 0.5, 1.0, 8.0, seed=2)
    direct = SyntheticLanguage(50, 3, 4, 0.8, 0.5, 1.0, 8.0, seed=2)
    direct.MAX_TABLE_ENTRIES = 0
    a, b = tabulated.sample(5000, np.random.default_rng(9)), direct.sample(5000, np.random.default_rng(9))
    assert direct._cdf_table() is None and tabulated._cdf_table() is not None
    assert a.size == b.size and (a == b).mean() > 0.99
