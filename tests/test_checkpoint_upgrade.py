"""A task class's ``upgrade_checkpoint`` hook turns checkpoints of an older form into today's on
every read: ``--ckpt_path`` (the CLI's hyper-parameter merge and the Trainer's restore through
``AtomicCheckpointIO``) and ``restore`` (analyze, convert, bench)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.checkpoint_io import AtomicCheckpointIO, checkpoint_model_config, project_class, read_checkpoint, restore
from tasks import LanguageModel
from tests.test_disk import TINY

LM = [*TINY, "--trainer.max_epochs", "1", "--trainer.limit_test_batches", "2"]


def legacy_form(checkpoint: dict) -> dict:
    """The checkpoint as an older LanguageModel would have written it: ``tie_weights`` called
    ``tie_embeddings`` and the encoder's parameters under ``old_encoder.``."""
    hparams = dict(checkpoint["hyper_parameters"])
    hparams["tie_embeddings"] = hparams.pop("tie_weights")
    state = {("old_" + k if k.startswith("encoder.") else k): v for k, v in checkpoint["state_dict"].items()}
    return {**checkpoint, "hyper_parameters": hparams, "state_dict": state}


def upgrade(cls, checkpoint: dict) -> dict:
    """Idempotent: a checkpoint in today's form is returned unchanged."""
    if "tie_embeddings" not in (checkpoint.get("hyper_parameters") or {}):
        return checkpoint
    hparams = dict(checkpoint["hyper_parameters"])
    hparams["tie_weights"] = hparams.pop("tie_embeddings")
    state = {k.removeprefix("old_"): v for k, v in checkpoint["state_dict"].items()}
    return {**checkpoint, "hyper_parameters": hparams, "state_dict": state}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from app.main import main

    directory = tmp_path_factory.mktemp("upgrade")
    cli = main(["fit", *LM, "--trainer.default_root_dir", str(directory),
                "--trainer.logger.init_args.save_dir", str(directory / "runs")])
    current = Path(cli.trainer.checkpoint_callback.last_model_path)
    legacy = directory / "legacy.ckpt"
    torch.save(legacy_form(torch.load(current, map_location="cpu", weights_only=True)), legacy)
    return {"current": current, "legacy": legacy}


def test_without_the_hook_an_old_form_is_refused(checkpoints):
    with pytest.raises(ValueError, match="'tie_embeddings', which LanguageModel does not take"):
        read_checkpoint(checkpoints["legacy"])


def test_every_reader_applies_the_hook(checkpoints, monkeypatch):
    monkeypatch.setattr(LanguageModel, "upgrade_checkpoint", classmethod(upgrade), raising=False)
    current = torch.load(checkpoints["current"], map_location="cpu", weights_only=True)
    legacy = str(checkpoints["legacy"])

    read = read_checkpoint(legacy)
    assert read["hyper_parameters"]["tie_weights"] == current["hyper_parameters"]["tie_weights"]
    assert set(read["state_dict"]) == set(current["state_dict"])
    assert set(AtomicCheckpointIO().load_checkpoint(legacy)["state_dict"]) == set(current["state_dict"])
    assert checkpoint_model_config(legacy, "tasks.LanguageModel")["dict_kwargs"]["tie_weights"] is False

    # A dictionary that did not come through read_checkpoint (built in memory) is upgraded too.
    model, _ = restore(legacy, legacy_form(current), data=False)
    for name, value in model.state_dict().items():
        assert torch.equal(value, current["state_dict"][name]), name


def test_a_test_run_from_an_old_form_scores_like_the_current_one(checkpoints, monkeypatch, tmp_path):
    from app.main import main

    monkeypatch.setattr(LanguageModel, "upgrade_checkpoint", classmethod(upgrade), raising=False)
    losses = []
    for name in ("current", "legacy"):
        cli = main(["test", *LM, "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path / name),
                    "--ckpt_path", str(checkpoints[name])])
        losses.append(float(cli.trainer.callback_metrics["test/loss"]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


def test_the_allow_list_takes_classes_of_subpackages():
    import lightning.pytorch as pl

    from datamodules.translation.datamodule import TranslationDataModule

    cls = project_class("datamodules.translation.datamodule.TranslationDataModule", pl.LightningDataModule, "data", "x.ckpt")
    assert cls is TranslationDataModule
