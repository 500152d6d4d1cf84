"""The download path against a loopback HTTP server serving generated files (no internet).

Proves: files arrive verified (MD5 and SHA-256), archives are unpacked to the expected names,
a wrong checksum is a one-line error that leaves no file (not even a ``.part``), a file
without a known checksum is kept with a one-line warning, and an unreachable server, an HTTP
error or a connection cut mid-file gives a one-line error. The translation source downloads
through the same path, before the CLI first reads its vocabulary, and its failures reach the
shell as one ``error:`` line (exit code 2, no traceback).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import io
import threading
import zipfile
from pathlib import Path

import pytest

from app.main import main
from datamodules import Multi30kCaptions, TextCorpus
from datamodules import multi30k_captions, text_corpus, translation
from datamodules.download import download_file, file_checksum
from datamodules.translation import TranslationDataModule
from tests.shell import one_error_line, run_cli

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


def test_a_file_without_a_pinned_checksum_is_never_downloaded(served, tmp_path):
    """No unverified byte reaches the disk: a download needs the file's pinned checksum."""
    root, url = served
    (root / "file.txt").write_text("payload")
    with pytest.raises(ValueError, match=r"cannot download .*file\.txt: no checksum is pinned .* put it at") as error:
        download_file(url + "file.txt", tmp_path / "out" / "file.txt", None)
    assert "\n" not in str(error.value) and not (tmp_path / "out").exists()


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
        download_file(url + "missing.txt", tmp_path / "missing.txt", "0" * 64)
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


class _SilentHandler(http.server.BaseHTTPRequestHandler):
    """Accepts the request and answers nothing until the test releases it: a stalled server."""

    release = threading.Event()

    def do_GET(self):  # noqa: N802 - the http.server hook name
        self.release.wait(10)

    def log_message(self, format, *args):  # noqa: A002
        pass


def test_a_stalled_server_times_out_with_one_line_error(tmp_path):
    _SilentHandler.release.clear()  # set at the end of an earlier run of this test in the same process
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SilentHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        with pytest.raises(ValueError, match=r"could not download .*slow\.bin \(timed out\); check the network") as error:
            download_file(f"http://127.0.0.1:{server.server_address[1]}/slow.bin", tmp_path / "slow.bin", "0" * 64, timeout=0.3)
    finally:
        _SilentHandler.release.set()
        server.shutdown()
        server.server_close()
        thread.join()
    assert "\n" not in str(error.value) and list(tmp_path.iterdir()) == []


def test_a_connection_cut_mid_file_is_one_line_error_and_leaves_nothing(tmp_path):
    """urllib ends the short read quietly: the 10 bytes received do not have the pinned checksum."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CutHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        with pytest.raises(ValueError, match=r"checksum mismatch for .*big\.bin: expected 0{64}, got "
                                             + hashlib.sha256(b"0123456789").hexdigest()) as error:
            download_file(f"http://127.0.0.1:{server.server_address[1]}/big.bin", tmp_path / "big.bin", "0" * 64, timeout=5)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert "\n" not in str(error.value) and list(tmp_path.iterdir()) == []


FULL_DISK_DOWNLOAD = """
import resource, signal, sys
from datamodules.download import download_file

resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, as on a full disk
try:
    download_file(sys.argv[1], sys.argv[2], sys.argv[3])
except ValueError as error:
    print(error)
