"""``validate`` / ``test`` / ``predict --ckpt_path`` build the checkpoint's model.

The README's evaluation command names the task config (whose head is a softmax) and a checkpoint of
a MoS run: the checkpoint's hyper-parameters decide the head, the encoder and the sizes; a model
option the user writes explicitly (on the command line, or in a config after ``--ckpt_path``) wins;
asking for another class than the checkpoint holds is one error line naming both. Everything runs
through the real CLI, in-process (:func:`tests.shell.run_cli`); the default suite trains one model (a
head config given after ``--ckpt_path``: tests/test_checkpoint_safety.py), ``-m slow`` adds another
task, a second way of asking for another head and a size the weights do not fit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import TinyConfig
from tests.shell import ROOT, one_error_line, run_cli

SYNTHETIC = str(ROOT / "configs/lm/synthetic.yaml")
HIERARCHY = str(ROOT / "configs/hierarchy/ds10x10.yaml")

#: configs/lm/synthetic.yaml's data and trainer shrunk to seconds (the shared tiny config); no model option.
LM_DATA = TinyConfig().shrink(SYNTHETIC, model=False)
#: The trained model differs from the config's in head, head size and encoder sizes.
LM_MODEL = [
    "--config", str(ROOT / "configs/heads/mos.yaml"), "--model.init_args.head.init_args.num_components", "3",
    "--model.init_args.encoder.init_args.embedding_dim", "8", "--model.init_args.encoder.init_args.last_hidden_size", "12",
]
HIERARCHY_DATA = TinyConfig().shrink(HIERARCHY, model=False)
run_dirs = TinyConfig.dirs


@pytest.fixture(scope="module")
def mos_run(tmp_path_factory) -> Path:
    """A tiny MoS language model trained with configs/lm/synthetic.yaml + configs/heads/mos.yaml."""
    directory = tmp_path_factory.mktemp("mos")
    result = run_cli(["fit", "--config", SYNTHETIC, *LM_MODEL, *LM_DATA, *run_dirs(directory)], directory)
    assert result.returncode == 0, result.stderr[-3000:]
    return directory


def versions(directory: Path) -> list[Path]:
    """Every directory under the runs' log directory (a refused command adds none)."""
    return sorted(p for p in (directory / "runs").rglob("*") if p.is_dir())


def evaluated_model(directory: Path) -> dict:
    """The model section of the config.yaml the last evaluation saved (in the run it evaluated,
    ``version_N/test`` or ``version_N/validate``)."""
    newest = max((directory / "runs").glob("*/version_*/*/config.yaml"), key=lambda p: p.stat().st_mtime_ns)
    return yaml.safe_load(newest.read_text())["model"]["init_args"]


def test_the_readme_test_command_builds_the_checkpoints_model(mos_run):
    """``test --config configs/lm/synthetic.yaml --ckpt_path <MoS run>/last.ckpt`` (the README's
    command): the config's softmax head and sizes give way to the checkpoint's."""
    ckpt = mos_run / "runs/SyntheticLM-mos/version_0/checkpoints/last.ckpt"
    result = run_cli(["test", "--config", SYNTHETIC, "--ckpt_path", str(ckpt), *LM_DATA, *run_dirs(mos_run)], mos_run)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test/ppl" in result.stdout, result.stdout[-2000:]
    model = evaluated_model(mos_run)
    assert model["head"]["class_path"] == "heads.MixtureOfSoftmaxes"
    assert model["head"]["init_args"]["num_components"] == 3
    assert model["encoder"]["init_args"]["last_hidden_size"] == 12 and model["encoder"]["init_args"]["embedding_dim"] == 8


