"""Reading corpus files and tokenising captions, shared by every text data source.

* :func:`read_lines` opens plain or gzip-compressed files (detected by the gzip magic bytes,
  not the file name) and decodes each line as UTF-8, so a bad byte is reported with the
  file and the 1-based line number instead of a bare ``UnicodeDecodeError`` from deep
  inside a data loader. A damaged gzip file (bad header, corrupt deflate stream, cut short)
  is reported the same way, as one ``ValueError`` naming the file and the last good line.
* :func:`read_corpus` additionally refuses an empty file (no non-blank line), because an
  empty split silently yields a zero-length stream and a division by zero much later.
* :func:`ptb_tokenize` is the small Penn-Treebank-style word tokeniser used for raw
  captions (Multi30K): see its docstring for the exact rules.
"""

from __future__ import annotations

import gzip
import re
import zlib
from pathlib import Path
from typing import IO, Iterator

_GZIP_MAGIC = b"\x1f\x8b"


def _open_binary(path: Path) -> IO[bytes]:
    with open(path, "rb") as probe:
        magic = probe.read(2)
    return gzip.open(path, "rb") if magic == _GZIP_MAGIC else open(path, "rb")


def read_lines(path: str | Path) -> Iterator[str]:
    """Yield the lines of a plain or gzip text file, decoded as UTF-8, without newlines.

    Raises:
        ValueError: on a line that is not valid UTF-8, naming the file and line number; on a
            corrupt or truncated gzip file, naming the file and the last line read.
        OSError: the file cannot be opened (missing, unreadable).
    """
    path = Path(path)
    number = 0
    with _open_binary(path) as handle:
        lines = enumerate(handle, start=1)
        while True:
            try:
                number, raw = next(lines)
            except StopIteration:
                return
            except (EOFError, zlib.error, gzip.BadGzipFile) as error:
                # gzip reports damage lazily, while lines are read: name where it happened.
                raise ValueError(
                    f"{path}: corrupt or truncated gzip file after line {number} ({error}); "
                    f"re-download or re-compress it (`gzip -t {path.name}` checks it)"
                ) from None
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"{path}:{number}: line is not valid UTF-8 (byte 0x{raw[error.start]:02x} at "
                    f"column {error.start + 1}); re-encode the file as UTF-8, e.g. "
                    f"`iconv -f latin1 -t utf-8`"
                ) from None
            yield line.rstrip("\r\n")


def read_corpus(path: str | Path) -> list[str]:
    """All lines of a corpus file (see :func:`read_lines`); an empty file is an error.

    Raises:
        ValueError: when the file has no non-blank line, or on a non-UTF-8 line.
    """
    lines = list(read_lines(path))
    if not any(line.strip() for line in lines):
        raise ValueError(
            f"corpus file {path} is empty (no non-blank line); put one sentence per line "
            f"in it or point the data module at the right file"
        )
    return lines


# Clitics split off the word before them, as in the Penn Treebank: "don't" -> "do n't",
# "dog's" -> "dog 's", "they're" -> "they 're". Applied before the token pattern so the
# pattern sees the clitic as its own word.
_CLITIC = re.compile(r"(?i)(?<=\w)(n't|'s|'re|'ve|'ll|'d|'m)\b")
# One token: an ellipsis; a number with decimal/thousand separators; a word with inner
# hyphens or apostrophes ("t-shirt", "o'clock"); a clitic; or any single other symbol.
_TOKEN = re.compile(r"\.\.\.|\d+(?:[.,]\d+)+|\w+(?:[-']\w+)*|'\w+|[^\w\s]")


def ptb_tokenize(text: str, lower: bool = True) -> list[str]:
    """Split a raw sentence into Penn-Treebank-style word tokens.

    Rules (deliberately few, so they are easy to predict):

    1. optionally lower-case;
    2. split clitics off the word they follow: ``n't 's 're 've 'll 'd 'm``;
    3. keep words with inner hyphens or apostrophes whole (``t-shirt``, ``o'clock``) and
       numbers with separators whole (``3.5``, ``1,000``);
    4. every other non-space symbol is its own token (``.`` ``,`` ``"`` ``(`` ...), with
       ``...`` kept as one token.

    Example: ``"A man's dog doesn't bark, 3.5 times."`` ->
    ``a man 's dog does n't bark , 3.5 times .``
    """
    if lower:
        text = text.lower()
    text = _CLITIC.sub(r" \1", text)
    return _TOKEN.findall(text)
