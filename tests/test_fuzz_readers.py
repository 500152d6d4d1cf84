"""Fuzzing every file reader with random bytes and random structures (hypothesis).

Each reader documents what it raises on bad input: a one-line ``ValueError`` that names the
file (and where in it). These tests feed it random bytes, near-valid structures with random
damage (truncation, flipped bytes, wrong JSON types, misaligned lines) and check that
nothing else escapes and that what it accepts is self-consistent. Example counts keep the
whole file to a few seconds; generated inputs are small, so a hang would show as a stuck run
(the deadline is far above the normal few milliseconds per example and only flags a reader
that became pathologically slow).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from datamodules.captioning import KarpathyCaptions
from datamodules.gnt import GNT_HEADER, fit_to_square, iter_gnt
from datamodules.text import read_corpus, read_lines
from datamodules.text_corpus import TextCorpus
from datamodules.translation import TranslationDataModule, read_parallel

ROOT = Path(__file__).resolve().parent.parent
# HEADBENCH_FUZZ_EXAMPLES=2000 runs a longer campaign; the default keeps the file to seconds.
# database=None: no example database written into the working tree. The default run draws the
# same examples every time (derandomize), so the suite passes or fails the same way run to run;
# a campaign draws new ones.
EXAMPLES = int(os.environ.get("HEADBENCH_FUZZ_EXAMPLES", "60"))
CAMPAIGN = "HEADBENCH_FUZZ_EXAMPLES" in os.environ
FUZZ = settings(max_examples=EXAMPLES, deadline=timedelta(seconds=10), database=None, derandomize=not CAMPAIGN,
                suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=max(1, EXAMPLES * 2 // 5), deadline=timedelta(seconds=20), database=None, derandomize=not CAMPAIGN,
               suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="fuzz-") as directory:
        yield Path(directory)


def assert_our_error(error: ValueError, path: Path | str) -> None:
    """Our reader errors are one line and name the file they are about."""
    event("refused")
    message = str(error)
    assert "\n" not in message, f"multi-line error: {message!r}"
    assert str(path) in message, f"error does not name {path}: {message!r}"


def damaged(data: bytes, draw) -> bytes:
    """``data`` unchanged, truncated, with one byte overwritten, or with junk appended."""
    how = draw(st.sampled_from(["keep", "truncate", "flip", "append"]))
    if how == "truncate" and data:
        return data[: draw(st.integers(0, len(data) - 1))]
    if how == "flip" and data:
        at = draw(st.integers(0, len(data) - 1))
        return data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]
    if how == "append":
        return data + draw(st.binary(min_size=1, max_size=12))
    return data


# ---------------------------------------------------------------------------------- .gnt
@st.composite
def gnt_files(draw) -> bytes:
    """Well-formed ``.gnt`` records (tiny glyphs), then maybe damaged; or plain random bytes."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=120))
    records = b""
    for _ in range(draw(st.integers(0, 3))):
        width, height = draw(st.integers(1, 5)), draw(st.integers(1, 5))
        tag = draw(st.binary(min_size=2, max_size=2))
        pixels = draw(st.binary(min_size=width * height, max_size=width * height))
        records += GNT_HEADER.pack(GNT_HEADER.size + width * height, tag, width, height) + pixels
    return damaged(records, draw)


@FUZZ
@given(data=gnt_files())
def test_gnt_reader_yields_consistent_records_or_names_file_and_offset(workdir, data):
    path = workdir / "fuzz.gnt"
    path.write_bytes(data)
    try:
        samples = list(iter_gnt(path))
    except ValueError as error:
        assert_our_error(error, path)
        assert "byte offset" in str(error) or (not data and "is empty (0 bytes)" in str(error))
        return
    event("accepted")
    # Accepted: the records tile the file exactly, and every glyph frames into a square.
    assert sum(GNT_HEADER.size + s.pixels.size for s in samples) == len(data)
    headers = list(iter_gnt(path, headers_only=True))
    assert [(s.offset, s.tag) for s in headers] == [(s.offset, s.tag) for s in samples]
    for sample in samples:
        assert sample.pixels.ndim == 2 and sample.pixels.size > 0
        assert fit_to_square(sample.pixels, 16).shape == (16, 16)


