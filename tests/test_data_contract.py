"""The data contract (datamodules/base.py) over every datamodule of the project, and the checkpoint
state it defines: a language model restored without its data samples words, not ids."""

from __future__ import annotations

import gzip
import importlib
import inspect
import io
import pkgutil
from functools import partial
from pathlib import Path
from typing import Callable

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

import datamodules
from datamodules.base import (
    DATA_LINKS,
    STATE_KEYS,
    FeatureInputs,
    HeadDataModule,
    SourceVocabulary,
    StateDecoder,
    as_head_datamodule,
    check_data_state,
)
from datamodules.captioning import CaptionDataModule, KarpathyCaptions
from datamodules.gnt import write_gnt
from datamodules.hanzi import CasiaHWDB, FontRenderedHanzi, HanziDataModule
from datamodules.hierarchy import HierarchyDataModule
from datamodules.lm import LanguageModelingDataModule
from datamodules.lm_synthetic import SyntheticLM
from datamodules.multi30k_captions import MULTI30K_FILES, Multi30kCaptions
from datamodules.scenes import SyntheticScenes
from datamodules.text_corpus import TextCorpus
from datamodules.translation import TranslationDataModule
from tasks.encoders import AWDLSTMEncoder
from tasks.language_model import LanguageModel

#: Bases that share machinery and hold no data of their own.
BASES = {HeadDataModule, LanguageModelingDataModule, CaptionDataModule, HanziDataModule}

WORDS = ["apple", "banana", "cherry", "damson", "elder", "fig", "grape"]


def project_datamodules() -> list[type]:
    """Every LightningDataModule class defined in a module of the datamodules package."""
    found = set()
    for module in pkgutil.walk_packages(datamodules.__path__, "datamodules."):
        loaded = importlib.import_module(module.name)
        for _, obj in inspect.getmembers(loaded, inspect.isclass):
            if issubclass(obj, pl.LightningDataModule) and obj.__module__ == loaded.__name__:
                found.add(obj)
    return sorted(found, key=lambda cls: cls.__qualname__)


def word_lines(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 7)))) for _ in range(count)]


def text_corpus(root: Path) -> TextCorpus:
    for split, count in (("train", 60), ("valid", 10), ("test", 10)):
        (root / f"ptb.{split}.txt").write_text("\n".join(word_lines(count, len(split))) + "\n")
    return TextCorpus("ptb", str(root), batch_size=2, eval_batch_size=2, bptt=5)


def multi30k(root: Path) -> Multi30kCaptions:
    for split, names in MULTI30K_FILES.items():
        for i, name in enumerate(names):
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(gzip.compress("\n".join(word_lines(6, i)).encode()))
    return Multi30kCaptions(str(root), max_vocab=6, cache=False)


def karpathy(root: Path) -> KarpathyCaptions:
    import json

    from PIL import Image

    images = []
    for i, split in enumerate(("train", "train", "val", "test")):
        Image.new("RGB", (8, 8), (30 * i, 0, 0)).save(root / f"{i}.png")
        sentences = [{"raw": line, "tokens": line.split(), "imgid": i, "sentid": 2 * i + j}
                     for j, line in enumerate(word_lines(2, i))]
        images.append({"filepath": "", "filename": f"{i}.png", "imgid": i, "split": split, "sentences": sentences, "cocoid": i})
    (root / "dataset.json").write_text(json.dumps({"images": images, "dataset": "coco"}))
    return KarpathyCaptions(str(root / "dataset.json"), str(root), count_threshold=1, image_size=16)


def casia(root: Path) -> CasiaHWDB:
    pixels = np.full((6, 5), 200, dtype=np.uint8)
    for folder, writer in (("train", 1001), ("test", 1241)):
        (root / folder).mkdir()
        write_gnt(root / folder / f"{writer}-c.gnt", [(ch, pixels) for ch in "啊阿埃"])
    return CasiaHWDB(str(root / "train"), str(root / "test"), label_set="all", cache_dir=str(root / "cache"))


