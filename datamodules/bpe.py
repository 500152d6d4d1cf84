"""Sub-word and word tokenisers for parallel text, serialisable into a checkpoint.

A :class:`TextTokenizer` turns a line into string pieces and back. Two kinds:

* ``bpe``: a sentencepiece BPE model (Sennrich et al. 2016; sentencepiece's implementation)
  trained on the training split. The trained model is cached on disk under a key made of
  the training text's digest and the settings, so a second run reuses it, and its
  serialised proto travels with the checkpoint so a model always detokenises with the
  exact segmentation it was trained on.
* ``word``: whitespace tokens; detokenisation joins them with spaces.
* ``presegmented``: text already split into subword-nmt pieces (``Wort@@ teil``), as in
  fairseq's prepared IWSLT'14; pieces are whitespace tokens and detokenisation joins them and
  removes the ``@@`` continuation markers (references are normalised the same way).

Ids are *not* taken from sentencepiece: sentencepiece orders BPE pieces by merge order,
while the heads here need frequency order, so the datamodule builds a
:class:`datamodules.vocab.Vocabulary` over the pieces it actually sees.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

from datamodules.files import CHECKPOINT_FIX, write_atomically

TOKENIZER_KINDS = ("bpe", "word", "presegmented")
#: subword-nmt's continuation marker (fairseq's prepare-iwslt14.sh output is segmented with it).
CONTINUATION = "@@"


class TextTokenizer:
    """Line <-> pieces for one language side (or both, for a joint BPE model).

    Args:
        kind: ``"bpe"`` or ``"word"``.
        model_proto: serialised sentencepiece model (``bpe`` only).
        lowercase: lower-case lines before segmentation.
    """

    def __init__(self, kind: str, model_proto: bytes | None = None, lowercase: bool = False) -> None:
        if kind not in TOKENIZER_KINDS:
            raise ValueError(f"unknown tokenizer {kind!r}: valid kinds are {', '.join(TOKENIZER_KINDS)} (set data.init_args.tokenizer)")
        if kind == "bpe" and not model_proto:
            raise ValueError("a bpe tokenizer needs its sentencepiece model proto (train one with train_bpe)")
        self.kind = kind
        self.lowercase = lowercase
        self.model_proto = model_proto
        self._processor = None
        if kind == "bpe":
            import sentencepiece as spm

            self._processor = spm.SentencePieceProcessor(model_proto=model_proto)

    def tokenize(self, line: str) -> list[str]:
        """Pieces of one line (no specials)."""
        line = line.strip()
        if self.lowercase:
            line = line.lower()
        if not line:
            return []
        if self._processor is None:
            return line.split()
        return self._processor.encode(line, out_type=str)

    def detokenize(self, pieces: Sequence[str]) -> str:
        """Text from pieces: sentencepiece restores its ``▁`` word boundaries; words join by
        spaces; subword-nmt pieces also lose their ``@@`` markers."""
        if self.kind == "presegmented":
            text = " ".join(pieces).replace(f"{CONTINUATION} ", "")
            return text[: -len(CONTINUATION)] if text.endswith(CONTINUATION) else text
        if self._processor is None:
            return " ".join(pieces)
        return self._processor.decode_pieces(list(pieces))

    def state(self) -> dict:
        """Everything needed to rebuild this tokenizer (goes into checkpoints)."""
        return {"kind": self.kind, "model_proto": self.model_proto, "lowercase": self.lowercase}

    @classmethod
    def from_state(cls, state: dict, entry: str = "tokenizer", where: str = "checkpoint") -> "TextTokenizer":
        """The tokenizer :meth:`state` describes. A state that does not describe one (a kind that
        does not exist, a ``lowercase`` that is not a boolean, a ``bpe`` model proto that is not
        bytes or that sentencepiece cannot load, a proto beside a ``word`` or ``presegmented``
        kind, which saves none) is one line naming ``where`` (``checkpoint <path>``) and the entry
        (``entry``: ``datamodule_state.source_tokenizer``), never a traceback from sentencepiece."""
        if not isinstance(state, dict):
            raise refused_state(where, entry, "a tokenizer's dictionary (kind, model_proto, lowercase)", state)
        kind, proto, lowercase = state.get("kind"), state.get("model_proto"), state.get("lowercase", False)
        if not isinstance(kind, str) or kind not in TOKENIZER_KINDS:
            raise refused_state(where, f"{entry}.kind", f"one of {', '.join(TOKENIZER_KINDS)}", kind)
        if not isinstance(lowercase, bool):
            raise refused_state(where, f"{entry}.lowercase", "true or false", lowercase)
        if kind != "bpe":
            if proto is not None:
                raise refused_state(where, f"{entry}.model_proto", f"null for a {kind} tokenizer (only bpe saves a model)", proto)
            return cls(kind, None, lowercase)
        if not isinstance(proto, bytes) or not proto:
            raise refused_state(where, f"{entry}.model_proto", "the bytes of a sentencepiece model", proto)
        try:
            # after the checks above only sentencepiece's load of the proto raises these
            return cls(kind, proto, lowercase)
        except (RuntimeError, TypeError) as error:
            reason = " ".join(str(error).split())
            reason = reason[:120] + ("…" if len(reason) > 120 else "")
            raise ValueError(
                f"{where}: {entry}.model_proto is {len(proto)} bytes that sentencepiece cannot load as a model ({reason}); "
                f"{CHECKPOINT_FIX}"
            ) from None


def refused_state(where: str, entry: str, rule: str, value: object) -> ValueError:
    """The one line of a tokenizer state entry that breaks ``rule``: ``where`` (``checkpoint
    <path>``), the entry, the rule, what it holds and :data:`CHECKPOINT_FIX`."""
    if isinstance(value, bytes):
        held = f"{len(value)} bytes" if value else "empty bytes"
    else:
        shown = " ".join(repr(value).split())
        held = f"{type(value).__name__} {shown[:40]}{'…' if len(shown) > 40 else ''}"
    return ValueError(f"{where}: {entry} must be {rule}, got {held}; {CHECKPOINT_FIX}")


def text_digest(lines: Iterable[str], *settings: object) -> str:
    """A short content hash of ``lines`` and the settings, used as the cache key."""
    digest = hashlib.sha256(repr(settings).encode())
    for line in lines:
        digest.update(line.encode("utf-8"))
        digest.update(b"\n")
    return digest.hexdigest()[:16]


def train_bpe(
    lines: Sequence[str],
    vocab_size: int,
    cache_dir: str | os.PathLike | None,
    lowercase: bool = False,
    character_coverage: float = 1.0,
    seed: int = 0,
) -> bytes:
    """Train (or load from ``cache_dir``) a sentencepiece BPE model on ``lines``.

    Returns the serialised model proto. ``vocab_size`` counts sentencepiece's own
    ``<unk>``; when the text is too small for that many pieces, sentencepiece refuses and
    the error says so with the largest size it could reach.
    """
    import sentencepiece as spm

    if vocab_size < 8:
        raise ValueError(f"bpe needs vocab_size >= 8, got {vocab_size} (set data.init_args.vocab_size)")
    if lowercase:
        lines = [line.lower() for line in lines]
    key = text_digest(lines, "bpe", vocab_size, character_coverage, seed)
    cached = Path(cache_dir) / f"bpe-{key}.model" if cache_dir is not None else None
    if cached is not None and cached.exists():
        return cached.read_bytes()
    model = io.BytesIO()
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", delete=False) as handle:
        for line in lines:
            if line.strip():
                handle.write(line.strip() + "\n")
        corpus = handle.name
    try:
        spm.SentencePieceTrainer.train(
            input=corpus,
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            character_coverage=character_coverage,
            # Ids come from our own frequency-ordered vocabulary: sentencepiece keeps only <unk>.
            bos_id=-1,
            eos_id=-1,
            pad_id=-1,
            unk_id=0,
            hard_vocab_limit=False,
            num_threads=1,
            minloglevel=2,
        )
    except RuntimeError as error:
        raise ValueError(
            f"sentencepiece could not train a {vocab_size}-piece BPE model on {len(lines)} lines: {error} "
            f"(a small corpus needs a smaller data.init_args.vocab_size)"
        ) from None
    finally:
        os.unlink(corpus)
    proto = model.getvalue()
    if cached is not None:  # atomic: concurrent DDP ranks never read half a file
        write_atomically(cached, proto, "BPE model", "free space or set data.init_args.cache_dir (bpe_cache_dir) elsewhere")
    return proto


#: Ids of the sequence specials in every translation and captioning vocabulary
#: (``<pad>``, ``<unk>``, ``<bos>``, ``<eos>`` come first, in this order).
PAD_ID, UNK_ID, BOS_ID, EOS_ID = range(4)


def decode_ids(ids: Sequence[int], itos: Sequence[str], tokenizer: TextTokenizer) -> str:
    """Detokenised text of ids (``itos``: the piece of every id), stopping at EOS and skipping the
    other specials."""
    pieces = []
    for i in ids:
        i = int(i)
        if i == EOS_ID:
            break
        if i in (PAD_ID, BOS_ID):
            continue
        pieces.append(itos[i])
    return tokenizer.detokenize(pieces)