# ---------------------------------------------------------------------------------- text corpora
@st.composite
def text_files(draw, damage: bool = True) -> bytes:
    """Random bytes, text with odd whitespace and tokens, or a gzip of it; with ``damage``
    sometimes a stray non-UTF-8 byte or a damaged gzip stream."""
    kind = draw(st.sampled_from(["bytes", "text", "text", "gzip"] if damage else ["text", "gzip"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    words = st.one_of(st.sampled_from(["a", "b", "<unk>", "<eos>", " ", "\t", "\r", "\x0c", "\u2028"]),
                      st.text(st.characters(blacklist_categories=("Cs",)), max_size=4))
    lines = draw(st.lists(st.lists(words, max_size=5).map("".join), min_size=0 if damage else 1, max_size=8))
    if not damage:
        lines.append("a b")
    raw = "\n".join(lines).encode("utf-8")
    if damage and draw(st.integers(0, 3)) == 0:  # a stray non-UTF-8 byte somewhere
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + bytes([draw(st.integers(0x80, 0xFF))]) + raw[at:]
    if kind == "gzip":
        compressed = gzip.compress(raw, mtime=0)
        return damaged(compressed, draw) if damage and draw(st.booleans()) else compressed
    return raw


@FUZZ
@given(data=text_files())
def test_text_reader_returns_every_line_or_one_line_error(workdir, data):
    path = workdir / "fuzz.txt"
    path.write_bytes(data)
    try:
        lines = list(read_lines(path))
    except ValueError as error:
        assert_our_error(error, path)
        return
    event("accepted")
    assert all(isinstance(line, str) and "\n" not in line for line in lines)
    if not data.startswith(b"\x1f\x8b"):  # plain text: one line per newline-separated chunk
        assert len(lines) == len(data.split(b"\n")) - (1 if data.endswith(b"\n") or not data else 0)
    try:
        corpus = read_corpus(path)
    except ValueError as error:
        assert_our_error(error, path)
        assert not any(line.strip() for line in lines), "read_corpus refused a file read_lines accepted"
    else:
        assert corpus == lines


@FEW
@given(train=text_files(damage=False), valid=text_files(damage=False), test=text_files())
def test_text_corpus_datamodule_builds_or_one_line_error(workdir, train, valid, test):
    directory = workdir / "corpus"
    directory.mkdir(exist_ok=True)
    for name, data in (("train.txt", train), ("valid.txt", valid), ("test.txt", test)):
        (directory / name).write_bytes(data)
    module = TextCorpus("custom", str(directory), train_file="train.txt", valid_file="valid.txt", test_file="test.txt")
    try:
        size = module.num_classes
        streams = [module.split(name) for name in ("train", "valid", "test")]
    except ValueError as error:
        event("refused")
        assert "\n" not in str(error) and str(directory) in str(error)
        return
    event("accepted")
    for ids in streams:
        assert ids.numel() > 0 and 0 <= int(ids.min()) and int(ids.max()) < size


# ---------------------------------------------------------------------------------- parallel text
@st.composite
def parallel_pair(draw) -> tuple[bytes, bytes]:
    """Two sides with maybe different line counts and maybe broken bytes or gzip."""
    words = st.lists(st.sampled_from(["a", "b", "c", "<s>", "</s>", "<pad>", "\t", "", "ü"]), min_size=1, max_size=5)
    count = draw(st.integers(1, 6))
    sides = []
    for _ in range(2):
        lines = [" ".join(draw(words)) for _ in range(count + draw(st.sampled_from([0] * 10 + [1, -1])))]
        raw = "\n".join(lines).encode("utf-8")
        if draw(st.integers(0, 7)) == 0:
            raw = draw(text_files())
        sides.append(raw)
    return sides[0], sides[1]


@FEW
@given(pair=parallel_pair(), names=st.sampled_from([("xx", "yy"), ("xx.gz", "yy")]))
def test_parallel_reader_and_translation_data_or_one_line_error(workdir, pair, names):
    directory = workdir / "parallel"
    directory.mkdir(exist_ok=True)
    for stale in directory.iterdir():
        stale.unlink()
    for split in ("train", "valid", "test"):
        for suffix, data in zip(names, pair):
            (directory / f"{split}.{suffix}").write_bytes(data)
    source, target = directory / f"train.{names[0]}", directory / f"train.{names[1]}"
    try:
        source_lines, target_lines = read_parallel(source, target)
    except ValueError as error:
        assert "\n" not in str(error) and (str(source) in str(error) or str(target) in str(error))
    else:
        assert len(source_lines) == len(target_lines)
    module = TranslationDataModule(
        source="files", data_dir=str(directory), src_lang="xx", tgt_lang="yy", tokenizer="word",
        cache_dir=str(workdir / "cache"), max_tokens=50,
    )
    try:
        sizes = module.num_classes, module.source_vocab_size
        with contextlib.redirect_stdout(io.StringIO()):  # the dropped-pairs notice
            splits = [module.examples(stage) for stage in ("train", "val", "test")]
    except ValueError as error:
        event("refused")
        assert "\n" not in str(error) and str(directory) in str(error)
        return
    event("accepted")
    for examples in splits:
        for example in examples:
            assert all(0 <= i < sizes[1] for i in example.source)
            assert example.target is None or all(0 <= i < sizes[0] for i in example.target)


# ---------------------------------------------------------------------------------- Karpathy JSON
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


GOOD_SENTENCE = st.fixed_dictionaries(
    {}, optional={"raw": st.text(max_size=12), "tokens": st.lists(st.text(max_size=4), max_size=4)}
)
GOOD_ENTRY = st.fixed_dictionaries(
    {
        "filename": st.sampled_from(["a.png", "b.jpg", ""]),
        "split": st.sampled_from(["train", "val", "test", "restval"]),
        "sentences": st.lists(GOOD_SENTENCE, min_size=1, max_size=3),
    },
    optional={"filepath": st.sampled_from(["train2014", ""]), "cocoid": st.integers(0, 10**6) | st.sampled_from(["12", "007"])},
).map(lambda entry: entry if "cocoid" in entry else {**entry, "imgid": 3})


@st.composite
def karpathy_files(draw) -> bytes:
    """A well-formed Karpathy split file, two times in three with one random damage: any JSON
    value in place of the document, an entry, a field or a sentence; a field removed; or
    random bytes."""
    document = {"images": draw(st.lists(GOOD_ENTRY, max_size=4))}
    damage = draw(st.sampled_from(["none", "bytes", "document", "entry", "field", "drop", "sentence", "id"]))
    entries = document["images"]
    if damage == "bytes":
        return draw(st.binary(max_size=80))
    if damage == "document":
        document = draw(JSON_VALUES)
    elif damage == "id" and entries:
        entries[0]["cocoid"] = draw(st.sampled_from(["-3", "1e3", str(2**64), -1, 2**63, 1.5, True, None]))
    elif entries and damage in ("entry", "field", "drop", "sentence"):
        at = draw(st.integers(0, len(entries) - 1))
        entry = entries[at]
        if damage == "entry":
            entries[at] = draw(JSON_VALUES)
        elif damage == "field":
            entry[draw(st.sampled_from(sorted(entry)))] = draw(JSON_VALUES)
        elif damage == "drop":
            del entry[draw(st.sampled_from(sorted(entry)))]
        else:
            sentences = entry["sentences"]
            sentences[draw(st.integers(0, len(sentences) - 1))] = draw(JSON_VALUES | GOOD_SENTENCE.map(lambda s: {**s, "tokens": [1]}))
    return json.dumps(document).encode()


KARPATHY = karpathy_files()


@FUZZ
@given(data=KARPATHY)
def test_karpathy_reader_builds_records_and_vocabulary_or_one_line_error(workdir, data):
    path = workdir / "dataset_coco.json"
    path.write_bytes(data)
    module = KarpathyCaptions(str(path), str(workdir / "images"), count_threshold=1, image_size=16, batch_size=1)
    try:
        records = {split: module.records(split) for split in ("train", "val", "test")}
        vocabulary = module.vocab
    except ValueError as error:
        assert_our_error(error, path)
        return
    event("accepted" if any(records.values()) else "accepted, no records")
    for split, split_records in records.items():
        dataset = module.dataset(split)
        assert len(dataset) == len(split_records)
        for record in split_records:
            assert record.captions and all(isinstance(c, str) for c in record.captions)
            assert 0 <= record.image_id < 2**63
        if split_records:  # the images do not exist: the documented one-line error names the file
            with pytest.raises(ValueError, match="does not exist") as info:
                dataset[0]
            assert "\n" not in str(info.value)
    assert len(vocabulary) >= 4


# ---------------------------------------------------------------------------------- configs
TOP_KEYS = st.sampled_from(["model", "data", "trainer", "seed_everything", "checkpoint", "lr_monitor", "ckpt_path", "junk"])
CLASS_PATHS = st.sampled_from(["tasks.LanguageModel", "datamodules.SyntheticLM", "datamodules.TextCorpus", "nope.Nothing", "heads.Softmax", ""])
CONFIG_VALUES = st.one_of(
    JSON_VALUES,
    st.fixed_dictionaries({"class_path": CLASS_PATHS}, optional={"init_args": st.dictionaries(st.sampled_from(["head", "vocab_size", "batch_size", "x"]), JSON_VALUES, max_size=2)}),
    st.dictionaries(st.sampled_from(["max_epochs", "devices", "logger", "callbacks", "monitor", "save_top_k"]), JSON_VALUES, max_size=2),
)
BASE_CONFIG = ROOT / "configs/lm/synthetic.yaml"


@st.composite
def mutated_configs(draw) -> bytes:
    """configs/lm/synthetic.yaml with one or two values (at any depth) replaced by random ones."""
    config = yaml.safe_load(BASE_CONFIG.read_text())
    for _ in range(draw(st.integers(1, 2))):
        node = config
        while True:
            key = draw(st.sampled_from(sorted(node)) | st.text(min_size=1, max_size=5))
            if isinstance(node.get(key), dict) and node[key] and draw(st.booleans()):
                node = node[key]
                continue
            node[key] = draw(CONFIG_VALUES)
            break
    return yaml.safe_dump(config).encode()


CONFIGS = st.one_of(
    st.binary(max_size=60),
    st.dictionaries(TOP_KEYS, CONFIG_VALUES, max_size=4).map(lambda v: yaml.safe_dump(v).encode()),
    mutated_configs(),
    mutated_configs(),
)


@FEW
@given(data=CONFIGS)
def test_config_files_print_or_fail_with_one_line(workdir, data):
    from app.main import main

    path = workdir / "config.yaml"
    path.write_bytes(data)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(["fit", "--config", str(path), "--print_config"])
        except SystemExit as done:  # --print_config printed the parsed config
            assert done.code in (0, None)
            event("printed")
        except ValueError as error:
            event("refused")
            assert "\n" not in str(error).strip(), f"multi-line error: {error}"
            assert not isinstance(error, UnicodeDecodeError), f"bare decode error: {error}"
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                assert str(path) in str(error) and "not UTF-8" in str(error)
        else:
            pytest.fail("--print_config neither printed nor refused the config")
