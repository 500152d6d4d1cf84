"""Multi30K English captions as a word-level language-modeling corpus.

Multi30K task 2 (Elliott et al., 2016) has five independent English captions per Flickr30K
image: ``task2/train.{1..5}.en.gz`` (145,000 sentences, about 1.8M words, 1.8x Penn
Treebank's training set) and ``task2/val.{1..5}.en.gz``; the test text is task 1's
``test_2016_flickr.en.gz``. Captions are raw text, so they are lower-cased and tokenised
with :func:`datamodules.text.ptb_tokenize`; the vocabulary keeps the ``max_vocab`` most
frequent training tokens (specials included) and maps the rest to ``<unk>``.

Tokenising 150k lines takes several seconds, so the encoded splits and the vocabulary are
cached with :func:`torch.save` in ``<cache_dir>/<key>.pt`` (default cache_dir:
``$XDG_CACHE_HOME/headbench/multi30k``, i.e. ``~/.cache/headbench/multi30k``; the data
directory itself is never written to, it may be shared and read-only). ``key`` hashes the
resolved data directory, every argument that changes the ids and the source files' sizes
and modification times, so editing a file or a setting rebuilds the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from torch import Tensor

from datamodules.download import download_file
from datamodules.files import atomic_path, read_cache
from datamodules.lm import (
    SPECIALS,
    LanguageModelingDataModule,
    check_positive,
    count_tokens,
    encode_lines,
    where_files_are_missing,
)
from datamodules.text import ptb_tokenize, read_corpus
from datamodules.vocab import Vocabulary

log = logging.getLogger(__name__)

MULTI30K_BASE_URL = "https://github.com/multi30k/dataset/raw/master/data/"
# Relative paths under data_dir (the layout of the multi30k/dataset repository's data/*/raw).
MULTI30K_FILES = {
    "train": [f"task2/train.{i}.en.gz" for i in range(1, 6)],
    "valid": [f"task2/val.{i}.en.gz" for i in range(1, 6)],
    "test": ["task1/test_2016_flickr.en.gz"],
}
# SHA-256 of the files as stored in ../shared/data/multi30k, whose README states they are the
# unchanged repository files; recomputed with datamodules.download.file_checksum.
MULTI30K_SHA256: dict[str, str | None] = {
    "task2/train.1.en.gz": "a0e057f07a9733199c0d755d77f6d583dc6f40a3180734b1130a216e2fdf3a3b",
    "task2/train.2.en.gz": "d79dd70a9eafb2d1fe40151621278c4ae69b3c148c5052a53d7c7a41bf3ba023",
    "task2/train.3.en.gz": "86e16fdcc699bcb6bca0f87c3cf1051f7de5ee3674dd588cedc5200194282749",
    "task2/train.4.en.gz": "3771b84e010ad6197806d2a1188cb07c12149e3e0d178dd5966dee5763733686",
    "task2/train.5.en.gz": "73988689307fe836994eae59735dc840c15da9775455fa76e6ed22606a042a91",
    "task2/val.1.en.gz": "4ce8f8ffbef4a1c066e3f35a5ffc764666c26c318a733d9bdc6349577f1c6f9c",
    "task2/val.2.en.gz": "4103944d652127e5af33ba2761d71cb6c0e1509c1a67d4387dc67ad768cfb752",
    "task2/val.3.en.gz": "6ecd848713d98faa9c6db2e9e457a778335358e6e3a4743cf4e929a0516e399a",
    "task2/val.4.en.gz": "bfab4f0cbdac6233f206bbbfbd324dc02b258e291c3f410a69f9884171008788",
    "task2/val.5.en.gz": "4b6a6541b7b58d545eff7feead4187aeb0439a7178a7bed6951121e0ecbaee66",
    "task1/test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
}


def _remote_path(relative: str) -> str:
    task, name = relative.split("/", 1)
    return f"{task}/raw/{name}"


class Multi30kCaptions(LanguageModelingDataModule):
    """English Multi30K captions, lower-cased, PTB-tokenised, vocabulary capped.

    Args:
        data_dir: directory with ``task1/`` and ``task2/`` (the shared-data layout). A
            relative path is resolved against the current working directory, so the default
            ``../shared/data/multi30k`` works when running from the project checkout.
        download: fetch missing files from the Multi30K GitHub repository into ``data_dir``.
        max_vocab: vocabulary size including ``<unk>`` and ``<eos>``; rarer words -> ``<unk>``.
        lowercase: lower-case before tokenising.
        cache: cache the encoded splits (see module docstring).
        cache_dir: where the cache lives (default ``~/.cache/headbench/multi30k``).
        base_url: override the download location (a mirror with the same ``task*/raw`` layout).
        batch_size / eval_batch_size / bptt / variable_bptt / seed / num_workers: see
            :class:`LanguageModelingDataModule`.
    """

    runtime_options: tuple[str, ...] = ("data_dir", "download", "cache", "cache_dir", "base_url", "num_workers")

    def __init__(
        self,
        data_dir: str = "../shared/data/multi30k",
        download: bool = False,
        max_vocab: int = 10000,
        lowercase: bool = True,
        cache: bool = True,
        cache_dir: str | None = None,
        base_url: str | None = None,
        batch_size: int = 20,
        eval_batch_size: int = 10,
        bptt: int = 35,
        variable_bptt: bool = False,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, eval_batch_size, bptt, variable_bptt, seed, num_workers)
        self.save_hyperparameters()
        check_positive(max_vocab, "max_vocab", type(self).__name__, minimum=len(SPECIALS) + 1)
        self.data_dir, self.download = Path(data_dir), download
        self.max_vocab, self.lowercase, self.cache = max_vocab, lowercase, cache
        default_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "headbench" / "multi30k"
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache
        self.base_url = base_url or MULTI30K_BASE_URL
        self._loaded = False

    # ----------------------------------------------------------------- files
    def paths(self, split: str) -> list[Path]:
        return [self.data_dir / name for name in MULTI30K_FILES[split]]

    def _missing_files(self) -> list[Path]:
        return [p for s in MULTI30K_FILES for p in self.paths(s) if not p.is_file()]

    def prepare_data(self) -> None:
        """Download missing caption files (one process per node)."""
        if not self.download:
            return
        for path in self._missing_files():
            relative = path.relative_to(self.data_dir).as_posix()
            download_file(self.base_url + _remote_path(relative), path, MULTI30K_SHA256.get(relative))

    def _require_files(self) -> None:
        missing = self._missing_files()
        if not missing:
            return
        where = where_files_are_missing(self.data_dir, missing, "caption")
        raise ValueError(
            f"Multi30kCaptions: {where}; run with --data.download true or set --data.data_dir to a "
            f"directory with task1/ and task2/ from github.com/multi30k/dataset data/*/raw"
        )

    # ----------------------------------------------------------------- cache
    def _cache_key(self) -> str:
        stats = {}
        for split in MULTI30K_FILES:
            for path in self.paths(split):
                info = path.stat()
                stats[path.name] = [info.st_size, int(info.st_mtime)]
        settings = {
            "data_dir": str(self.data_dir.resolve()),
            "max_vocab": self.max_vocab,
            "lowercase": self.lowercase,
            "files": stats,
            "version": 1,
        }
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]

    def _load(self) -> None:
        """Build (or load from cache) the vocabulary and all three splits at once."""
        if self._loaded:
            return
        if self.download and self._missing_files():
            self.prepare_data()
        self._require_files()
        cache_path = self.cache_dir / f"{self._cache_key()}.pt" if self.cache else None
        state = read_cache(cache_path, "Multi30K id cache") if cache_path is not None and cache_path.is_file() else None
        if not self._cached_state_fits(state):
            state = None
        if state is not None:
            self._vocabulary = Vocabulary.from_itos(state["itos"])
            self._splits.update({s: state[s] for s in MULTI30K_FILES})
        else:
            tokenised = {
                split: [
                    ptb_tokenize(line, lower=self.lowercase)
                    for path in self.paths(split)
                    for line in read_corpus(path)
                    if line.strip()
                ]
                for split in MULTI30K_FILES
            }
            self._vocabulary = Vocabulary(count_tokens(tokenised["train"]), specials=SPECIALS, max_size=self.max_vocab)
            self._splits.update({s: encode_lines(lines, self._vocabulary) for s, lines in tokenised.items()})
            if cache_path is not None:
                state = {"itos": self._vocabulary.itos, **{s: self._splits[s] for s in MULTI30K_FILES}}
                self._write_cache(cache_path, state)
        self._loaded = True

    @staticmethod
    def _cached_state_fits(state: object) -> bool:
        """Whether a cache file holds the vocabulary (a list of strings) and an id tensor per split."""
        if state is None:
            return False
        fits = (isinstance(state, dict) and isinstance(state.get("itos"), list) and all(isinstance(t, str) for t in state["itos"])
                and all(isinstance(state.get(s), Tensor) and not state[s].is_floating_point() for s in MULTI30K_FILES))
        if not fits:
            log.warning("Multi30K id cache holds other entries than the vocabulary and the splits' ids; it is rebuilt")
        return fits

    @staticmethod
    def _write_cache(cache_path: Path, state: dict) -> None:
        """Write atomically (concurrent DDP ranks may race); an unwritable cache is skipped."""
        try:
            with atomic_path(cache_path, "Multi30K id cache", "free space or set data.init_args.cache_dir") as partial:
                torch.save(state, partial)
        except OSError as error:
            log.warning("could not cache Multi30K ids at %s (%s); they will be rebuilt next run", cache_path, error)

    # ----------------------------------------------------------------- hooks
    def _build_vocabulary(self) -> Vocabulary:
        self._load()
        assert self._vocabulary is not None
        return self._vocabulary

    def _build_split(self, split: str) -> Tensor:
        self._load()
        return self._splits[split]
