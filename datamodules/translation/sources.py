"""Parallel text on disk: the known corpora (splits, language pairs, download location and
checksums), reading aligned ``{split}.{lang}[.gz]`` files, and the synthetic language pair.

Layout: ``{data_dir}/{split}.{lang}`` or ``{split}.{lang}.gz``, UTF-8, one sentence per line,
line ``i`` of the two language files aligned. Built-in sources name their splits and the
language pairs they hold (``SOURCES``); ``files`` accepts any pair and split names.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from datamodules.text import read_lines as read_text_lines


@dataclass(frozen=True)
class ParallelSource:
    """A known corpus: its default splits and the language pairs it holds (both directions)."""

    splits: tuple[str, str, str]
    pairs: tuple[tuple[str, str], ...]
    base_url: str | None = None  # download location of the ``{split}.{lang}.gz`` files
    checksums: dict[str, str] | None = None  # file name -> SHA-256 of the published file


MULTI30K_URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/"
#: SHA-256 of the multi30k/dataset ``data/task1/raw`` files, computed with
#: ``datamodules.download.file_checksum`` from the unchanged copies in ``../shared/data/multi30k``.
#: Other files of that directory (e.g. ``test_2017_flickr``) download unverified, with a warning.
MULTI30K_TASK1_SHA256 = {
    "train.cs.gz": "a65adb8b32e3bc664f21ecba7a6e7f6950fd1f405e135f7c312faabdb6255077",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
    "val.cs.gz": "b63226e05c4bd5dd6a42897d74b86a1b9d2c31498252c572b1ea7f7996927fcc",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
    "test_2016_flickr.cs.gz": "200a4a74cc9560f051924abb9803be008d1908d77f747e9141aeb86dfd2797f1",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
}
SOURCES: dict[str, ParallelSource] = {
    "multi30k": ParallelSource(
        ("train", "val", "test_2016_flickr"), (("de", "en"), ("fr", "en"), ("cs", "en")), MULTI30K_URL, MULTI30K_TASK1_SHA256
    ),
    # fairseq's examples/translation/prepare-iwslt14.sh output (tokenised, lower-cased).
    "iwslt14": ParallelSource(("train", "valid", "test"), (("de", "en"),)),
    # User-provided files, e.g. train / newstest2013 / newstest2014.
    "wmt14": ParallelSource(("train", "newstest2013", "newstest2014"), (("en", "de"), ("en", "fr"))),
    "synthetic": ParallelSource(("train", "valid", "test"), (("src", "tgt"),)),
    "files": ParallelSource(("train", "valid", "test"), ()),
}


def find_text_file(directory: Path, split: str, lang: str) -> Path | None:
    for name in (f"{split}.{lang}", f"{split}.{lang}.gz"):
        if (directory / name).exists():
            return directory / name
    return None


def read_lines(path: Path) -> list[str]:
    """Lines of a (optionally gzipped) UTF-8 file, newline stripped.

    Raises:
        ValueError: a line that is not UTF-8 (naming file and line) or a damaged gzip file
            (see :func:`datamodules.text.read_lines`, which also recognises gzip by content).
    """
    return list(read_text_lines(path))


def read_parallel(source_path: Path, target_path: Path) -> tuple[list[str], list[str]]:
    """Aligned source/target lines; refuses files of different lengths naming both."""
    source, target = read_lines(source_path), read_lines(target_path)
    if len(source) != len(target):
        raise ValueError(
            f"parallel files must have the same number of lines: {source_path} has {len(source)}, "
            f"{target_path} has {len(target)} (fix or re-extract the corpus)"
        )
    return source, target


def synthetic_corpus(num_sentences: int, seed: int, words: int = 12, min_len: int = 3, max_len: int = 8) -> tuple[list[str], list[str]]:
    """A toy language pair that needs attention but no world knowledge.

    Source sentences are random strings of ``words`` source words; the translation maps
    every word through a fixed bilingual lexicon and swaps each adjacent pair of words (a
    local reordering), so a model must learn a lexicon and to attend off the diagonal.
    """
    rng = random.Random(seed)
    lexicon = {f"s{i}": f"t{(i * 5 + 3) % words}" for i in range(words)}
    source_words = list(lexicon)
    sources, targets = [], []
    for _ in range(num_sentences):
        sentence = [rng.choice(source_words) for _ in range(rng.randint(min_len, max_len))]
        translated = [lexicon[w] for w in sentence]
        for i in range(0, len(translated) - 1, 2):
            translated[i], translated[i + 1] = translated[i + 1], translated[i]
        sources.append(" ".join(sentence))
        targets.append(" ".join(translated))
    return sources, targets

