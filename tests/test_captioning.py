"""Captioning: Karpathy-split loading, synthetic scenes that say what they draw, the NIC model,
decoding through the shared search, encoder weights, and fit/test/predict through the CLI."""

from __future__ import annotations

import functools
import json
import re
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from scipy import ndimage

from datamodules.captioning import BOS_ID, EOS_ID, IGNORE_INDEX, PAD_ID, KarpathyCaptions, collate_captions
from datamodules.scenes import COLOURS, SyntheticScenes, scene_at
from tasks.captioning import CaptioningTask
from tasks.classification import ClassificationTask
from tasks.encoders.resnet import ResNetEncoder, build_resnet
from tasks.encoders.show_tell import ShowTellDecoder
from tests.events import check_hparams, read_events, read_hparams


def tiny_decoder(**settings) -> functools.partial:
    """A ``decoder`` argument: a 16-wide NIC decoder (``settings`` override)."""
    return functools.partial(ShowTellDecoder, **{"embed_dim": 16, "hidden_size": 16, "attention_dim": 8, "dropout": 0.0, **settings})


TINY_MODEL = {"decoder": tiny_decoder()}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny convolutions run 10-20x slower with two intra-op threads on a busy 2-core machine
    (threads wait for each other); these tests do not need more than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------- Karpathy
def write_karpathy_fixture(root, broken: str | None = None) -> str:
    """dataset_coco.json-style file with 6 images (2 train, 1 restval, 1 val, 2 test) and PNGs."""
    splits = ["train", "train", "restval", "val", "test", "test"]
    images = []
    for i, split in enumerate(splits):
        folder = "train2014" if split == "train" else "val2014"
        (root / folder).mkdir(exist_ok=True)
        name = f"img{i}.png"
        Image.new("RGB", (20 + i, 16), (40 * i, 100, 200)).save(root / folder / name)
        sentences = [
            {"raw": f"A red bus number {i}.", "tokens": ["a", "red", "bus", "number", str(i)], "imgid": i, "sentid": 2 * i},
            {"raw": "A bus on the street", "tokens": ["a", "bus", "on", "the", "street"], "imgid": i, "sentid": 2 * i + 1},
        ]
        images.append({"filepath": folder, "filename": name, "imgid": i, "split": split, "sentences": sentences, "cocoid": 1000 + i})
    if broken == "missing":
        (root / images[0]["filepath"] / images[0]["filename"]).unlink()
    elif broken == "garbage":
        (root / images[0]["filepath"] / images[0]["filename"]).write_bytes(b"not a png at all")
    path = root / "dataset_coco.json"
    path.write_text(json.dumps({"images": images, "dataset": "coco"}))
    return str(path)


def test_karpathy_fixture_loads_splits_references_and_vocabulary(tmp_path):
    annotations = write_karpathy_fixture(tmp_path)
    data = KarpathyCaptions(annotations, str(tmp_path), count_threshold=2, image_size=32, batch_size=2)
    assert [len(data.records(s)) for s in ("train", "val", "test")] == [3, 1, 2]  # restval folded into train
    assert [r.image_id for r in data.records("test")] == [1004, 1005]  # cocoid, for COCO results files
    assert data.records("val")[0].captions == ["A red bus number 3.", "A bus on the street"]
    # count_threshold 2: the digits (once each in train) become <unk>; the rest in frequency order.
    assert data.vocab.itos == ["<pad>", "<unk>", "<bos>", "<eos>", "a", "bus", "red", "number", "on", "the", "street"]
    assert data.num_classes == 11 and data.frequency_ordered
    batch = next(iter(data.test_dataloader()))
    assert batch["images"].shape == (2, 3, 32, 32)
    assert batch["references"][0] == ["A red bus number 4.", "A bus on the street"]
    assert batch["caption_image"].tolist() == [0, 0, 1, 1]  # evaluation keeps every reference
    no_restval = KarpathyCaptions(annotations, str(tmp_path), restval_to_train=False)
    assert len(no_restval.records("train")) == 2


