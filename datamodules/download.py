"""Checksummed downloads shared by the data sources.

``torch.hub.download_url_to_file`` fetches the file into a temporary file of its own beside the
path it is given and renames it there when the transfer is complete. That path is itself a
temporary file of :func:`datamodules.files.atomic_path` (the project's one atomic writer), renamed
into place only once its checksum matches, so an interrupted or corrupt download never leaves a
file that a later run would mistake for the real one, and a full disk is one line
(:class:`datamodules.files.FileWriteError`). Checksums are hex strings; the algorithm follows from
the length (32 hex digits: MD5, 64: SHA-256) so the constants can be copied from wherever the
dataset publishes them. A file without a pinned checksum is never downloaded.

Every other failure is one ``ValueError`` line (the CLI prints it as ``error: ...``, exit code 2):
an unreachable server, an HTTP error or a timeout names the URL and the absolute path where the
file is expected, so it can be fetched elsewhere and put there. A connection cut mid-file is a
checksum mismatch (urllib ends a short read quietly and the library does not compare the bytes
with ``Content-Length``).

Archive extraction reuses :func:`torchvision.datasets.utils.extract_archive` (zip, tar,
tgz, ...); only the members a data source needs are moved into its directory, each through
the same atomic writer.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import socket
import tempfile
import urllib.error
from pathlib import Path
from typing import Iterator, Mapping

import torch
from torchvision.datasets.utils import extract_archive

from datamodules.files import DISK_ERRORS, atomic_path


_CHUNK = 1 << 20


def _algorithm(checksum: str) -> str:
    if len(checksum) == 32:
        return "md5"
    if len(checksum) == 64:
        return "sha256"
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


@contextlib.contextmanager
def _socket_timeout(seconds: float) -> Iterator[None]:
    """``torch.hub`` opens the URL without a timeout, so urllib waits as long as the socket
    module's default: set it for the duration of one download."""
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


def download_file(url: str, target: str | Path, checksum: str | None, timeout: float = 60.0) -> Path:
    """Download ``url`` to ``target``, verifying ``checksum`` before the file appears. A file with
    no pinned checksum (``None``) is never downloaded: nothing unverified reaches the disk.

    Args:
        timeout: seconds a connection attempt or a read may wait for the server.

    Raises:
        ValueError: the URL could not be fetched (no network, HTTP error, timeout) or the
            checksum does not match; the partial file is removed in every case.
        FileWriteError: the disk is full (or read-only); nothing was written.
    """
    target = Path(target)
    if checksum is None:
        raise ValueError(
            f"cannot download {url}: no checksum is pinned for {target.name}, and nothing is downloaded unverified; "
            f"fetch the file yourself and put it at {target.resolve()} (or turn download off)"
        )
    algorithm = _algorithm(checksum)
    # A temporary file of its own per call: DDP ranks that all read num_classes before
    # Lightning's rank-0 prepare_data may download at once; each renames its own verified copy.
    with atomic_path(target, "download", "free space or put the file there yourself") as partial:
        try:
            with _socket_timeout(timeout):
                # The digest is computed below from the file, for both algorithms: the error line
                # names the one received, which the library's hash_prefix check does not return.
                torch.hub.download_url_to_file(url, str(partial), progress=False)
        except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
            if isinstance(error, OSError) and error.errno in DISK_ERRORS:
                raise  # atomic_path: one line naming the file and the disk error
            if isinstance(error, urllib.error.HTTPError):
                reason = f"HTTP {error.code} {error.reason}"
            else:
                reason = str(getattr(error, "reason", None) or error) or type(error).__name__
            raise ValueError(
                f"could not download {url} ({reason}); check the network, or fetch the file on a machine "
                f"with network access and put it at {target.resolve()}"
            ) from None
        got = file_checksum(partial, algorithm)
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