def test_a_model_option_given_explicitly_wins_over_the_checkpoint(mos_run):
    """An option only the checkpoint's head takes (MoS ``dropout``; the config's softmax has none)
    is applied on top of the checkpoint's model."""
    ckpt = mos_run / "runs/SyntheticLM-mos/version_0/checkpoints/last.ckpt"
    result = run_cli(["validate", "--config", SYNTHETIC, "--ckpt_path", str(ckpt), *LM_DATA, *run_dirs(mos_run),
                      "--model.init_args.head.init_args.dropout", "0.25"], mos_run)
    assert result.returncode == 0, result.stderr[-3000:]
    head = evaluated_model(mos_run)["head"]
    assert head["class_path"] == "heads.MixtureOfSoftmaxes"
    assert head["init_args"]["dropout"] == 0.25 and head["init_args"]["num_components"] == 3


@pytest.mark.parametrize("asked", [
    ["--model.init_args.head", "heads.Mixtape"],
    pytest.param(["--config", str(ROOT / "configs/heads/mixtape.yaml")], marks=pytest.mark.slow),
])
def test_asking_for_another_head_than_the_checkpoints_is_one_line_naming_both(mos_run, asked):
    ckpt = mos_run / "runs/SyntheticLM-mos/version_0/checkpoints/last.ckpt"
    before = versions(mos_run)
    result = run_cli(["predict", "--config", SYNTHETIC, "--ckpt_path", str(ckpt), *asked, *LM_DATA, *run_dirs(mos_run)],
                     mos_run)
    one_error_line(result, f"checkpoint {ckpt} holds a heads.mos.MixtureOfSoftmaxes head but the model builds "
                           f"heads.mixtape.Mixtape", "--model.init_args.head")
    assert versions(mos_run) == before


@pytest.mark.slow
def test_an_explicit_size_the_weights_do_not_fit_is_one_line(mos_run):
    ckpt = mos_run / "runs/SyntheticLM-mos/version_0/checkpoints/last.ckpt"
    result = run_cli(["test", "--config", SYNTHETIC, "--ckpt_path", str(ckpt), *LM_DATA, *run_dirs(mos_run),
                      "--model.init_args.encoder.init_args.last_hidden_size", "32"], mos_run)
    one_error_line(result, f"checkpoint {ckpt}: state_dict.encoder.", "but the model built from its hyper_parameters has", "sets another size than the checkpoint's, so drop it")


@pytest.mark.slow
def test_a_hierarchy_classifier_is_evaluated_with_its_ds_head(tmp_path):
    """Another task: a DS-Softmax classifier (configs/hierarchy/ds10x10.yaml, a 16-unit encoder)
    evaluated with the softmax baseline's config builds the DS head and the 16-unit encoder."""
    trained = run_cli(["fit", "--config", HIERARCHY,
                       "--model.init_args.encoder.init_args.hidden_sizes", "[16]", *HIERARCHY_DATA, *run_dirs(tmp_path)],
                      tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    (ckpt,) = (tmp_path / "runs").glob("*/version_0/checkpoints/last.ckpt")
    result = run_cli(["test", "--config", str(ROOT / "configs/hierarchy/softmax10x10.yaml"), "--ckpt_path", str(ckpt),
                      *HIERARCHY_DATA, *run_dirs(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    model = evaluated_model(tmp_path)
    assert model["head"]["class_path"] == "heads.DSSoftmax"
    assert model["encoder"]["init_args"]["hidden_sizes"] == [16]


def test_print_config_with_a_checkpoint_shows_the_model_the_command_builds(mos_run):
    """``test --config <softmax config> --ckpt_path <MoS run> --print_config`` prints the
    checkpoint's MoS model (what the command would evaluate), not the config file's softmax; it
    writes no run directory."""
    ckpt = mos_run / "runs/SyntheticLM-mos/version_0/checkpoints/last.ckpt"
    before = versions(mos_run)
    result = run_cli(["test", "--config", SYNTHETIC, "--ckpt_path", str(ckpt), *LM_DATA, *run_dirs(mos_run),
                      "--print_config"], mos_run)
    assert result.returncode == 0, result.stderr[-3000:]
    model = yaml.safe_load(result.stdout)["model"]["init_args"]
    assert model["head"]["class_path"] == "heads.MixtureOfSoftmaxes" and model["head"]["init_args"]["num_components"] == 3
    assert model["encoder"]["init_args"]["last_hidden_size"] == 12
    assert versions(mos_run) == before