"""


@pytest.mark.slow  # a file-size limit on a process of its own
def test_a_full_disk_during_a_download_is_one_line_and_leaves_nothing(served, tmp_path):
    import os
    import subprocess
    import sys

    root, url = served
    payload = b"\x07" * 20000
    (root / "big.bin").write_bytes(payload)
    target = tmp_path / "out" / "big.bin"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", FULL_DISK_DOWNLOAD, url + "big.bin", str(target), hashlib.sha256(payload).hexdigest()],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == (f"cannot write download {target}: File too large; nothing was written; free space or put the "
                           f"file there yourself\n"), done.stdout
    assert list(target.parent.iterdir()) == [], "no temporary file left"


# ---------------------------------------------------------------------------------- translation
# Multi30K task 1 through TranslationDataModule(download=True): the CLI reads num_classes at
# instantiation, before Lightning's prepare_data, so the download has to happen (verified) before
# that first read; a refused download leaves nothing at the final path; errors are one line.
ROOT = Path(__file__).resolve().parent.parent
M30K_SPLITS = ("train", "val", "test_2016_flickr")


def serve_parallel(root: Path, lines: int = 12) -> dict[str, bytes]:
    """Gzipped ``{split}.{de,en}.gz`` files of a tiny word-for-word corpus, written to ``root``."""
    words = [("haus", "house"), ("katze", "cat"), ("hund", "dog"), ("rot", "red"), ("klein", "small")]
    payloads = {}
    for split in M30K_SPLITS:
        pairs = [[words[(i + j) % len(words)] for j in range(1 + i % 3)] for i in range(lines)]
        for side, lang in enumerate(("de", "en")):
            text = "\n".join(" ".join(pair[side] for pair in sentence) for sentence in pairs) + "\n"
            payloads[f"{split}.{lang}.gz"] = gzip.compress(text.encode(), mtime=0)
    for name, payload in payloads.items():
        (root / name).write_bytes(payload)
    return payloads


def translation_args(data_dir: Path, base_url: str, tmp_path: Path) -> list[str]:
    return [
        "--config", str(ROOT / "configs/translation/multi30k_de_en_lstm.yaml"),
        "--data.init_args.data_dir", str(data_dir), "--data.init_args.download", "true",
        "--data.init_args.base_url", base_url, "--data.init_args.tokenizer", "word",
        "--data.init_args.cache_dir", str(tmp_path / "cache"), "--data.init_args.max_tokens", "100",
        "--model.init_args.network.init_args.embed_dim", "8", "--model.init_args.network.init_args.hidden_size", "8",
        "--model.init_args.network.init_args.num_layers", "1", "--model.init_args.val_bleu_sentences", "2", "--model.init_args.beam_size", "1",
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "1", "--trainer.limit_val_batches", "1",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
    ]






def test_translation_download_needs_no_io_in_init(tmp_path):
    data_dir = tmp_path / "m30k"
    TranslationDataModule(data_dir=str(data_dir), download=True, base_url=f"http://127.0.0.1:{closed_port()}/")
    assert not data_dir.exists()


def test_translation_download_is_verified_before_the_cli_reads_the_vocabulary(served, tmp_path, monkeypatch):
    root, url = served
    payloads = serve_parallel(root)
    for name, payload in payloads.items():  # the checksums of what the test serves
        monkeypatch.setitem(translation.MULTI30K_TASK1_SHA256, name, hashlib.sha256(payload).hexdigest())
    data_dir = tmp_path / "m30k"
    cli = main(["fit", *translation_args(data_dir, url, tmp_path)])
    assert sorted(p.name for p in data_dir.iterdir()) == sorted(payloads)
    for name, payload in payloads.items():
        assert (data_dir / name).read_bytes() == payload
    # specials + the five English words of the served training file
    assert cli.datamodule.num_classes == 4 + 5 and cli.model.head.num_classes == 9
    assert "val/loss" in cli.trainer.callback_metrics


def test_translation_download_with_a_wrong_checksum_is_refused_from_the_shell(served, tmp_path):
    root, url = served
    serve_parallel(root)  # not the published files: every SHA-256 differs
    data_dir = tmp_path / "m30k"
    line = one_error_line(run_cli(["fit", *translation_args(data_dir, url, tmp_path)], tmp_path))
    assert line.startswith(f"error: checksum mismatch for {url}train.de.gz: expected {translation.MULTI30K_TASK1_SHA256['train.de.gz']}, got ")
    assert f"put a verified copy at {(data_dir / 'train.de.gz').resolve()}" in line
    assert list(data_dir.iterdir()) == []  # nothing at the final path, no partial file
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("*.ckpt"))


def test_translation_download_from_a_server_that_is_down_is_one_line_from_the_shell(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/"
    data_dir = tmp_path / "m30k"
    line = one_error_line(run_cli(["fit", *translation_args(data_dir, url, tmp_path)], tmp_path))
    expected = (data_dir / "train.de.gz").resolve()
    assert line.startswith(f"error: could not download {url}train.de.gz (") and line.endswith(f"put it at {expected}")
    assert "check the network" in line and expected.parent.is_dir() and list(expected.parent.iterdir()) == []


def test_download_for_a_source_without_a_location_is_refused():
    with pytest.raises(ValueError, match="translation source 'wmt14' has no download location"):
        TranslationDataModule(source="wmt14", src_lang="en", tgt_lang="de", download=True)
