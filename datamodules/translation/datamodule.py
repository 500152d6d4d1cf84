"""The translation data module: a parallel corpus tokenised (BPE, words or pre-segmented
pieces), frequency-ordered vocabularies, token-count batches.

Empty lines: a training pair with an empty side teaches nothing and is dropped (the
number dropped is reported once). In validation, test and predict an empty source line is
kept by default (``empty_source="translate"``): the model sees only EOS and its output (often
empty) still fills that line of the output file, so outputs stay aligned with inputs;
``empty_source="error"`` refuses such a file instead, naming file and line.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from datamodules.base import DataState, HeadDataModule
from datamodules.bpe import EOS_ID, TOKENIZER_KINDS, TextTokenizer, train_bpe
from datamodules.download import download_file
from datamodules.files import CHECKPOINT_FIX, write_atomically
from datamodules.resumable import training_loader
from datamodules.sharding import rank_and_world
from datamodules.translation.batching import Example, TokenBatchStream
from datamodules.translation.sources import SOURCES, find_text_file, read_lines, read_parallel, synthetic_corpus
from datamodules.vocab import Vocabulary

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
SPECIALS = (PAD, UNK, BOS, EOS)  # ids PAD_ID, UNK_ID, BOS_ID, EOS_ID (datamodules/bpe.py)


class TranslationDataModule(HeadDataModule):
    """Parallel corpus -> tokenised, frequency-ordered, token-batched translation data.

    The classes are the target pieces; besides the base contract the source side is a
    :class:`datamodules.base.SourceVocabulary` (``source_vocab_size``).

    Args:
        source: corpus kind, one of ``multi30k``, ``iwslt14``, ``wmt14``, ``synthetic``,
            ``files`` (see ``SOURCES`` for splits and language pairs).
        data_dir: directory of ``{split}.{lang}[.gz]`` files (``synthetic`` writes there).
        src_lang / tgt_lang: translation direction, e.g. ``de`` -> ``en``.
        train_split / val_split / test_split: file prefixes (default: the source's own).
        predict_file: a source-language file to translate in ``predict`` (default: the
            test split's source file).
        download: fetch missing Multi30k files (``{split}.{lang}.gz`` of the three splits) from
            GitHub, checksum-verified, in ``prepare_data`` (or on the first read of a size, which
            the CLI does at instantiation, before ``prepare_data``).
        base_url: download location instead of the source's own (a mirror holding the same
            file names; the checksums still apply).
        tokenizer: ``bpe`` (sentencepiece, trained on the training split), ``word``, or
            ``presegmented`` (subword-nmt ``@@`` pieces already in the files, e.g. IWSLT'14
            as prepared by fairseq; outputs and references lose the markers).
        vocab_size: BPE pieces per model; for ``word``, the most words kept (0 = all).
        joint_bpe: one BPE model over both languages (else one per language).
        min_count: drop words seen fewer times (``word`` tokenizer).
        lowercase: lower-case all text before tokenising (outputs are then lower case).
        cache_dir: where trained BPE models and synthetic data are kept.
        max_tokens: padded tokens per batch (``sentences x max(source, target length)``).
        max_sentences: optional cap on sentences per batch.
        eval_max_tokens: ``max_tokens`` for validation/test/predict (default: same).
        max_train_length: drop training pairs with a side longer than this many pieces.
        empty_source: ``translate`` (keep empty eval/predict lines) or ``error``.
        synthetic_size: training pairs of the synthetic corpus (valid/test get a tenth).
        seed: shuffling and synthetic-data seed.
        num_workers: dataloader workers.
    """

    #: Where data is read, cached or fetched from and how it is loaded: the command line's
    #: choice, never a checkpoint's (:mod:`app.checkpoint_io.policy`).
    runtime_options: tuple[str, ...] = ("data_dir", "train_split", "val_split", "test_split", "predict_file", "download",
                                        "base_url", "cache_dir", "num_workers")

    def __init__(
        self,
        source: str = "multi30k",
        data_dir: str = "../shared/data/multi30k/task1",
        src_lang: str = "de",
        tgt_lang: str = "en",
        train_split: str | None = None,
        val_split: str | None = None,
        test_split: str | None = None,
        predict_file: str | None = None,
        download: bool = False,
        base_url: str | None = None,
        tokenizer: str = "bpe",
        vocab_size: int = 8000,
        joint_bpe: bool = True,
        min_count: int = 1,
        lowercase: bool = False,
        cache_dir: str = ".cache/translation",
        max_tokens: int = 4000,
        max_sentences: int | None = None,
        eval_max_tokens: int | None = None,
        max_train_length: int = 128,
        empty_source: str = "translate",
        synthetic_size: int = 2000,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if source not in SOURCES:
            raise ValueError(f"unknown translation source {source!r}: valid sources are {', '.join(SOURCES)} (set data.init_args.source)")
        pairs = SOURCES[source].pairs
        if pairs and (src_lang, tgt_lang) not in pairs and (tgt_lang, src_lang) not in pairs:
            valid = ", ".join(f"{a}-{b}, {b}-{a}" for a, b in pairs)
            raise ValueError(
                f"{source} has no {src_lang}-{tgt_lang} language pair: valid pairs are {valid} "
                f"(set data.init_args.src_lang / tgt_lang)"
            )
        if download and source != "synthetic" and SOURCES[source].base_url is None and base_url is None:
            raise ValueError(
                f"translation source {source!r} has no download location (only multi30k has one): put its "
                f"files in data_dir and set data.init_args.download false, or give data.init_args.base_url"
            )
        if src_lang == tgt_lang:
            raise ValueError(f"src_lang and tgt_lang must differ, both are {src_lang!r} (set data.init_args.tgt_lang)")
        if tokenizer not in ("bpe", "word", "presegmented"):
            raise ValueError(f"unknown tokenizer {tokenizer!r}: valid kinds are bpe, word, presegmented (set data.init_args.tokenizer)")
        if empty_source not in ("translate", "error"):
            raise ValueError(f"unknown empty_source policy {empty_source!r}: valid policies are translate, error (set data.init_args.empty_source)")
        for key, value in (("max_tokens", max_tokens), ("max_train_length", max_train_length), ("synthetic_size", synthetic_size)):
            if value < 1:
                raise ValueError(f"TranslationDataModule needs {key} >= 1, got {value} (set data.init_args.{key})")
        defaults = SOURCES[source].splits
        self.splits = {
            "train": train_split or defaults[0],
            "val": val_split or defaults[1],
            "test": test_split or defaults[2],
        }
        self.data_path = Path(data_dir)
        if source == "synthetic":  # one directory per generated corpus, never a stale one
            self.data_path = self.data_path / f"size{synthetic_size}-seed{seed}"
        self.cache_path = Path(cache_dir)
        self.source_tokenizer: TextTokenizer | None = None
        self.target_tokenizer: TextTokenizer | None = None
        self.source_vocab: Vocabulary | None = None
        self.target_vocab: Vocabulary | None = None
        self._examples: dict[str, list[Example]] = {}

    # ------------------------------------------------------------------ sizes (lazy)
    @property
    def num_classes(self) -> int:
        """Target vocabulary size (specials + pieces seen in the training targets)."""
        self._build_vocabularies()
        return len(self.target_vocab)

    @property
    def source_vocab_size(self) -> int:
        """Source vocabulary size (specials + pieces seen in the training sources)."""
        self._build_vocabularies()
        return len(self.source_vocab)

    @property
    def source_vocabulary(self) -> list[str]:
        """The source pieces in id order."""
        self._build_vocabularies()
        return list(self.source_vocab.itos)

    @property
    def class_names(self) -> list[str]:
        """The target pieces in id order."""
        self._build_vocabularies()
        return list(self.target_vocab.itos)

    @property
    def text_tokenizer(self) -> TextTokenizer:
        """The target side's tokenizer (the joint one with ``joint_bpe``)."""
        self._build_vocabularies()
        return self.target_tokenizer

    #: Both vocabularies: specials, then pieces by decreasing training count.
    frequency_ordered = True

    # ------------------------------------------------------------------ files
    def _split_path(self, split: str, lang: str) -> Path:
        if self.hparams.source == "synthetic":
            self._write_synthetic()
        path = find_text_file(self.data_path, split, lang)
        if path is None and self.hparams.download and self.hparams.source != "synthetic":
            # Every read of a split file comes through here, and the first one can come before
            # Lightning calls prepare_data (the CLI reads num_classes at instantiation): fetch
            # and verify the missing files first.
            self.prepare_data()
            path = find_text_file(self.data_path, split, lang)
        if path is None:
            # Say where the files are expected in terms the user can check: the resolved path of a
            # relative data_dir, and whether that directory exists at all.
            location = str(self.data_path) if self.data_path.is_absolute() else f"{self.data_path} (= {self.data_path.resolve()})"
            state = "" if self.data_path.is_dir() else ", a directory that does not exist"
            how = (
                "set data.init_args.download: true to fetch them, or put them there"
                if SOURCES[self.hparams.source].base_url
                else "put them there"
            )
            raise ValueError(
                f"no {split}.{lang} or {split}.{lang}.gz in {location}{state} (translation source "
                f"{self.hparams.source!r}); {how}, or set data.init_args.data_dir"
            )
        return path

    def _write_synthetic(self) -> None:
        if find_text_file(self.data_path, "test", "tgt") is not None:
            return
        size, seed = self.hparams.synthetic_size, self.hparams.seed
        for offset, (split, count) in enumerate((("train", size), ("valid", max(10, size // 10)), ("test", max(10, size // 10)))):
            sources, targets = synthetic_corpus(count, seed * 1000 + offset)
            for lang, lines in (("src", sources), ("tgt", targets)):
                write_atomically(self.data_path / f"{split}.{lang}", "\n".join(lines) + "\n", "synthetic corpus file",
                                 "free space or set data.init_args.data_dir")

    def _missing_files(self) -> list[str]:
        """``{split}.{lang}.gz`` names of the files of the three splits not in ``data_dir``."""
        langs = (self.hparams.src_lang, self.hparams.tgt_lang)
        return [
            f"{split}.{lang}.gz"
            for split in dict.fromkeys(self.splits.values())
            for lang in langs
            if find_text_file(self.data_path, split, lang) is None
        ]

    def prepare_data(self) -> None:
        """Write the synthetic corpus, or download missing files (``download: true``): each
        through :func:`datamodules.download.download_file` (checksum, timeout, atomic rename),
        so no reader ever sees a partial or unverified file."""
        if self.hparams.source == "synthetic":
            self._write_synthetic()
            return
        if not self.hparams.download:
            return
        source = SOURCES[self.hparams.source]
        base_url = self.hparams.base_url or source.base_url
        base_url = base_url if base_url.endswith("/") else base_url + "/"
        checksums = source.checksums or {}
        for name in self._missing_files():
            download_file(base_url + name, self.data_path / name, checksums.get(name))

    # ------------------------------------------------------------------ tokenisation
    def _build_vocabularies(self) -> None:
        if self.target_vocab is not None:
            return
        hp = self.hparams
        train_paths = self._split_path(self.splits["train"], hp.src_lang), self._split_path(self.splits["train"], hp.tgt_lang)
        source_lines, target_lines = read_parallel(*train_paths)
        for path, lines in zip(train_paths, (source_lines, target_lines)):
            if not any(line.strip() for line in lines):  # else the vocabulary is the specials alone
                raise ValueError(f"{path} gives no usable train sentences (every line is blank): put one sentence per line "
                                 f"in it or point data.init_args.data_dir at the corpus")
        if hp.tokenizer in ("word", "presegmented"):
            self.source_tokenizer = TextTokenizer(hp.tokenizer, lowercase=hp.lowercase)
            self.target_tokenizer = self.source_tokenizer
        elif hp.joint_bpe:
            proto = train_bpe(source_lines + target_lines, hp.vocab_size, self.cache_path, hp.lowercase, seed=hp.seed)
            self.source_tokenizer = TextTokenizer("bpe", proto, hp.lowercase)
            self.target_tokenizer = self.source_tokenizer
        else:
            self.source_tokenizer = TextTokenizer("bpe", train_bpe(source_lines, hp.vocab_size, self.cache_path, hp.lowercase, seed=hp.seed), hp.lowercase)
            self.target_tokenizer = TextTokenizer("bpe", train_bpe(target_lines, hp.vocab_size, self.cache_path, hp.lowercase, seed=hp.seed), hp.lowercase)
        max_size = hp.vocab_size + len(SPECIALS) if hp.tokenizer == "word" and hp.vocab_size > 0 else None
        min_count = hp.min_count if hp.tokenizer == "word" else 1
        self.source_vocab = self._count_vocabulary(self.source_tokenizer, source_lines, max_size, min_count)
        self.target_vocab = self._count_vocabulary(self.target_tokenizer, target_lines, max_size, min_count)

    @staticmethod
    def _count_vocabulary(tokenizer: TextTokenizer, lines: list[str], max_size: int | None, min_count: int) -> Vocabulary:
        counts: Counter = Counter()
        for line in lines:
            counts.update(tokenizer.tokenize(line))
        return Vocabulary(counts, specials=SPECIALS, max_size=max_size, min_count=min_count, unk=UNK)

    def state_for_checkpoint(self) -> DataState:
        """The base state (target pieces and tokenizer) plus the source vocabulary and tokenizer,
        so a checkpoint encodes inputs and detokenises outputs exactly as in training."""
        state = super().state_for_checkpoint()
        state["source_vocabulary"] = self.source_vocabulary
        state["source_tokenizer"] = self.source_tokenizer.state()
        return state

    def load_state_for_checkpoint(self, state: DataState, where: str = "checkpoint") -> None:
        """Use a checkpoint's tokenizers and vocabularies (re-encodes any split already read); a
        damaged tokenizer state, or one of another kind than this module's ``tokenizer``, is one
        line naming ``where`` (:func:`check_tokenizer_state`)."""
        self.source_tokenizer, self.target_tokenizer = check_tokenizer_state(state, where, self.hparams.tokenizer)
        self.source_vocab = Vocabulary.from_itos(state["source_vocabulary"], unk=UNK)
        self.target_vocab = Vocabulary.from_itos(state["class_names"], unk=UNK)
        self._examples.clear()

    # ------------------------------------------------------------------ examples
    def examples(self, stage: str) -> list[Example]:
        """Encoded examples of ``train`` / ``val`` / ``test`` / ``predict`` (cached)."""
        if stage in self._examples:
            return self._examples[stage]
        self._build_vocabularies()
        hp = self.hparams
        if stage == "predict":
            path = Path(hp.predict_file) if hp.predict_file else self._split_path(self.splits["test"], hp.src_lang)
            if not path.exists():
                raise ValueError(f"predict_file {path} does not exist (set data.init_args.predict_file)")
            source_lines, target_lines = read_lines(path), []
            source_name = str(path)
        else:
            split = self.splits[stage]
            source_path = self._split_path(split, hp.src_lang)
            source_lines, target_lines = read_parallel(source_path, self._split_path(split, hp.tgt_lang))
            source_name = str(source_path)
        examples, dropped = [], 0
        for index, source_line in enumerate(source_lines):
            reference = target_lines[index] if target_lines else None
            source_ids = self.source_vocab.encode(self.source_tokenizer.tokenize(source_line))
            target_ids = self.target_vocab.encode(self.target_tokenizer.tokenize(reference)) if reference is not None else None
            if stage == "train":
                if not source_ids or not target_ids or max(len(source_ids), len(target_ids)) > hp.max_train_length:
                    dropped += 1
                    continue
            elif not source_ids and hp.empty_source == "error":
                raise ValueError(
                    f"{source_name} line {index + 1} is empty and empty_source='error' "
                    f"(remove the line or set data.init_args.empty_source: translate)"
                )
            if reference is not None and self.target_tokenizer.kind == "presegmented":
                reference = self.target_tokenizer.detokenize(reference.split())  # BLEU on words, not pieces
            examples.append(Example(index, source_ids, target_ids, source_line, reference))
        if dropped:
            print(f"translation data: dropped {dropped} of {len(source_lines)} training pairs (empty side or longer than {hp.max_train_length} pieces)")
        if not examples:
            raise ValueError(f"{source_name} gives no usable {stage} sentences")
        self._examples[stage] = examples
        return examples

    def class_counts(self) -> torch.Tensor:
        """``(num_classes,)`` occurrences of each target id in the training targets the decoder
        predicts (every sentence's pieces plus its EOS); heads start their biases from it."""
        examples = self.examples("train")
        ids = torch.tensor([t for e in examples for t in e.target], dtype=torch.long)
        counts = torch.bincount(ids, minlength=self.num_classes)
        counts[EOS_ID] += len(examples)
        return counts

    # ------------------------------------------------------------------ loaders
    def _current_epoch(self) -> int:
        trainer = getattr(self, "trainer", None)
        return trainer.current_epoch if trainer is not None else 0

    def _loader(self, stage: str) -> DataLoader:
        hp = self.hparams
        rank, world_size = rank_and_world(self)
        training = stage == "train"
        stream = TokenBatchStream(
            self.examples(stage),
            max_tokens=hp.max_tokens if training else (hp.eval_max_tokens or hp.max_tokens),
            max_sentences=hp.max_sentences,
            shuffle=training,
            seed=hp.seed,
            rank=rank,
            world_size=world_size,
            even=training,
            epoch_fn=self._current_epoch if training else None,
        )
        if training:  # resumes mid-epoch (datamodules/resumable.py): the same token batches for the same epoch
            return training_loader(stream, batch_size=None, num_workers=hp.num_workers)
        return DataLoader(stream, batch_size=None, num_workers=hp.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")


def check_tokenizer_state(
    state: DataState | None, where: str = "checkpoint", configured: str | None = None, saved_setting: bool = False,
) -> tuple[TextTokenizer, TextTokenizer]:
    """The checkpoint's ``(source, target)`` tokenizers, rebuilt from its ``datamodule_state``;
    a checkpoint that cannot encode its inputs or detokenise its own predictions is refused in one
    line naming ``where`` (``checkpoint <path>``): no tokenizer state, a state that does not rebuild
    its tokenizer (:meth:`TextTokenizer.from_state`), or a saved kind other than ``configured``,
    the tokenizer the data is configured with (text would be tokenised otherwise than in
    training): the command line's ``data.init_args.tokenizer``, or with ``saved_setting`` the
    checkpoint's own ``datamodule_hyper_parameters.tokenizer`` (a model restored without its data)."""
    required = ("class_names", "tokenizer", "source_vocabulary", "source_tokenizer")
    missing = [key for key in required if not state or state.get(key) is None]
    if missing:
        raise ValueError(
            f"{where} has no tokenizer model (missing datamodule_state {', '.join(missing)}): it was not "
            f"saved by TranslationTask with a TranslationDataModule; retrain or use a checkpoint that has one"
        )
    tokenizers = []
    for key in ("source_tokenizer", "tokenizer"):
        saved, entry = state[key], f"datamodule_state.{key}"
        kind = saved.get("kind") if isinstance(saved, dict) else None
        if configured is not None and kind in TOKENIZER_KINDS and kind != configured:  # an unknown kind: from_state names it
            if saved_setting:
                raise ValueError(f"{where}: {entry}.kind is {kind!r} but its datamodule_hyper_parameters.tokenizer is "
                                 f"{configured!r}, and a run saves the tokenizer it trained with; {CHECKPOINT_FIX}")
            raise ValueError(
                f"{where}: {entry}.kind is {kind!r} but the data is configured with tokenizer {configured!r} "
                f"(data.init_args.tokenizer), so text would be tokenised otherwise than in training: set "
                f"data.init_args.tokenizer to the tokenizer it was trained with, or, if that was {configured!r}, {CHECKPOINT_FIX}"
            )
        tokenizers.append(TextTokenizer.from_state(saved, entry, where))
    source, target = tokenizers
    return source, target