#: A cheap instance of every datamodule on data generated here or offline defaults.
FACTORIES: dict[type, Callable[[Path], HeadDataModule]] = {
    SyntheticLM: lambda root: SyntheticLM(vocab_size=12, train_tokens=300, valid_tokens=50, test_tokens=50),
    TextCorpus: text_corpus,
    Multi30kCaptions: multi30k,
    HierarchyDataModule: lambda root: HierarchyDataModule(num_super=2, num_sub=3, num_features=4),
    SyntheticScenes: lambda root: SyntheticScenes(num_train=4, num_val=2, num_test=2, image_size=16),
    KarpathyCaptions: karpathy,
    TranslationDataModule: lambda root: TranslationDataModule(
        "synthetic", str(root), src_lang="src", tgt_lang="tgt", tokenizer="bpe", vocab_size=40, synthetic_size=60, cache_dir=str(root / "bpe")),
    FontRenderedHanzi: lambda root: FontRenderedHanzi(num_classes_limit=5, cache_dir=str(root)),
    CasiaHWDB: casia,
}


def test_every_datamodule_derives_from_the_contract_and_has_a_contract_case():
    classes = project_datamodules()
    outside = [cls.__qualname__ for cls in classes if not issubclass(cls, HeadDataModule)]
    assert not outside, f"datamodules not on datamodules.base.HeadDataModule: {outside}"
    assert set(classes) - BASES == set(FACTORIES), "add a FACTORIES entry for every new datamodule"


@pytest.mark.parametrize("cls", list(FACTORIES), ids=lambda cls: cls.__name__)
def test_datamodule_keeps_the_contract(cls, tmp_path):
    data = FACTORIES[cls](tmp_path)
    assert isinstance(data, HeadDataModule)
    # Sizes are ints > 0 before prepare_data / setup: the CLI links them at instantiation.
    for name in DATA_LINKS:
        if hasattr(type(data), name):
            value = getattr(data, name)
            assert isinstance(value, int) and not isinstance(value, bool) and value > 0, (name, value)
    assert isinstance(data, SourceVocabulary) == hasattr(type(data), "source_vocab_size")
    assert isinstance(data, FeatureInputs) == hasattr(type(data), "num_features")
    names = data.class_names
    assert len(names) == data.num_classes and all(isinstance(n, str) for n in names)
    assert isinstance(data.frequency_ordered, bool)

    state = data.state_for_checkpoint()
    assert tuple(state) == STATE_KEYS and check_data_state(state) is state
    assert state["class_names"] == names
    assert (state["source_vocabulary"] is None) == (not isinstance(data, SourceVocabulary))
    if isinstance(data, SourceVocabulary):
        assert len(state["source_vocabulary"]) == data.source_vocab_size
    buffer = io.BytesIO()  # a checkpoint is read with weights_only=True: the state must load that way
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state

    # The checkpoint's state alone decodes ids as the datamodule does.
    ids = [(7 * i + 4) % data.num_classes for i in range(6)]
    assert StateDecoder(state).decode(ids) == data.decode(ids) != ""
    data.load_state_for_checkpoint(state)
    assert data.class_names == names

    counts = data.class_counts()
    if counts is not None:
        assert counts.shape == (data.num_classes,) and counts.dtype == torch.long and int(counts.sum()) > 0


def test_a_state_outside_the_schema_is_one_line_naming_the_keys():
    with pytest.raises(ValueError) as info:
        check_data_state({"vocabulary": ["<unk>"]})
    message = str(info.value)
    assert "\n" not in message and "missing class_names" in message and "unknown vocabulary" in message


def test_a_datamodule_off_the_contract_is_refused_in_one_line():
    class Foreign(pl.LightningDataModule):
        pass

    with pytest.raises(TypeError, match="is not a datamodules.base.HeadDataModule") as info:
        as_head_datamodule(Foreign())
    assert "\n" not in str(info.value)


def test_language_model_restored_without_its_datamodule_samples_words(tmp_path):
    data = text_corpus(tmp_path)
    encoder = partial(AWDLSTMEncoder, embedding_dim=8, hidden_size=8, num_layers=1)
    model = LanguageModel(data.num_classes, encoder=encoder, tie_weights=False, eval_topk=(1,))
    trainer = pl.Trainer(max_steps=2, limit_val_batches=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=data)
    path = tmp_path / "lm.ckpt"
    trainer.save_checkpoint(path)

    restored = LanguageModel.load_from_checkpoint(path).eval()  # the checkpoint alone
    assert restored.datamodule is None
    samples = restored.sample(num_samples=3, length=12)
    tokens = [token for line in samples for token in line.split()]
    assert len(tokens) == 36
    assert set(tokens) <= set(data.class_names), samples  # words of the vocabulary, never ids
    assert set(tokens) & set(WORDS), samples
