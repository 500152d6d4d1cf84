"""The ``config.yaml`` a run saves reproduces the run into a new version directory.

``fit --config runs/<name>/version_0/config.yaml`` must not write into ``version_0`` again (its
config overwritten, a second TensorBoard events file, ``last-v1.ckpt`` beside ``last.ckpt``): the
saved config holds the logger's name and version as written (``auto``, none), not the ones the run
derived. An explicit resume (``--ckpt_path``) still continues its own version. Real CLI, in-process
(:func:`tests.shell.run_cli`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import TinyConfig
from tests.shell import run_cli

#: configs/lm/synthetic.yaml shrunk to seconds (the shared tiny config).
TINY = TinyConfig().args("configs/lm/synthetic.yaml")


def digests(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def first_run(tmp_path) -> Path:
    """A tiny fit; returns its version directory (``runs/SyntheticLM-softmax/version_0``)."""
    result = run_cli(["fit", *TINY, *TinyConfig.dirs(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    version = tmp_path / "runs/SyntheticLM-softmax/version_0"
    assert (version / "config.yaml").is_file() and (version / "checkpoints/last.ckpt").is_file()
    return version


def test_rerunning_a_saved_config_starts_a_new_version_and_leaves_the_old_one_untouched(first_run, tmp_path):
    saved = yaml.safe_load((first_run / "config.yaml").read_text())["trainer"]["logger"]["init_args"]
    assert saved["version"] is None and saved["name"] == "auto", saved
    before = digests(first_run)
    result = run_cli(["fit", "--config", str(first_run / "config.yaml")], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    second = first_run.parent / "version_1"
    assert (second / "config.yaml").is_file() and (second / "checkpoints/last.ckpt").is_file()
    assert len(list(second.glob("events.out.tfevents.*"))) == 1
    assert digests(first_run) == before  # no file changed, none added (no last-v1.ckpt, no second events file)
    assert len(list(first_run.glob("events.out.tfevents.*"))) == 1
    assert sorted(p.name for p in first_run.parent.iterdir()) == ["version_0", "version_1"]


@pytest.mark.slow
def test_an_explicit_resume_from_a_saved_config_continues_its_own_version(first_run, tmp_path):
    """``fit --config <run>/config.yaml --ckpt_path <run>/checkpoints/last.ckpt`` continues that
    run in its version directory (no new version)."""
    last = first_run / "checkpoints/last.ckpt"
    steps = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    result = run_cli(["fit", "--config", str(first_run / "config.yaml"), "--ckpt_path", str(last),
                      "--trainer.max_epochs", "2"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in first_run.parent.iterdir()) == ["version_0"]
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == steps + 2