def test_collate_aligns_inputs_and_targets():
    items = [
        {"image": torch.zeros(3, 4, 4), "captions": [[5, 6, 7], [8]], "image_id": 1, "references": ["x"], "index": 0},
        None,  # a skipped image
        {"image": torch.ones(3, 4, 4), "captions": [[9, 10]], "image_id": 2, "references": ["y"], "index": 1},
    ]
    batch = collate_captions(items)
    assert batch["caption_input"].tolist() == [[BOS_ID, 5, 6, 7], [BOS_ID, 8, PAD_ID, PAD_ID], [BOS_ID, 9, 10, PAD_ID]]
    assert batch["caption_output"].tolist() == [
        [5, 6, 7, EOS_ID],
        [8, EOS_ID, IGNORE_INDEX, IGNORE_INDEX],
        [9, 10, EOS_ID, IGNORE_INDEX],
    ]
    assert batch["caption_image"].tolist() == [0, 0, 1] and batch["image_id"].tolist() == [1, 2]
    assert collate_captions([None]) is None


@pytest.mark.parametrize("broken", ["missing", "garbage"])
def test_bad_image_is_an_error_naming_the_file_or_skipped_and_counted(tmp_path, broken):
    annotations = write_karpathy_fixture(tmp_path, broken)
    strict = KarpathyCaptions(annotations, str(tmp_path), image_size=32, batch_size=4, count_threshold=1)
    with pytest.raises(ValueError, match=r"img0\.png") as error:
        next(iter(strict.train_dataloader()))
    assert "\n" not in str(error.value)
    lenient = KarpathyCaptions(annotations, str(tmp_path), image_size=32, batch_size=4, count_threshold=1, skip_bad_images=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dataset = lenient.dataset("train")
        batch = collate_captions([dataset[i] for i in range(len(dataset))])
    assert batch["images"].shape[0] == 2  # 3 train images, one skipped
    skipped = lenient.skipped_images + dataset.bad_images
    assert len(skipped) == 1 and skipped[0].endswith("img0.png")
    assert any("img0.png" in str(w.message) for w in caught)


def test_karpathy_bad_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        KarpathyCaptions(str(tmp_path / "nope.json"), str(tmp_path)).num_classes
    (tmp_path / "bad.json").write_text(json.dumps({"images": [{"filename": "x.jpg", "split": "train"}]}))
    with pytest.raises(ValueError, match="image entry 0 lacks sentences"):
        KarpathyCaptions(str(tmp_path / "bad.json"), str(tmp_path)).num_classes
    with pytest.raises(ValueError, match="unknown caption tokenizer 'chars'"):
        KarpathyCaptions("a.json", ".", tokenizer="chars")
    with pytest.raises(ValueError, match="image_size to be an integer >= 16"):
        KarpathyCaptions("a.json", ".", image_size=8)


def test_bpe_captions_round_trip(tmp_path):
    data = SyntheticScenes(num_train=200, num_val=4, num_test=4, tokenizer="bpe", bpe_vocab_size=40, bpe_cache_dir=str(tmp_path))
    record = data.records("val")[0]
    ids = data.vocab.encode(data.pieces(record)[0])
    assert data.vocab.unk not in data.vocab.decode(ids)
    assert data.decode(ids + [EOS_ID, 7]) == record.captions[0]  # stops at EOS, restores spaces
    assert data.state_for_checkpoint()["tokenizer"]["kind"] == "bpe"


# ---------------------------------------------------------------------------------- scenes
CAPTION = re.compile(
    r"^(a|two|three) (small|large) (red|green|blue|yellow) (circle|square|triangle)s?"
    r"(?: (above|below|to the left of|to the right of) (a|two|three) (small|large) (red|green|blue|yellow) (circle|square|triangle)s?)?$"
)
COUNTS = {"a": 1, "two": 2, "three": 3}


def read_shapes(image: Image.Image) -> list[dict]:
    """Shapes found in the pixels alone: colour, size, kind and centre of each blob."""
    pixels = np.asarray(image).astype(int)  # (H, W, 3)
    labels, count = ndimage.label(pixels.max(axis=-1) > 100)  # background is darker than 40
    palette = {name: np.array(rgb) for name, rgb in COLOURS.items()}
    shapes = []
    for index, box in enumerate(ndimage.find_objects(labels), start=1):
        mask = labels[box] == index
        colour = pixels[box][mask].mean(axis=0)
        height, width = mask.shape
        fill = mask.sum() / (height * width)
        shapes.append(
            {
                "colour": min(palette, key=lambda name: np.abs(palette[name] - colour).sum()),
                "size": "large" if height >= 13 else "small",  # small <= 12 px tall, large >= 14
                "shape": "square" if fill > 0.88 else "triangle" if fill < 0.6 else "circle",
                "y": (box[0].start + box[0].stop) / 2,
                "x": (box[1].start + box[1].stop) / 2,
            }
        )
    return shapes


def test_scenes_are_deterministic_by_seed():
    first = SyntheticScenes(num_train=5, seed=3).records("train")
    again = SyntheticScenes(num_train=5, seed=3).records("train")
    other = SyntheticScenes(num_train=5, seed=4).records("train")
    assert [r.captions for r in first] == [r.captions for r in again]
    render = lambda r: np.asarray(r.source.render())  # noqa: E731
    assert all(np.array_equal(render(a), render(b)) for a, b in zip(first, again))
    assert any(not np.array_equal(render(a), render(b)) for a, b in zip(first, other))
    assert scene_at(3, "val", 0, 64) != scene_at(3, "train", 0, 64)


def test_scene_captions_agree_with_the_pixels():
    for index in range(60):
        scene = scene_at(0, "train", index, 64)
        captions = scene.captions()
        match = CAPTION.match(captions[0])
        assert match, captions[0]
        words = match.groups()
        shapes = read_shapes(scene.render())
        groups = [words[:4]] if words[4] is None else [words[:4], words[5:]]
        if words[4] is None:
            found = [shapes]
        else:
            # The relation puts the first group in one half: check it there, the second in the other.
            axis, first_low = {"above": ("y", True), "below": ("y", False), "to the left of": ("x", True), "to the right of": ("x", False)}[words[4]]
            low = [s for s in shapes if s[axis] < 32]
            high = [s for s in shapes if s[axis] >= 32]
            found = [low, high] if first_low else [high, low]
        for (count, size, colour, shape), blobs in zip(groups, found):
            assert len(blobs) == COUNTS[count], (captions[0], blobs)
            assert all((b["size"], b["colour"], b["shape"]) == (size, colour, shape) for b in blobs), (captions[0], blobs)
        assert len(shapes) == sum(COUNTS[g[0]] for g in groups)
        assert all(c.replace("there is ", "").replace("there are ", "") for c in captions)


# ---------------------------------------------------------------------------------- model
@pytest.fixture(scope="module")
def scenes():
    return SyntheticScenes(num_train=16, num_val=4, num_test=4, image_size=32, batch_size=4)


@pytest.fixture(scope="module")
def tiny_tasks(scenes):
    """One untrained task per decoder kind, shared (building a ResNet costs a second or two)."""
    return {attention: CaptioningTask(scenes.num_classes, decoder=tiny_decoder(attention=attention), max_caption_length=8).eval() for attention in (False, True)}


@pytest.mark.parametrize("attention", [False, True])
def test_teacher_forcing_equals_step_by_step_decoding(scenes, tiny_tasks, attention):
    task = tiny_tasks[attention]
    batch = collate_captions([scenes.dataset("val")[i] for i in range(2)])
    hidden = task(batch["images"], batch["caption_input"], batch["caption_image"])  # (N, T, D)
    annotations = task.encoder(batch["images"]).index_select(0, batch["caption_image"])
    state = task.decoder.start(annotations)
    steps = []
    for t in range(batch["caption_input"].size(1)):
        step, state = task.decoder.step(batch["caption_input"][:, t], state)
        steps.append(step)
    difference = (torch.stack(steps, 1) - hidden).abs().max().item()
    assert difference < 1e-5, f"max difference {difference}"
    nll = task.token_nll(batch)
    assert nll.shape == batch["caption_output"].shape and bool((nll[batch["caption_output"] == IGNORE_INDEX] == 0).all())


@pytest.mark.parametrize("attention", [False, True])
def test_beam_of_one_equals_greedy(scenes, tiny_tasks, attention):
    task = tiny_tasks[attention]
    images = collate_captions([scenes.dataset("val")[i] for i in range(4)])["images"]
    greedy = task.caption(images, beam_size=1)
    beam = task.caption(images, beam_size=1, greedy_when_one=False)
    assert [g.tokens for g in greedy] == [b.tokens for b in beam]
    assert [g.log_prob for g in greedy] == pytest.approx([b.log_prob for b in beam], abs=1e-5)
    wide = task.caption(images, beam_size=4)
    assert len(wide) == 4 and all(len(w.tokens) < 8 and EOS_ID not in w.tokens for w in wide)


def test_frozen_encoder_keeps_weights_and_batch_norm_statistics(scenes):
    task = CaptioningTask(scenes.num_classes, encoder=ResNetEncoder(trainable=False), **TINY_MODEL).train()
    assert not task.encoder.training and not any(p.requires_grad for p in task.encoder.parameters())
    before = {k: v.clone() for k, v in task.encoder.state_dict().items()}
    batch = next(iter(scenes.train_dataloader()))
    task.token_nll(batch).sum().backward()
    assert all(torch.equal(before[k], v) for k, v in task.encoder.state_dict().items())
    assert task.decoder.word_embedding.weight.grad is not None


#: A task's arguments as a checkpoint saves them (the encoder as class_path + init_args) and the
#: module-free arguments LightningCLI passes beside the built encoder.
RESTORED = {
    "captioning": (CaptioningTask, {"num_classes": 12, "encoder": {"class_path": "tasks.encoders.ResNetEncoder", "init_args": {"arch": "resnet18"}},
                                    "decoder": {"class_path": "tasks.encoders.ShowTellDecoder",
                                                "init_args": {"embed_dim": 8, "hidden_size": 8, "attention_dim": 8}}},
                   {"decoder": tiny_decoder()}),
    "hanzi": (ClassificationTask, {"num_classes": 12, "encoder": {"class_path": "tasks.encoders.HanziCNN",
                                                                   "init_args": {"out_features": 8, "channels": [4, 8]}}}, {}),
}


@pytest.mark.parametrize("kind", sorted(RESTORED))
def test_restoring_a_task_with_a_built_encoder_prints_no_warning(kind):
    """A task rebuilt from a checkpoint's hyper-parameters by Lightning's instantiator (what
    ``load_from_checkpoint``, ``analyze`` and ``convert`` do) or given a built encoder from Python
    gets an ``nn.Module`` encoder: it is left out of the saved hyper-parameters, so Lightning's
    "Attribute 'encoder' is an instance of `nn.Module`" is not printed. Built by LightningCLI (the
    configuration handed over), the encoder stays its class_path + init_args, which is how a
    checkpoint rebuilds its architecture (pins ``tasks.base.built_modules``'s private hook)."""
    import copy

    from lightning.pytorch.cli import instantiate_module
    from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters_context

    task_class, hparams, given = RESTORED[kind]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = instantiate_module(task_class, copy.deepcopy(hparams))
        from_python = task_class(hparams["num_classes"], encoder=restored.encoder, **given)
    assert not [str(w.message) for w in caught if "nn.Module" in str(w.message)]
    assert type(restored.encoder).__name__ == hparams["encoder"]["class_path"].rpartition(".")[2]
    assert "encoder" not in restored.hparams and "encoder" not in from_python.hparams
    with _given_hyperparameters_context(hparams=copy.deepcopy(hparams), instantiator="lightning.pytorch.cli.instantiate_module"):
        through_cli = task_class(hparams["num_classes"], encoder=restored.encoder, **given)
    assert through_cli.hparams["encoder"] == hparams["encoder"]


def test_imagenet_weights_load_from_the_hub_cache_or_fall_back(tmp_path, monkeypatch):
    import torchvision

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    checkpoints = tmp_path / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    url = torchvision.models.ResNet18_Weights.IMAGENET1K_V1.url
    saved = torchvision.models.resnet18().state_dict()  # stands in for the ImageNet file
    torch.save(saved, checkpoints / url.rsplit("/", 1)[-1])
    network = build_resnet("resnet18", "IMAGENET1K_V1")
    assert all(torch.equal(saved[k], v) for k, v in network.state_dict().items())

    (checkpoints / url.rsplit("/", 1)[-1]).write_bytes(b"truncated download")
    with pytest.warns(UserWarning, match=r"resnet18: could not load .*using random initialisation") as caught:
        build_resnet("resnet18", "DEFAULT")
    assert all("\n" not in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="unknown weights 'IMAGENET21K' for resnet18: valid are DEFAULT, IMAGENET1K_V1"):
        build_resnet("resnet18", "IMAGENET21K")


def test_task_bad_inputs_are_one_line_errors():
    with pytest.raises(ValueError, match=r"unknown encoder 'vgg16': valid are resnet18, resnet50, resnet101 \(set model.init_args.encoder.init_args.arch\)"):
        ResNetEncoder("vgg16")
    with pytest.raises(ValueError, match=r"needs an encoder nn.Module with an integer out_channels, got Linear"):
        CaptioningTask(20, encoder=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"dropout in \[0, 1\), got 1.5 \(set model.init_args.decoder.init_args.dropout\)"):
        CaptioningTask(20, decoder=tiny_decoder(dropout=1.5))
    with pytest.raises(ValueError, match=r"hidden_size to be an integer >= 1, got 0 \(set model.init_args.decoder.init_args.hidden_size\)"):
        CaptioningTask(20, decoder=tiny_decoder(hidden_size=0))
    with pytest.raises(ValueError, match="beam_size to be an integer >= 1, got 0"):
        CaptioningTask(20, beam_size=0)
    with pytest.raises(ValueError, match="val_caption_images >= -1"):
        CaptioningTask(20, val_caption_images=-2)
    with pytest.raises(ValueError, match="num_classes >= 5"):
        CaptioningTask(3)


# ---------------------------------------------------------------------------------- CLI
SYNTHETIC = "configs/captioning/synthetic.yaml"
HEAD_OVERLAYS = [
    "configs/captioning/synthetic_moc.yaml",
    "configs/captioning/synthetic_mos.yaml",
    "configs/captioning/synthetic_mixtape.yaml",
    "configs/captioning/synthetic_sigsoftmax.yaml",
]
COCO = "configs/captioning/coco_karpathy.yaml"


def shrink(tmp_path) -> list[str]:
    """The shipped config made tiny: same classes and code paths, seconds on a CPU."""
    return [
        "--data.init_args.num_train", "12", "--data.init_args.num_val", "6", "--data.init_args.num_test", "6",
        "--data.init_args.image_size", "32", "--data.init_args.batch_size", "6",
        "--model.init_args.decoder.init_args.embed_dim", "16", "--model.init_args.decoder.init_args.hidden_size", "16",
        "--model.init_args.meteor", "false", "--model.init_args.metric_tokenizer", "simple",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    ]


def test_fit_test_predict_through_the_cli(tmp_path):
    from app.main import main

    cli = main(["fit", "--config", SYNTHETIC, *shrink(tmp_path), "--trainer.max_epochs", "1"])
    metrics = cli.trainer.callback_metrics
    assert {"val/loss", "val/ppl", "val/BLEU-4", "val/CIDEr-D", "val/ROUGE-L"} <= set(metrics)
    fitted = check_hparams(cli.trainer.logger.log_dir, head="softmax", data="SyntheticScenes", metrics=["val/CIDEr-D"])
    checkpoint = cli.trainer.checkpoint_callback.best_model_path
    assert checkpoint.endswith(".ckpt")
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["hyper_parameters"]
    assert saved["encoder"]["class_path"] == "tasks.encoders.ResNetEncoder"  # the architecture, as configured
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = CaptioningTask.load_from_checkpoint(checkpoint)
    assert not [str(w.message) for w in caught if "nn.Module" in str(w.message)]
    assert loaded.encoder.arch == saved["encoder"]["init_args"]["arch"]

    results = tmp_path / "test_captions.json"
    cli = main(["test", "--config", SYNTHETIC, *shrink(tmp_path), "--ckpt_path", checkpoint, "--model.init_args.test_output", str(results)])
    assert {"test/loss", "test/BLEU-1", "test/CIDEr-D"} <= set(cli.trainer.callback_metrics)
    assert len(json.loads(results.read_text())) == 6
    # HPARAMS: CIDEr-D of validation for the fit, of test for the test run, under the same columns.
    assert fitted.columns["encoder"] == "ResNetEncoder+ShowTellDecoder" and fitted.columns["head"] == "softmax"
    test_run = read_hparams(read_events(cli.trainer.logger.log_dir))
    assert "test/CIDEr-D" in test_run.shown and all(name.startswith("test/") for name in test_run.shown)
    assert test_run.metrics == fitted.metrics and test_run.columns == fitted.columns

    predictions = tmp_path / "predict" / "captions.json"
    main(["predict", "--config", SYNTHETIC, *shrink(tmp_path), "--ckpt_path", checkpoint, "--model.init_args.predict_output", str(predictions)])
    written = json.loads(predictions.read_text())
    assert [r["image_id"] for r in written] == [20_000_000 + i for i in range(6)]  # the test split, in order
    assert all(set(r) == {"image_id", "caption"} and isinstance(r["caption"], str) for r in written)
    assert not list(predictions.parent.glob(".tmp-*"))  # written atomically


def head_factory_from_overlay(path: str):
    """The head an overlay selects, as the factory LightningCLI would build from it."""
    import functools
    import importlib

    import yaml

    with open(path, encoding="utf-8") as handle:
        head = yaml.safe_load(handle)["model"]["init_args"]["head"]
    module, _, name = head["class_path"].rpartition(".")
    return functools.partial(getattr(importlib.import_module(module), name), **head.get("init_args", {}))


def train_two_steps(model, data) -> list[float]:
    batch = next(iter(data.train_dataloader()))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        loss = model.token_nll(batch).sum() / (batch["caption_output"] != IGNORE_INDEX).sum()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def test_synthetic_config_composes_with_a_head_overlay_through_the_cli(tmp_path):
    """Mixtape: the overlay whose head needs the frequency-ordered vocabulary."""
    from app.main import main

    cli = main(["--config", SYNTHETIC, "--config", "configs/captioning/synthetic_mixtape.yaml", *shrink(tmp_path)], run=False)
    model, data = cli.model, cli.datamodule
    assert model.head.short_name == "mixtape" and model.head.num_classes == data.num_classes and data.frequency_ordered
    losses = train_two_steps(model, data)
    assert all(np.isfinite(losses)) and losses[1] < losses[0]


def test_class_counts_cover_every_training_target_and_seed_the_head_bias(scenes):
    counts = scenes.class_counts()
    captions = [p for r in scenes.records("train") for p in scenes.pieces(r)]
    assert counts.shape == (scenes.num_classes,) and counts[EOS_ID] == len(captions)
    assert counts.sum() == sum(min(len(p), scenes.max_length) + 1 for p in captions)
    import lightning.pytorch as pl

    model = CaptioningTask(scenes.num_classes, head="mos", unigram_bias_init=True, **TINY_MODEL)
    trainer = pl.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, datamodule=scenes)  # setup("fit") of a fresh run sets the biases
    torch.testing.assert_close(model.head.decoder.bias.detach(), torch.log((counts + 1.0) / (counts + 1.0).sum()))


