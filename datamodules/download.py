"""Checksummed downloads shared by the data sources.

A download goes to a temporary file beside the target while its hash is computed on the fly;
only a file whose checksum matches is renamed into place (:func:`datamodules.files.atomic_path`,
the project's one atomic writer), so an interrupted or corrupt download never leaves a file that
a later run would mistake for the real one. Checksums are hex strings; the algorithm follows from the
length (32 hex digits: MD5, 64: SHA-256) so the constants can be copied from wherever the
dataset publishes them. A checksum of ``None`` means "no trusted hash known": the file is
kept and a one-line warning says it is unverified.

Every failure is one ``ValueError`` line (the CLI prints it as ``error: ...``, exit code 2):
an unreachable server, an HTTP error, a timeout or a connection cut mid-file names the URL and
the absolute path where the file is expected, so it can be fetched elsewhere and put there.

Archive extraction reuses :func:`torchvision.datasets.utils.extract_archive` (zip, tar,
tgz, ...); only the members a data source needs are moved into its directory, each through
the same atomic writer.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping

from torchvision.datasets.utils import extract_archive

from datamodules.files import atomic_path


_CHUNK = 1 << 20


def _hash_for(checksum: str | None) -> "hashlib._Hash":
    if checksum is None:
        return hashlib.sha256()
    if len(checksum) == 32:
        return hashlib.md5()
    if len(checksum) == 64:
        return hashlib.sha256()
    raise ValueError(
        f"checksum {checksum!r} is neither an MD5 (32 hex digits) nor a SHA-256 (64 hex digits); "
        f"pass the hex digest the dataset publishes, or None for an unverified download"
    )


def file_checksum(path: str | Path, algorithm: str = "sha256") -> str:
    """Hex digest of a file (``"sha256"`` or ``"md5"``), read in 1 MiB chunks."""
    digest = hashlib.new(algorithm)
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_file(url: str, target: str | Path, checksum: str | None, timeout: float = 60.0) -> Path:
    """Download ``url`` to ``target``, verifying ``checksum`` before the file appears. A file with
    no pinned checksum (``None``) is never downloaded: nothing unverified reaches the disk.

    Args:
        timeout: seconds a connection attempt or a read may wait for the server.

    Raises:
        ValueError: the URL could not be fetched (no network, HTTP error, timeout, connection
            cut) or the checksum does not match; the partial file is removed in every case.
    """
    target = Path(target)
    if checksum is None:
        raise ValueError(
            f"cannot download {url}: no checksum is pinned for {target.name}, and nothing is downloaded unverified; "
            f"fetch the file yourself and put it at {target.resolve()} (or turn download off)"
        )
    digest = _hash_for(checksum)
    # A temporary file of its own per call: DDP ranks that all read num_classes before
    # Lightning's rank-0 prepare_data may download at once; each renames its own verified copy.
    with atomic_path(target, "download", "free space or put the file there yourself") as partial:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(partial, "wb") as out:
                received = 0
                for chunk in iter(lambda: response.read(_CHUNK), b""):
                    digest.update(chunk)
                    out.write(chunk)
                    received += len(chunk)
                # Chunked reads end quietly when the server hangs up early; without a checksum
                # only the announced length tells a cut-off file from a complete one.
                announced = response.headers.get("Content-Length")
                if announced is not None and announced.isdigit() and received != int(announced):
                    raise http.client.IncompleteRead(b"", int(announced) - received)
        except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
            if isinstance(error, urllib.error.HTTPError):
                reason = f"HTTP {error.code} {error.reason}"
            else:
                reason = str(getattr(error, "reason", None) or error) or type(error).__name__
            raise ValueError(
                f"could not download {url} ({reason}); check the network, or fetch the file on a machine "
                f"with network access and put it at {target.resolve()}"
            ) from None
        got = digest.hexdigest()
        if got.lower() != checksum.lower():
            raise ValueError(
                f"checksum mismatch for {url}: expected {checksum}, got {got}; the download is corrupt "
                f"or changed upstream, nothing was kept (retry, or put a verified copy at {target.resolve()})"
            )
    return target


def download_archive_members(
    url: str,
    checksum: str | None,
    members: Mapping[str, str],
    destination: str | Path,
) -> list[Path]:
    """Download an archive, verify it, and move ``members`` (archive path -> file name) into
    ``destination``. The archive and the other members are discarded.

    Raises:
        ValueError: checksum mismatch, or a listed member missing from the archive.
    """
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    archive_name = url.rstrip("/").rsplit("/", 1)[-1] or "archive"
    # Extract beside the destination (same file system) so the final moves are renames.
    with tempfile.TemporaryDirectory(dir=destination, prefix=".extract-") as scratch:
        archive = download_file(url, Path(scratch) / archive_name, checksum)
        extracted = Path(scratch) / "contents"
        extract_archive(str(archive), str(extracted))
        moved = []
        for member, name in members.items():
            source = extracted / member
            if not source.is_file():
                raise ValueError(
                    f"archive {url} has no member {member!r}; the file layout changed upstream, "
                    f"put the files in {destination} yourself"
                )
            with atomic_path(destination / name, "file", "free space or put the files there yourself") as member_path:
                os.replace(source, member_path)  # same file system: a rename, then fsync and rename into place
            moved.append(destination / name)
    return moved
