"""The download path against a loopback HTTP server serving generated files (no internet).

Proves: files arrive verified (MD5 and SHA-256), archives are unpacked to the expected names,
a wrong checksum is a one-line error that leaves no file (not even a ``.part``), a file
without a known checksum is kept with a one-line warning, and an unreachable server gives a
one-line error.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import io
import logging
import threading
import zipfile
from pathlib import Path

import pytest

from datamodules import Multi30kCaptions, TextCorpus
from datamodules import multi30k_captions, text_corpus
from datamodules.download import download_file, file_checksum

PTB_LINES = {
    "ptb.train.txt": " the cat sat \n the dog <unk> on the mat \n",
    "ptb.valid.txt": " the cat \n",
    "ptb.test.txt": " a dog sat \n",
}


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - keep pytest output clean
        pass


@pytest.fixture
def served(tmp_path):
    """(directory, base URL) of a loopback HTTP server; files put in the directory are served."""
    root = tmp_path / "served"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join()


def serve_ptb(root: Path, monkeypatch) -> None:
    for name, text in PTB_LINES.items():
        (root / name).write_text(text, encoding="utf-8")
        # The test computes the checksum of what it serves; the module constant is patched.
        monkeypatch.setitem(text_corpus.PTB_MD5, name, hashlib.md5(text.encode()).hexdigest())


def test_ptb_download_verifies_md5_and_loads(served, tmp_path, monkeypatch):
    root, url = served
    serve_ptb(root, monkeypatch)
    data_dir = tmp_path / "data" / "ptb"
    dm = TextCorpus("ptb", str(data_dir), download=True, base_url=url)
    dm.prepare_data()
    for name, text in PTB_LINES.items():
        assert (data_dir / name).read_text(encoding="utf-8") == text
        assert file_checksum(data_dir / name, "md5") == text_corpus.PTB_MD5[name]
    assert dm.vocabulary.itos[:4] == ["<unk>", "<eos>", "the", "cat"]
    assert not list(data_dir.glob("*.part"))


def test_num_classes_downloads_when_read_before_prepare_data(served, tmp_path, monkeypatch):
    # The CLI links data.num_classes at instantiation, before Lightning calls prepare_data.
    root, url = served
    serve_ptb(root, monkeypatch)
    dm = TextCorpus("ptb", str(tmp_path / "fresh"), download=True, base_url=url)
    assert dm.num_classes == 8  # <unk> <eos> the cat sat dog on mat


def test_wrong_checksum_is_one_line_error_and_leaves_nothing(served, tmp_path, monkeypatch):
    root, url = served
    serve_ptb(root, monkeypatch)
    monkeypatch.setitem(text_corpus.PTB_MD5, "ptb.valid.txt", "0" * 32)
    data_dir = tmp_path / "data"
    with pytest.raises(ValueError, match=r"checksum mismatch for .*ptb\.valid\.txt: expected 0{32}, got [0-9a-f]{32}") as error:
        TextCorpus("ptb", str(data_dir), download=True, base_url=url).prepare_data()
    assert "\n" not in str(error.value)
    assert not (data_dir / "ptb.valid.txt").exists()
    assert not list(data_dir.glob("*.part"))


def test_wikitext2_zip_is_verified_and_unpacked(served, tmp_path, monkeypatch):
    root, url = served
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for split, name in text_corpus.WIKITEXT2_FILES.items():
            archive.writestr(f"wikitext-2/{name}", f"\n = {split} = \n\n the {split} text \n\n")
    (root / "wikitext-2-v1.zip").write_bytes(buffer.getvalue())
    monkeypatch.setattr(text_corpus, "WIKITEXT2_SHA256", hashlib.sha256(buffer.getvalue()).hexdigest())
    data_dir = tmp_path / "wt2"
    dm = TextCorpus("wikitext2", str(data_dir), download=True, base_url=url)
    dm.prepare_data()
    assert sorted(p.name for p in data_dir.iterdir()) == sorted(text_corpus.WIKITEXT2_FILES.values())
    assert dm.vocabulary.decode(dm.split("test").tolist()) == ["=", "<unk>", "=", "<eos>", "the", "<unk>", "text", "<eos>"]


def test_wikitext2_wrong_checksum_leaves_no_archive_or_scratch(served, tmp_path, monkeypatch):
    root, url = served
    (root / "wikitext-2-v1.zip").write_bytes(b"not the real zip")
    data_dir = tmp_path / "wt2"
    with pytest.raises(ValueError, match="checksum mismatch"):
        TextCorpus("wikitext2", str(data_dir), download=True, base_url=url).prepare_data()
    assert list(data_dir.iterdir()) == []


def test_multi30k_download_to_data_dir(served, tmp_path, monkeypatch):
    root, url = served
    for relative in [f for files in multi30k_captions.MULTI30K_FILES.values() for f in files]:
        task, name = relative.split("/")
        payload = gzip.compress(f"A caption from {name}.\nAnother one.\n".encode())
        (root / task / "raw").mkdir(parents=True, exist_ok=True)
        (root / task / "raw" / name).write_bytes(payload)
        monkeypatch.setitem(multi30k_captions.MULTI30K_SHA256, relative, hashlib.sha256(payload).hexdigest())
    data_dir = tmp_path / "m30k"
    dm = Multi30kCaptions(str(data_dir), download=True, base_url=url, cache=False)
    dm.prepare_data()
    assert (data_dir / "task1" / "test_2016_flickr.en.gz").is_file()
    assert len(list((data_dir / "task2").glob("*.en.gz"))) == 10
    assert int((dm.split("test") == dm.eos_index).sum()) == 2


def test_unknown_checksum_keeps_file_with_warning(served, tmp_path, caplog):
    root, url = served
    (root / "file.txt").write_text("payload")
    with caplog.at_level(logging.WARNING, logger="datamodules.download"):
        path = download_file(url + "file.txt", tmp_path / "out" / "file.txt", None)
    assert path.read_text() == "payload"
    (record,) = [r for r in caplog.records if "unverified" in r.getMessage()]
    assert "\n" not in record.getMessage()


def test_sha256_checksum_and_bad_checksum_format(served, tmp_path):
    root, url = served
    (root / "f.bin").write_bytes(b"\x00\x01" * 1000)
    good = hashlib.sha256(b"\x00\x01" * 1000).hexdigest()
    assert download_file(url + "f.bin", tmp_path / "f.bin", good).read_bytes() == b"\x00\x01" * 1000
    with pytest.raises(ValueError, match="neither an MD5 .* nor a SHA-256"):
        download_file(url + "f.bin", tmp_path / "g.bin", "abc")


def test_a_file_the_server_does_not_have_is_one_line_error(served, tmp_path):
    root, url = served
    with pytest.raises(ValueError, match=r"could not download .*missing\.txt \(HTTP 404 .*\); check the network") as error:
        download_file(url + "missing.txt", tmp_path / "missing.txt", None)
    assert "\n" not in str(error.value) and not list(tmp_path.glob("missing.txt*"))
    assert f"put it at {(tmp_path / 'missing.txt').resolve()}" in str(error.value)


def test_unreachable_server_is_one_line_error(tmp_path):
    # A port that was just bound and closed: the connection is refused, as with a server down.
    url = f"http://127.0.0.1:{closed_port()}/"
    with pytest.raises(ValueError, match=r"could not download .*f\.txt \(.*refused.*\); check the network") as error:
        download_file(url + "f.txt", tmp_path / "out" / "f.txt", "0" * 64, timeout=5)
    assert "\n" not in str(error.value) and not list((tmp_path / "out").iterdir())


def closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class _CutHandler(http.server.BaseHTTPRequestHandler):
    """Announces 1000 bytes, sends 10 and hangs up: a connection cut mid-file."""

    def do_GET(self):  # noqa: N802 - the http.server hook name
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b"0123456789")

    def log_message(self, format, *args):  # noqa: A002
        pass


def test_a_connection_cut_mid_file_is_one_line_error_and_leaves_nothing(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CutHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        with pytest.raises(ValueError, match=r"could not download .*big\.bin \(.*\); check the network") as error:
            download_file(f"http://127.0.0.1:{server.server_address[1]}/big.bin", tmp_path / "big.bin", None, timeout=5)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert "\n" not in str(error.value) and list(tmp_path.iterdir()) == []