def test_bpe_mos_overlay_trains_mos_over_bpe_pieces_through_the_cli(tmp_path):
    """Seed 002's BPE-MoS: the overlay switches both the vocabulary (sentencepiece pieces) and the head."""
    from app.main import main

    cli = main(["--config", SYNTHETIC, "--config", "configs/captioning/synthetic_bpe_mos.yaml", *shrink(tmp_path),
                "--data.init_args.num_train", "200", "--data.init_args.bpe_cache_dir", str(tmp_path / "bpe")], run=False)
    model, data = cli.model, cli.datamodule
    assert data.text_tokenizer.kind == "bpe" and model.head.short_name == "mos" and model.head.num_components == 3
    assert model.head.num_classes == data.num_classes
    record = data.records("val")[0]
    assert data.decode(data.vocab.encode(data.pieces(record)[0])) == record.captions[0]
    losses = train_two_steps(model, data)
    assert all(np.isfinite(losses)) and losses[1] < losses[0]


def test_hybrid_lightrnn_mos_overlay_fits_with_table_reallocation(tmp_path):
    from app.main import main

    cli = main(["fit", "--config", SYNTHETIC, "--config", "configs/captioning/synthetic_hybrid_lightrnn_mos.yaml",
                *shrink(tmp_path), "--trainer.max_epochs", "2"])
    head = cli.model.head
    assert head.short_name == "hybrid_lightrnn" and head.num_classes == cli.datamodule.num_classes
    assert head.num_exclusive == 8 and head.first_head.num_components == 3
    assert "lightrnn/table_change" in cli.trainer.callback_metrics  # reallocated after epoch 1
    assert torch.isfinite(cli.trainer.callback_metrics["val/loss"])


