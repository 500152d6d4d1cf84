"""``fit --pretrained.checkpoint``: a new head trained on the network of a trained run (DS-Softmax
§3's recipe), through the real CLI on the shared tiny synthetic language model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.main import main

ROOT = Path(__file__).resolve().parent.parent
LM = "configs/lm/synthetic.yaml"
DS8 = "configs/heads/ds8.yaml"


@pytest.fixture(scope="module")
def softmax_run(tiny, tmp_path_factory) -> Path:
    """The last checkpoint of a tiny softmax language model (stage one of the recipe)."""
    directory = tmp_path_factory.mktemp("softmax")
    main(["fit", *tiny.args(LM, directory=directory)])
    return next(directory.rglob("last.ckpt"))


def network(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value for name, value in state.items() if not name.startswith("head.")}


def test_the_ds_preset_trains_only_its_head_on_the_checkpoint_network(tiny, tmp_path, softmax_run):
    """configs/heads/ds8.yaml (freeze_steps -1, Algorithm 1): every weight but the head's is the
    softmax run's after training; the DS head trained."""
    saved = network(torch.load(softmax_run, weights_only=True)["state_dict"])
    cli = main(["fit", *tiny.args(LM, DS8, directory=tmp_path), "--pretrained.checkpoint", str(softmax_run)])
    model = cli.model
    assert cli.trainer.global_step == 2 and type(model.head).__name__ == "DSSoftmax"
    trained = network(model.state_dict())
    assert trained.keys() == saved.keys() and all(torch.equal(trained[name], saved[name]) for name in saved)


def test_after_freeze_steps_the_network_trains_from_the_checkpoint(tiny, tmp_path, softmax_run):
    """freeze_steps 1 of a two-step run: the network is unfrozen after step 1 and moves from the
    checkpoint's values (by a small step, so it started there)."""
    saved = network(torch.load(softmax_run, weights_only=True)["state_dict"])
    cli = main(["fit", *tiny.args(LM, DS8, directory=tmp_path), "--pretrained.checkpoint", str(softmax_run),
                "--pretrained.freeze_steps", "1"])
    trained = network(cli.model.state_dict())
    moved = [name for name in saved if not torch.equal(trained[name], saved[name])]
    assert moved and all(torch.allclose(trained[name], saved[name], atol=0.05) for name in saved)
    assert all(parameter.requires_grad for parameter in cli.model.parameters())


def test_a_run_on_other_data_is_refused_in_one_line_and_leaves_no_run(tiny, tmp_path, softmax_run):
    """Another vocabulary of the same size (another data seed) is refused before anything is written."""
    with pytest.raises(ValueError, match=r"--pretrained.checkpoint .* fingerprint .*start from a run of the same task and data"):
        main(["fit", *tiny.args(LM, DS8, directory=tmp_path), "--data.init_args.seed", "7",
              "--pretrained.checkpoint", str(softmax_run)])
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("events.out.tfevents.*"))


def test_another_encoder_size_is_refused_naming_the_weight(tiny, tmp_path, softmax_run):
    """A network built with other sizes names the first weight that differs and both shapes."""
    with pytest.raises(ValueError, match=r"the network's encoder\.\S+ is float32 \(\d+, \d+\) but the checkpoint has float32"):
        main(["fit", *tiny.args(LM, directory=tmp_path), "--model.init_args.encoder.init_args.last_hidden_size", "12",
              "--pretrained.checkpoint", str(softmax_run)])


@pytest.mark.slow  # DDP: two processes
def test_under_two_process_ddp_the_network_unfreezes_after_freeze_steps_and_ranks_agree(tiny, tmp_path, softmax_run):
    """FreezeNetwork under real DDP (two gloo processes): with freeze_steps 1 of a two-step run the
    network holds the checkpoint's values after step 1 and trains in step 2 (the DDP wrapper rebuilt
    over the unfrozen parameters), and both ranks hold the same weights after every step."""
    saved = network(torch.load(softmax_run, weights_only=True)["state_dict"])
    args = [sys.executable, "-m", "app", "fit", *tiny.args(LM, DS8, directory=tmp_path),
            "--pretrained.checkpoint", str(softmax_run), "--pretrained.freeze_steps", "1",
            "--trainer.devices", "2", "--trainer.strategy", "ddp",
            "--trainer.callbacks+=tests.test_ddp_lm.RecordSteps", f"--trainer.callbacks.directory={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert ranks[0]["world_size"] == 2 and len(ranks[0]["steps"]) == len(ranks[1]["steps"]) == 2
    for first, second in zip(ranks[0]["steps"], ranks[1]["steps"]):
        assert all(torch.equal(first["params"][name], second["params"][name]) for name in first["params"])
    after_frozen, after_free = (network(step["params"]) for step in ranks[0]["steps"])
    assert all(torch.equal(after_frozen[name], saved[name]) for name in saved)
    assert any(not torch.equal(after_free[name], saved[name]) for name in saved)
