"""Chinese character recognition: .gnt format, GB2312 level 1, font rendering, CNN encoders,
callbacks, and the configs through the CLI on a small class subset."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from app.main import main
from datamodules.fonts import Distortion, find_cjk_fonts, gb2312_level1, load_face, render_clean, render_sample
from datamodules.gnt import fit_to_square, iter_gnt, write_gnt
from datamodules.hanzi import CasiaHWDB, FontRenderedHanzi, load_character_image
from tasks.encoders import HanziCNN, ResNet18Encoder
from tasks.callbacks import MisclassifiedImages
from tests.conftest import TinyConfig
from tests.events import check_hparams, group_order, read_events, read_hparams

ROOT = Path(__file__).resolve().parents[1]
FACES = find_cjk_fonts()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small convolutions run up to 70x slower with two threads on a loaded 2-core machine
    (measured: 5 s vs 0.07 s per step), so these tests use one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    """One render cache for the CLI tests: caches are keyed by settings, so they share it."""
    return tmp_path_factory.mktemp("hanzi-cache")


def run_dirs(tmp_path: Path, cache: Path | None = None) -> list[str]:
    return [
        *TinyConfig.dirs(tmp_path), "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--data.init_args.cache_dir", str(cache or tmp_path / "cache"),
    ]


# ------------------------------------------------------------------ character set
def test_gb2312_level1_is_rows_16_to_55():
    chars = gb2312_level1()
    assert len(chars) == 3755 and len(set(chars)) == 3755
    assert chars[0] == "啊" and chars[-1] == "座"  # 0xB0A1 and 0xD7F9
    assert all(0xB0A1 <= int.from_bytes(c.encode("gb2312"), "big") <= 0xD7F9 for c in chars)


def test_every_level1_character_renders_as_its_own_glyph_in_every_font():
    chars = gb2312_level1()
    for face in FACES:
        font = load_face(face.path, face.index, 14)
        notdef = render_clean(font, "\ue000", 16)  # a private-use code point: the missing-glyph box
        blank = 0
        for ch in chars:
            glyph = render_clean(font, ch, 16)
            assert not np.array_equal(glyph, notdef), f"{face.name} has no glyph for {ch}"
            blank += int(glyph.min() == 255)
        assert blank == 0, f"{face.name}: {blank} blank renders"


# ------------------------------------------------------------------ rendering
def test_rendering_is_deterministic_by_seed_and_seeds_differ():
    face = FACES[0]
    a = render_sample(face, "永", 48, Distortion(), (0, 3, 7, ord("永")))
    b = render_sample(face, "永", 48, Distortion(), (0, 3, 7, ord("永")))
    c = render_sample(face, "永", 48, Distortion(), (0, 4, 7, ord("永")))
    assert a.shape == (48, 48) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    assert np.abs(a.astype(int) - c.astype(int)).mean() > 5, "another writer seed must change the image"
    clean = render_sample(face, "永", 48, Distortion(enabled=False), (0,))
    assert np.abs(a.astype(int) - clean.astype(int)).mean() > 5, "distortion must change the glyph"


def test_distortion_and_datamodule_bad_values_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="Distortion needs rotation >= 0, got -1"):
        Distortion(rotation=-1)
    with pytest.raises(ValueError, match="image_size to be an integer >= 16"):
        FontRenderedHanzi(image_size=8)
    with pytest.raises(ValueError, match="train_writers to be an integer >= 1"):
        FontRenderedHanzi(train_writers=0)
    with pytest.raises(ValueError, match="num_classes_limit"):
        FontRenderedHanzi(num_classes_limit=1)
    with pytest.raises(ValueError, match="must match some but not all fonts"):
        FontRenderedHanzi(held_out_font="NoSuchFont").split_writers("train")
    with pytest.raises(ValueError, match="unknown field.s. wobble; the fields are aspect"):
        FontRenderedHanzi(distortion={"wobble": 1.0})
    # a checkpoint's hyper-parameters hold the distortion as a dict
    assert FontRenderedHanzi(distortion={"rotation": 5.0}).distortion == Distortion(rotation=5.0)


def test_no_cjk_font_names_the_packages(tmp_path):
    (tmp_path / "notes.ttf").write_text("not a font")
    data = FontRenderedHanzi(font_paths=[str(tmp_path), "/usr/share/fonts/truetype/dejavu"])
    assert data.num_classes == 3755  # known without any I/O
    with pytest.raises(ValueError, match="pip install pylopdf-fonts-zh-cn paperang-p2-fonts-cjk"):
        data.faces


@pytest.mark.parametrize("entry, splits", [("test", {"test"}), ("validate", {"val"}), ("fit", {"train", "val"}),
                                           ("predict", set())])
def test_a_command_renders_only_the_splits_it_reads(entry, splits, tmp_path):
    """``test`` renders the test images only (the training split is the largest), ``fit`` the
    training and validation splits, ``predict`` none (it reads predict_dir)."""
    import lightning as L
    from lightning.pytorch.trainer.states import TrainerFn

    data = FontRenderedHanzi(image_size=16, num_classes_limit=3, train_writers=1, cache_dir=str(tmp_path))
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.state.fn = TrainerFn(entry)
    data.trainer = trainer
    data.prepare_data()
    rendered = {path.name.split("-")[1] for path in tmp_path.iterdir() if path.name.startswith("fonts-")}
    assert rendered == splits


def test_font_splits_are_deterministic_cached_and_disjoint(tmp_path):
    kwargs = dict(image_size=24, num_classes_limit=5, train_writers=2, cache_dir=str(tmp_path), render_workers=2)
    data = FontRenderedHanzi(**kwargs)
    data.prepare_data()
    data.setup("fit")
    n = len(FACES)
    assert [len(data.datasets[s]) for s in ("train", "val", "test")] == [5 * n * 2, 5 * n, 5 * n]
    train_seeds = {s for _, s in data.split_writers("train")}
    assert train_seeds.isdisjoint({s for _, s in data.split_writers("test")})
    batch = next(iter(data.train_dataloader()))
    assert batch["input"].shape[1:] == (1, 24, 24) and batch["input"].dtype == torch.float32
    assert 0 <= float(batch["input"].min()) and float(batch["input"].max()) <= 1
    # one process vs two, and a larger class subset: a sample is the same image
    again = FontRenderedHanzi(**{**kwargs, "num_classes_limit": 6, "render_workers": 1, "cache_dir": str(tmp_path / "b")})
    big, small = again.build_split("test"), data.build_split("test")
    rows = [i for i, c in enumerate(big.codes) if c in set(small.codes.tolist())]
    assert np.array_equal(np.asarray(big.images[rows]), np.asarray(small.images))
    # a held-out font leaves training but stays in test
    held = FontRenderedHanzi(**{**kwargs, "held_out_font": FACES[0].name})
    if n > 1:
        assert FACES[0] not in {f for f, _ in held.split_writers("train")}
        assert FACES[0] in {f for f, _ in held.split_writers("test")}


# ------------------------------------------------------------------ .gnt
def handwritten(chars: str, seed: int) -> list[np.ndarray]:
    """Rendered characters cropped to their ink, as CASIA stores them (various W x H)."""
    out = []
    for i, ch in enumerate(chars):
        img = render_sample(FACES[0], ch, 40 + 3 * i, Distortion(), (seed, i, ord(ch)))
        rows, cols = np.flatnonzero((img < 200).any(1)), np.flatnonzero((img < 200).any(0))
        out.append(img[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1])
    return out


def write_writer(path: Path, chars: str, seed: int) -> list[np.ndarray]:
    images = handwritten(chars, seed)
    write_gnt(path, zip(chars, images))
    return images


def test_gnt_written_in_the_exact_byte_format_reads_back(tmp_path):
    chars = "啊阿埃挨哎"
    images = write_writer(tmp_path / "1001-c.gnt", chars, 0)
    raw = (tmp_path / "1001-c.gnt").read_bytes()
    h, w = images[0].shape  # first record by hand: uint32 size, GB2312 tag, uint16 w, uint16 h
    assert int.from_bytes(raw[0:4], "little") == 10 + w * h and raw[4:6] == "啊".encode("gb2312") == b"\xb0\xa1"
    assert int.from_bytes(raw[6:8], "little") == w and int.from_bytes(raw[8:10], "little") == h
    assert raw[10 : 10 + w * h] == images[0].tobytes()
    samples = list(iter_gnt(tmp_path / "1001-c.gnt"))
    assert [s.character for s in samples] == list(chars)
    for sample, image in zip(samples, images):
        assert np.array_equal(sample.pixels, image)


def test_casia_datamodule_labels_pixels_splits_and_outside_level1(tmp_path):
    train, test = tmp_path / "train", tmp_path / "test"
    train.mkdir(), test.mkdir()
    level1 = gb2312_level1()
    chars = "".join(level1[:4])
    originals = {}
    for writer in range(3):
        originals[writer] = write_writer(train / f"{1001 + writer}-c.gnt", chars, writer)
    # a level-2 character (亍, 0xD8A1) in the test writer: counted and reported, not silently dropped
    write_gnt(test / "1241-c.gnt", zip(chars + "亍", handwritten(chars + "亍", 9)))
    data = CasiaHWDB(str(train), str(test), val_fraction=0.34, image_size=32, num_classes_limit=4, cache_dir=str(tmp_path / "cache"))
    assert data.num_classes == 4 and data.classes == level1[:4]
    data.prepare_data()
    with pytest.warns(UserWarning, match="1 of 5 samples .* outside GB2312 level 1"):
        data.setup("fit")
    assert data.outside_level1["test"] == {"亍": 1}
    assert [len(data.datasets[s]) for s in ("train", "val", "test")] == [8, 4, 4]
    # training rows are writers 1001, 1002 in file order; pixels are the framed originals
    item = data.datasets["train"][5]
    expected = fit_to_square(originals[1][1], 32)
    assert item["target"] == 1
    assert torch.allclose(item["input"][0], torch.from_numpy((255 - expected.astype(np.float32)) / 255))
    all_labels = CasiaHWDB(str(train), str(test), label_set="all", cache_dir=str(tmp_path / "cache"))
    assert all_labels.classes == sorted(chars, key=lambda c: c.encode("gb2312"))


def test_truncated_and_corrupt_gnt_name_file_and_offset(tmp_path):
    path = tmp_path / "bad.gnt"
    images = write_writer(path, "啊阿", 0)
    first = 10 + images[0].size
    data = path.read_bytes()
    path.write_bytes(data[:-7])
    with pytest.raises(ValueError, match=rf"bad.gnt: truncated .gnt record at byte offset {first}:"):
        list(iter_gnt(path))
    path.write_bytes(data + b"\x01\x02\x03")
    with pytest.raises(ValueError, match=rf"truncated .gnt record header at byte offset {len(data)}"):
        list(iter_gnt(path))
    broken = bytearray(data)
    broken[first : first + 4] = (12345).to_bytes(4, "little")
    path.write_bytes(bytes(broken))
    with pytest.raises(ValueError, match=rf"corrupt .gnt record at byte offset {first}: sample size 12345"):
        list(iter_gnt(path))


# ------------------------------------------------------------------ encoders and callbacks
@pytest.mark.parametrize(
    "encoder",
    [HanziCNN(out_features=48, channels=(8, 16)), HanziCNN(out_features=24, channels=(8, 16), stem_stride=2),
     ResNet18Encoder(out_features=40)],
)
def test_encoders_map_grayscale_images_to_out_features(encoder):
    assert encoder(torch.rand(3, 1, 64, 64)).shape == (3, encoder.out_features)


@pytest.mark.parametrize("encoder", [HanziCNN(out_features=16, channels=(8, 16)), ResNet18Encoder(out_features=16)])
def test_encoder_output_cannot_die(encoder):
    """A projection pushed far negative still passes gradient to the convolutions (a ReLU after it
    left a real 3,755-class run with hidden states of 0 and no gradient for good)."""
    with torch.no_grad():
        encoder.projection.bias.fill_(-100.0)
    encoder(torch.rand(4, 1, 64, 64)).square().sum().backward()
    first_conv = next(m for m in encoder.modules() if isinstance(m, torch.nn.Conv2d))
    assert first_conv.weight.grad is not None and first_conv.weight.grad.abs().sum() > 0


def test_encoder_bad_values():
    with pytest.raises(ValueError, match="HanziCNN needs non-empty positive channels"):
        HanziCNN(channels=())
    with pytest.raises(ValueError, match="HanziCNN needs stem_stride 1 or 2, got 3"):
        HanziCNN(stem_stride=3)
    with pytest.raises(ValueError, match=r"expects images of shape \(B, 1, H, W\)"):
        HanziCNN()(torch.rand(2, 3, 32, 32))


def test_misclassified_grid_has_one_labelled_tile_per_error():
    callback = MisclassifiedImages(max_images=3)
    callback._examples = [(np.zeros((32, 32)), 0, 1), (np.ones((32, 32)), 1, 0)]
    grid = callback.grid(["啊", "阿"])
    assert grid.shape == (32 + 12, 2 * 32)
    assert grid[:32, :32].min() == 255 and grid[:32, 32:].max() == 0  # ink = 1 drawn dark
    assert grid[32:, :32].min() < 128, "label strip must carry text"


# ------------------------------------------------------------------ CLI
TINY_FONTS = ["--data.init_args.image_size", "24", "--data.init_args.num_classes_limit", "8",
              "--data.init_args.train_writers", "4", "--data.init_args.batch_size", "16",
              "--model.init_args.optimizer.init_args.lr", "0.01", "--trainer.log_every_n_steps", "1",
              "--model.init_args.encoder.init_args.channels", "[16, 32, 64]",
              "--model.init_args.encoder.init_args.out_features", "64"]


def test_font_rendered_fit_test_and_predict_csv_through_the_cli(tmp_path, shared_cache):
    config = ["--config", str(ROOT / "configs/hanzi/font_rendered.yaml"), *TINY_FONTS, *run_dirs(tmp_path, shared_cache)]
    cli = main(["fit", *config, "--trainer.max_epochs", "8", "--checkpoint.save_top_k", "0"])
    checkpoint = str(tmp_path / "final.ckpt")
    cli.trainer.save_checkpoint(checkpoint)
    tested = main(["test", *config, "--ckpt_path", checkpoint])
    accuracy = float(tested.trainer.callback_metrics["test/acc@1"])
    assert accuracy > 0.3, f"8 classes (chance 0.125) should be learned, got top-1 {accuracy:.3f}"
    # HPARAMS: top-1 accuracy of validation for the fit, of test for the test run, same columns.
    fitted = check_hparams(cli.trainer.logger.log_dir, head="softmax", data="FontRenderedHanzi", metrics=["val/acc@1"])
    assert fitted.columns["encoder"] == "HanziCNN" and fitted.columns["data/num_classes"] == 8
    test_run = read_hparams(read_events(tested.trainer.logger.log_dir))
    assert "test/acc@1" in test_run.shown and all(name.startswith("test/") for name in test_run.shown)
    assert test_run.metrics == fitted.metrics and test_run.columns == fitted.columns

    folder = tmp_path / "images"
    folder.mkdir()
    for ch, seed in (("啊", 1), ("埃", 2)):
        Image.fromarray(render_sample(FACES[0], ch, 80, Distortion(), (50_000, seed, ord(ch)))).save(folder / f"{ch}.png")
    (folder / "notes.txt").write_text("not an image")
    output = tmp_path / "pred.csv"
    predict = ["predict", *config, "--ckpt_path", checkpoint, "--data.init_args.predict_dir", str(folder),
               "--trainer.callbacks+=tasks.callbacks.PredictionWriter",
               f"--trainer.callbacks.output_path={output}"]
    with pytest.raises(ValueError, match="holds 1 file\\(s\\) that are not images, e.g. notes.txt"):
        main(predict)
    main([*predict, "--data.init_args.skip_non_images", "true"])
    rows = list(csv.DictReader(output.open(encoding="utf-8")))
    assert [Path(r["file"]).name for r in rows] == ["啊.png", "埃.png", "notes.txt"]
    assert rows[2]["note"] == "not an image"
    for row in rows[:2]:
        scores = [float(row[f"score_{i}"]) for i in range(1, 6)]
        assert scores == sorted(scores, reverse=True) and 0 < sum(scores) <= 1 + 1e-5
        assert row["char_1"] in gb2312_level1()[:8]


@pytest.mark.parametrize("head", ["mos.yaml", "ds32.yaml"])
def test_head_configs_train_with_font_rendered(tmp_path, shared_cache, head):
    """configs/hanzi/mos.yaml and configs/hanzi/ds32.yaml on an 8-class subset for a few steps."""
    cli = main(["fit", "--config", str(ROOT / "configs/hanzi/font_rendered.yaml"), "--config", str(ROOT / "configs/hanzi" / head),
                *TINY_FONTS, *run_dirs(tmp_path, shared_cache), "--trainer.max_epochs", "1",
                "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"])
    assert "val/acc@1" in cli.trainer.callback_metrics
    expected = "MixtureOfSoftmaxes" if head == "mos.yaml" else "DSSoftmax"
    assert type(cli.model.head).__name__ == expected
    short, argument = ("mos", "head/num_components") if head == "mos.yaml" else ("ds_softmax", "head/num_experts")
    hparams = check_hparams(cli.trainer.logger.log_dir, head=short, data="FontRenderedHanzi", metrics=["val/acc@1"])
    assert hparams.columns[argument] == cli.model.hparams.head["init_args"][argument.partition("/")[2]]
    if head == "ds32.yaml":  # TensorBoard opens on the task's groups; the DS heatmap at the global step
        events = read_events(cli.trainer.logger.log_dir)
        groups = group_order(events.Tags()["scalars"])
        assert groups[-1] == "~ds" and {"train", "val"} <= set(groups), groups
        [heatmap] = events.Images("~ds/sparsity/expert_class_heatmap")
        assert heatmap.step == cli.trainer.global_step == 2
    if head == "ds32.yaml":  # analyze experts rebuilds model and font data from the checkpoint alone
        ckpt = str(tmp_path / "final.ckpt")
        cli.trainer.save_checkpoint(ckpt)
        assert main(["analyze", "experts", "--ckpt_path", ckpt, "--reference_head", "softmax", "--latency_samples", "4",
                     "--latency_batch", "2", "--latency_repeats", "1", "--output_dir", str(tmp_path / "analysis")]) == 0
        report = json.loads((tmp_path / "analysis" / "experts.json").read_text())
        assert report["num_experts"] == cli.model.head.num_experts and report["latency"]["ds_single_ms"] > 0
        listed = [ch for chars in report["smallest_experts"].values() for ch in chars]
        assert listed and set(listed) <= set(gb2312_level1()[:8]), "experts list characters, not class ids"


@pytest.mark.parametrize("experts", [8, 16, 32, 64])
def test_ds_configs_grow_to_their_expert_count(tmp_path, shared_cache, experts):
    """configs/hanzi/ds8.yaml, configs/hanzi/ds16.yaml, configs/hanzi/ds32.yaml, configs/hanzi/ds64.yaml:
    Mitosis targets K experts."""
    from tasks.callbacks import Mitosis

    cli = main(["--config", str(ROOT / "configs/hanzi/font_rendered.yaml"),
                "--config", str(ROOT / f"configs/hanzi/ds{experts}.yaml"), *TINY_FONTS, *run_dirs(tmp_path, shared_cache)],
               run=False)
    mitosis = [c for c in cli.trainer.callbacks if isinstance(c, Mitosis)]
    assert len(mitosis) == 1 and mitosis[0].max_experts == experts
    assert type(cli.model.head).__name__ == "DSSoftmax" and cli.model.head.num_experts == 2


def test_casia_config_runs_on_generated_gnt(tmp_path):
    """configs/hanzi/casia.yaml fit + test on two generated writers."""
    train, test = tmp_path / "train", tmp_path / "test"
    train.mkdir(), test.mkdir()
    chars = "".join(gb2312_level1()[:6])
    for writer in range(2):
        write_writer(train / f"{1001 + writer}-c.gnt", chars, writer)
    write_writer(test / "1241-c.gnt", chars, 7)
    config = ["--config", str(ROOT / "configs/hanzi/casia.yaml"), *run_dirs(tmp_path),
              "--data.init_args.train_dir", str(train), "--data.init_args.test_dir", str(test),
              "--data.init_args.val_fraction", "0.5", "--data.init_args.num_classes_limit", "6",
              "--data.init_args.image_size", "32", "--model.init_args.encoder.init_args.channels", "[8, 16]",
              "--model.init_args.encoder.init_args.blocks_per_stage", "1", "--trainer.max_epochs", "1"]
    cli = main(["fit", *config])
    assert cli.datamodule.num_classes == 6 and "val/acc@1" in cli.trainer.callback_metrics


def test_predict_image_loading_inverts_dark_paper(tmp_path):
    ink = render_sample(FACES[0], "永", 48, Distortion(enabled=False), (0,))
    Image.fromarray(255 - ink).save(tmp_path / "dark.png")
    Image.fromarray(ink).save(tmp_path / "light.png")
    assert np.array_equal(load_character_image(tmp_path / "dark.png", 48), load_character_image(tmp_path / "light.png", 48))


def test_empty_or_foreign_gnt_training_files_are_one_line_errors(tmp_path):
    train, test = tmp_path / "train", tmp_path / "test"
    train.mkdir(), test.mkdir()
    (train / "1001-c.gnt").write_bytes(b"")  # an empty file: refused by name, not counted as a writer
    write_gnt(test / "1241-c.gnt", zip("亍", handwritten("亍", 9)))
    with pytest.raises(ValueError, match=r"1001-c.gnt is empty \(0 bytes\)"):
        CasiaHWDB(str(train), str(test), label_set="all", cache_dir=str(tmp_path / "cache")).num_classes
    (train / "1001-c.gnt").unlink()
    # label_set all needs two classes: one character in the training files is refused
    write_gnt(train / "1002-c.gnt", zip("亍", handwritten("亍", 9)))
    with pytest.raises(ValueError, match="hold 1 distinct character tag.*at least 2"):
        CasiaHWDB(str(train), str(test), label_set="all", cache_dir=str(tmp_path / "cache")).num_classes
    # level1 with training files whose only character is outside level 1: nothing to train on
    data = CasiaHWDB(str(train), str(test), val_fraction=0.0, image_size=16, num_classes_limit=4, cache_dir=str(tmp_path / "cache"))
    data.prepare_data()
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="train split has no sample of the 4 classes"):
        data.setup("fit")


def test_ds_softmax_init_std_must_be_positive():
    from heads import DSSoftmax

    with pytest.raises(ValueError, match="init_std > 0, got 0.0"):
        DSSoftmax(8, 10, num_experts=2, init_std=0.0)