@pytest.mark.parametrize("overlay", HEAD_OVERLAYS)
def test_every_head_overlay_trains_in_the_captioning_model(scenes, overlay):
    """Each overlay's head (built from its YAML, as the CLI does) trains inside NIC (the CLI
    composition itself is covered above; a CLI parse per head would cost seconds)."""
    model = CaptioningTask(scenes.num_classes, head=head_factory_from_overlay(overlay), **TINY_MODEL)
    assert model.head.short_name == overlay.rsplit("_", 1)[1].removesuffix(".yaml")
    losses = train_two_steps(model, scenes)
    assert all(np.isfinite(losses)) and losses[1] < losses[0]


@pytest.mark.parametrize("overlay", [None, "configs/captioning/coco_karpathy_bpe_mos.yaml"])
def test_coco_paper_preset_runs_on_a_karpathy_fixture(tmp_path, overlay):
    from app.main import main

    annotations = write_karpathy_fixture(tmp_path)
    bpe = ["--config", overlay, "--data.init_args.bpe_vocab_size", "30"] if overlay else []
    cli = main([
        "fit", "--config", COCO, *bpe,
        "--data.init_args.annotations", annotations, "--data.init_args.image_root", str(tmp_path),
        "--data.init_args.image_size", "32", "--data.init_args.batch_size", "2", "--data.init_args.num_workers", "0",
        "--data.init_args.count_threshold", "1",
        "--model.init_args.encoder.init_args.weights", "null",  # no download in tests; loading is tested above
        "--model.init_args.meteor", "false", "--model.init_args.metric_tokenizer", "simple",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--trainer.fast_dev_run", "1", "--trainer.enable_progress_bar", "false",
    ])
    model = cli.model
    assert model.encoder.out_channels == 2048 and model.decoder.lstm.hidden_size == 512  # ResNet-101, LSTM-512
    assert not model.encoder.trainable and torch.isfinite(cli.trainer.callback_metrics["val/loss"])
    if overlay:  # BPE-MoS: MoS-3 over the pieces
        assert cli.datamodule.text_tokenizer.kind == "bpe" and model.head.num_components == 3


