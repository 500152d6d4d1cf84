"""Data edges met from the shell, with fixtures written here byte by byte (not with the project's
own writers): ``.gnt`` records packed with ``struct`` after the layout in datamodules/gnt.py, tiny
Karpathy JSON files and PNG folders.

Proves: a 0-byte ``.gnt`` file and a width = height = 0 record are refused with one line naming
the file (and a message that does not contradict itself); a bitmap reaches the network as the
same tensor through a ``.gnt`` file and through ``predict``; ``label_set: all`` says how many
validation/test samples it leaves out; Karpathy entries with an unknown ``split`` and files with
no training images are refused naming the file; an evaluation whose generated captions are all
empty warns. Errors: exit code 2, one ``error:`` line, no traceback; warnings: on stderr.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from datamodules.hanzi import CasiaHWDB
from tests.shell import one_error_line, run_app, run_cli

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------- shell




# ---------------------------------------------------------------------------------- .gnt fixtures
def gnt_record(character: str, pixels: np.ndarray) -> bytes:
    """One record: uint32 size (header included), GB2312 tag, uint16 width, uint16 height, pixels."""
    height, width = pixels.shape
    return (
        struct.pack("<I", 10 + width * height)
        + character.encode("gb2312")
        + struct.pack("<HH", width, height)
        + np.ascontiguousarray(pixels, dtype=np.uint8).tobytes()
    )


def cross(shift: int = 0) -> np.ndarray:
    """十 drawn in the middle of a wide white margin (28 x 24)."""
    pixels = np.full((28, 24), 255, dtype=np.uint8)
    pixels[12 + shift : 15 + shift, 5:19] = 20
    pixels[5:23, 10 + shift : 13 + shift] = 40
    return pixels


def box(shift: int = 0) -> np.ndarray:
    """口 cropped tight to its ink, as CASIA stores characters: ink along the whole border
    (on less than half of the area, as in any character that is not a blot)."""
    pixels = np.full((24 + shift, 22), 255, dtype=np.uint8)
    pixels[:3], pixels[-3:], pixels[:, :3], pixels[:, -3:] = 10, 10, 30, 30
    return pixels


def person(shift: int = 0) -> np.ndarray:
    """人 as two grey strokes (anti-aliased levels between ink and paper), off-centre."""
    pixels = np.full((26, 30), 255, dtype=np.uint8)
    for row in range(4, 24):
        left, right = 14 - (row - 4) // 2 + shift, 14 + (row - 4) // 2 + shift
        pixels[row, left : left + 2] = (60, 180)
        pixels[row, right : right + 2] = (180, 90)
    return pixels


GLYPHS = {"十": cross, "口": box, "人": person}


def write_gnt_file(path: Path, characters: str, shift: int = 0) -> None:
    path.write_bytes(b"".join(gnt_record(ch, GLYPHS[ch](shift)) for ch in characters))


def casia_args(train: Path, test: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--config", str(ROOT / "configs/hanzi/casia.yaml"),
        "--data.init_args.train_dir", str(train), "--data.init_args.test_dir", str(test),
        "--data.init_args.image_size", "16", "--data.init_args.batch_size", "4",
        "--data.init_args.cache_dir", str(tmp_path / "cache"),
        "--model.init_args.encoder.init_args.channels", "[4, 8]",
        "--model.init_args.encoder.init_args.blocks_per_stage", "1",
        "--model.init_args.encoder.init_args.out_features", "8",
        "--model.init_args.eval_topk", "[1]", "--model.init_args.predict_topk", "1",  # fixtures have 2-3 classes
        "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.num_sanity_val_steps", "0",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
        *extra,
    ]


def writer_dirs(tmp_path: Path) -> tuple[Path, Path]:
    train, test = tmp_path / "train", tmp_path / "test"
    train.mkdir()
    test.mkdir()
    return train, test


def test_an_empty_gnt_file_is_refused_by_name_not_given_a_writer_slot(tmp_path):
    train, test = writer_dirs(tmp_path)
    write_gnt_file(train / "1001-c.gnt", "十口人")
    write_gnt_file(train / "1002-c.gnt", "十口人", shift=1)
    (train / "1003-c.gnt").write_bytes(b"")  # sorted last: it would be the validation writer
    write_gnt_file(test / "1241-c.gnt", "十口人", shift=2)
    line = one_error_line(run_cli(["fit", *casia_args(train, test, tmp_path, "--data.init_args.label_set", "all",
                                                        "--data.init_args.val_fraction", "0.34")], tmp_path))
    assert line == (
        f"error: {train / '1003-c.gnt'} is empty (0 bytes): a .gnt file holds at least one character record; "
        f"re-copy it from the archive or remove it from the folder"
    )
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_zero_by_zero_gnt_record_gets_a_message_that_does_not_contradict_itself(tmp_path):
    train, test = writer_dirs(tmp_path)
    write_gnt_file(train / "1001-c.gnt", "十口")
    first = gnt_record("十", cross(2))
    empty = struct.pack("<I", 10) + "口".encode("gb2312") + struct.pack("<HH", 0, 0)  # size 10 = 10 + 0 x 0
    (test / "1241-c.gnt").write_bytes(first + empty)
    line = one_error_line(run_cli(["validate", *casia_args(train, test, tmp_path, "--data.init_args.label_set", "all",
                                                             "--data.init_args.val_fraction", "0")], tmp_path))
    assert line == (
        f"error: {test / '1241-c.gnt'}: corrupt .gnt record at byte offset {len(first)}: width 0 x height 0 is an "
        f"empty image (a record needs width >= 1 and height >= 1); the file is damaged or not a CASIA-HWDB .gnt file"
    )


def test_label_set_all_warns_with_the_count_of_test_samples_it_leaves_out(tmp_path):
    train, test = writer_dirs(tmp_path)
    write_gnt_file(train / "1001-c.gnt", "十口")
    write_gnt_file(train / "1002-c.gnt", "十口", shift=1)
    write_gnt_file(test / "1241-c.gnt", "十口人人", shift=2)  # 人 never appears in training
    result = run_cli(["validate", *casia_args(train, test, tmp_path, "--data.init_args.label_set", "all",
                                              "--data.init_args.val_fraction", "0")], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    stderr = " ".join(result.stderr.split())
    for split in ("val", "test"):  # val_fraction 0: the test writers also validate
        assert (
            f"CASIA-HWDB {split}: 2 of 4 samples (1 distinct tags, e.g. 人x2) have tags not found in the training "
            f"files and are left out"
        ) in stderr, result.stderr[-3000:]


def test_a_bitmap_reaches_the_network_identically_through_gnt_and_predict(tmp_path):
    """One framing policy: the same bitmaps as ``.gnt`` records (training/evaluation) and as PNG
    files (``predict``) give identical model inputs; a margin around the ink, ink along the whole
    border (口 cropped tight) and grey strokes are the cases where two policies would differ."""
    train, test = writer_dirs(tmp_path)
    characters = "十口人"
    write_gnt_file(train / "1001-c.gnt", characters)
    write_gnt_file(test / "1241-c.gnt", characters, shift=1)
    images = tmp_path / "images"
    images.mkdir()
    for i, ch in enumerate(characters):
        Image.fromarray(GLYPHS[ch]()).save(images / f"{i}.png")
    data = CasiaHWDB(str(train), str(test), label_set="all", val_fraction=0.0, image_size=24,
                     cache_dir=str(tmp_path / "cache"), predict_dir=str(images))
    data.prepare_data()
    data.setup("fit")
    data.setup("predict")
    train_set, predict_set = data.datasets["train"], data.datasets["predict"]
    assert len(train_set) == len(predict_set) == 3
    for i, ch in enumerate(characters):
        through_gnt, through_predict = train_set[i]["input"], predict_set[i]["input"]
        assert through_gnt.shape == through_predict.shape == (1, 24, 24)
        difference = (through_gnt - through_predict).abs().max().item()
        assert torch.equal(through_gnt, through_predict), f"{ch}: max difference {difference}"
        assert through_gnt.max() > 0.5  # ink is ink (not inverted) on both paths


# ---------------------------------------------------------------------------------- Karpathy
def write_karpathy(root: Path, splits: list[str], words: list[list[str]] | None = None) -> Path:
    """``dataset_coco.json`` with one tiny PNG per entry; captions from ``words`` (one list of
    single-word captions per image) or a fixed pair."""
    folder = root / "images"
    folder.mkdir(exist_ok=True)
    entries = []
    for i, split in enumerate(splits):
        Image.new("RGB", (12 + i, 10), (30 * i % 256, 90, 160)).save(folder / f"im{i}.png")
        captions = words[i] if words else ["a small dog", "the dog runs"]
        sentences = [{"raw": c, "tokens": c.split(), "imgid": i, "sentid": 10 * i + k} for k, c in enumerate(captions)]
        entries.append({"filepath": "images", "filename": f"im{i}.png", "imgid": i, "cocoid": 500 + i,
                        "split": split, "sentences": sentences})
    path = root / "dataset_coco.json"
    path.write_text(json.dumps({"images": entries, "dataset": "coco"}), encoding="utf-8")
    return path


def captioning_args(annotations: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--config", str(ROOT / "configs/captioning/coco_karpathy.yaml"),
        "--data.init_args.annotations", str(annotations), "--data.init_args.image_root", str(tmp_path),
        "--data.init_args.image_size", "32", "--data.init_args.batch_size", "2", "--data.init_args.num_workers", "0",
        "--data.init_args.count_threshold", "1", "--data.init_args.captions_per_image", "2",
        "--model.init_args.encoder.init_args.arch", "resnet18", "--model.init_args.encoder.init_args.weights", "null",
        "--model.init_args.decoder.init_args.embed_dim", "8", "--model.init_args.decoder.init_args.hidden_size", "8",
        "--model.init_args.meteor", "false", "--model.init_args.metric_tokenizer", "simple",
        "--model.init_args.val_caption_images", "-1",
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "1", "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
        *extra,
    ]


def test_a_karpathy_entry_with_an_unknown_split_lists_the_valid_values(tmp_path):
    annotations = write_karpathy(tmp_path, ["train", "train", "restval", "valid", "test"])  # "valid": a typo
    line = one_error_line(run_cli(["fit", *captioning_args(annotations, tmp_path)], tmp_path))
    assert line == (
        f"error: {annotations}: image entry 3 has split 'valid'; valid values are train, val, test, restval "
        f"(fix the entry or re-download the file)"
    )


def test_a_karpathy_file_without_training_images_is_named(tmp_path):
    annotations = write_karpathy(tmp_path, ["val", "val", "test"])
    line = one_error_line(run_cli(["fit", *captioning_args(annotations, tmp_path)], tmp_path))
    assert line == (
        f"error: {annotations} has no train images: no entry with split 'train' or 'restval' and at least one "
        f"sentence (images per split: train 0, val 2, test 1, restval 0); use a complete Karpathy split file"
    )
    assert "num_classes" not in line


def test_an_evaluation_whose_generated_captions_are_all_empty_warns(tmp_path):
    # Every training caption is one word of its own, so end-of-caption is by far the most frequent
    # target: a head started at the unigram (unigram_bias_init) ends every caption at once.
    words = [[f"w{i}a", f"w{i}b", f"w{i}c"] for i in range(5)]
    annotations = write_karpathy(tmp_path, ["train", "train", "train", "train", "val"], words)
    result = run_cli(["fit", *captioning_args(annotations, tmp_path, "--model.init_args.unigram_bias_init", "true",
                                              "--model.init_args.optimizer.init_args.lr", "0.0")], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    stderr = " ".join(result.stderr.split())
    assert (
        "val epoch 0: all 1 generated captions are empty (the decoder ends every caption at once), so the caption "
        "scores are 0; train longer or check the data and learning rate"
    ) in stderr, result.stderr[-3000:]


# ---------------------------------------------------------------------------------- writes
@pytest.mark.slow  # a file-size limit on a process of its own
def test_an_image_cache_on_a_full_disk_is_one_line_and_leaves_nothing_in_the_cache_dir(tmp_path):
    """The run may write files of at most 32 KiB (RLIMIT_FSIZE; its config and logs are smaller),
    as on a disk that fills up while the ``.gnt`` files are parsed into the image cache."""
    import resource
    import signal

    def file_size_limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, 32 << 10))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG

    train, test = writer_dirs(tmp_path)
    write_gnt_file(train / "1001-c.gnt", "十口人" * 100)  # 300 images of 16 x 16: 75 KiB of cache
    write_gnt_file(test / "1241-c.gnt", "十口人", shift=1)
    result = run_app(["fit", *casia_args(train, test, tmp_path, "--data.init_args.val_fraction", "0")], tmp_path,
                     preexec_fn=file_size_limit)
    line = one_error_line(result, f"cannot write image cache {tmp_path / 'cache'}", "File too large",
                          "nothing was written; free space or set data.init_args.cache_dir")
    assert list((tmp_path / "cache").iterdir()) == [], line  # no temporary or half-built cache left

