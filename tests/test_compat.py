"""Checkpoints written before modules moved still load and score the same through the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.shell import ROOT, run_app

FIXTURES = ROOT / "tests" / "fixtures" / "pre_restructure"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["checkpoints"]
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def arguments(name: str, tmp_path: Path) -> list[str]:
    return [arg.replace("{tmp}", str(tmp_path)) for arg in MANIFEST[name]["args"]]


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_checkpoint_written_before_the_move_tests_to_the_same_loss(name, tmp_path):
    result = run_app(["test", *arguments(name, tmp_path), "--ckpt_path", str(FIXTURES / f"{name}.ckpt"), *QUIET,
                      "--trainer.logger", "false", "--trainer.limit_test_batches", "2",
                      "--trainer.default_root_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    losses = re.findall(r"test/loss\W+([0-9.e+-]+)", result.stdout)
    assert losses, result.stdout[-2000:]
    assert float(losses[0]) == pytest.approx(MANIFEST[name]["test_loss"], rel=1e-5, abs=1e-6)


def test_ds_run_written_before_the_move_resumes_with_its_callbacks(tmp_path):
    """A resumed DS-Softmax run restores the mitosis / pruning callbacks' state by class name."""
    before = torch.load(FIXTURES / "lm_ds16.ckpt", map_location="cpu", weights_only=True)
    result = run_app(["fit", *arguments("lm_ds16", tmp_path), "--ckpt_path", str(FIXTURES / "lm_ds16.ckpt"), *QUIET,
                      "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
                      "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")])
    assert result.returncode == 0, result.stderr[-3000:]
    last = next((tmp_path / "runs").rglob("last.ckpt"))
    after = torch.load(last, map_location="cpu", weights_only=True)
    assert after["epoch"] == before["epoch"] + 1
    assert after["global_step"] == before["global_step"] + 2
    assert set(after["callbacks"]) == set(before["callbacks"]), "callback state keys changed"


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_lightning_load_from_checkpoint_reads_a_checkpoint_written_before_the_move(name):
    """``Task.load_from_checkpoint`` (Lightning's API, as used in a notebook) rewrites the old
    form like the project's reader and yields the same weights as ``restore``."""
    from app.checkpoint_io import restore
    from tasks import ClassificationTask, LanguageModel, TranslationTask

    task = {"lm": LanguageModel, "translation": TranslationTask, "hierarchy": ClassificationTask}[name.split("_")[0]]
    path = FIXTURES / f"{name}.ckpt"
    loaded = task.load_from_checkpoint(str(path), map_location="cpu")
    restored, _ = restore(str(path), data=False)
    assert type(loaded) is type(restored) and type(loaded.head) is type(restored.head)
    expected = restored.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_lightning_load_from_checkpoint_refuses_a_class_path_outside_the_project(tmp_path):
    """The nested ``class_path`` Lightning's instantiator would import as written is checked first."""
    from tasks import LanguageModel

    checkpoint = torch.load(FIXTURES / "lm_mos.ckpt", map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"]["head"] = {"class_path": "subprocess.Popen", "init_args": {"args": ["true"]}}
    path = tmp_path / "evil.ckpt"
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match="subprocess.Popen"):
        LanguageModel.load_from_checkpoint(str(path), map_location="cpu")