def test_feature_cache_serves_a_frozen_encoder_from_disk(scenes, tmp_path):
    task = CaptioningTask(scenes.num_classes, encoder=ResNetEncoder(trainable=False), feature_cache=str(tmp_path), **TINY_MODEL).eval()
    batch = collate_captions([scenes.dataset("val")[i] for i in range(2)])
    first = task.token_nll(batch)
    files = sorted(p.name for p in tmp_path.rglob("*.pt"))
    assert files == sorted(f"{int(i)}.pt" for i in batch["image_id"])
    with torch.no_grad():
        task.encoder.trunk[0].weight.mul_(-1.0)  # the CNN now computes other features...
    assert torch.equal(task.token_nll(batch), first)  # ...but the cached ones are read back
    other = CaptioningTask(scenes.num_classes, encoder=ResNetEncoder(trainable=False), feature_cache=str(tmp_path), **TINY_MODEL).eval()
    other.token_nll(batch)
    assert len({p.parent for p in tmp_path.rglob("*.pt")}) == 2  # other weights, other directory
    assert not list(tmp_path.rglob(".tmp-*")), "features are written atomically"
    damaged = sorted(tmp_path.rglob("*.pt"))[0]
    damaged.write_bytes(b"PK\x03\x04 cut short")  # a damaged cache file is computed again and rewritten
    recomputed = task.token_nll(batch)
    assert recomputed.shape == first.shape and torch.load(damaged, weights_only=True).dtype == torch.float16
    with pytest.raises(ValueError, match=r"needs a frozen encoder .*set model.init_args.encoder.init_args.trainable: false"):
        CaptioningTask(scenes.num_classes, feature_cache=str(tmp_path))
