"""Shared fixtures: tests are fast, offline and deterministic.

``tiny`` is the one tiny configuration every CLI test derives from: the real YAML in configs/,
composed as the user composes it (``--config`` task/data file, ``--config`` head file), then shrunk
by options only — a few batches, tiny data and network sizes, CPU, no DataLoader workers, no
progress bar, and every log and checkpoint under the test's directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

# Tests use tiny tensors: one thread avoids thread start-up overhead and oversubscription when
# the 2-core machine is busy (measured 10-20x slower tiny convolutions with 2 threads under load).
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent

#: Every run: one epoch of two batches, no sanity check, CPU, nothing drawn on the terminal.
TRAINER = [
    "--trainer.accelerator", "cpu", "--trainer.devices", "1",
    "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "2",
    "--trainer.limit_test_batches", "2", "--trainer.limit_predict_batches", "2", "--trainer.num_sanity_val_steps", "0",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
]

#: Options that shrink a config, by the class_path it names for data or for the model's encoder.
SHRINK = {
    "datamodules.SyntheticLM": [
        "--data.init_args.vocab_size", "40", "--data.init_args.train_tokens", "2000",
        "--data.init_args.valid_tokens", "400", "--data.init_args.test_tokens", "400",
        "--data.init_args.batch_size", "4", "--data.init_args.eval_batch_size", "4", "--data.init_args.bptt", "8",
        "--data.init_args.num_workers", "0",
    ],
    "datamodules.TextCorpus": [
        "--data.init_args.batch_size", "4", "--data.init_args.eval_batch_size", "4", "--data.init_args.bptt", "8",
        "--data.init_args.num_workers", "0",
    ],
    "datamodules.hierarchy.HierarchyDataModule": [
        "--data.init_args.train_per_class", "4", "--data.init_args.val_per_class", "1",
        "--data.init_args.test_per_class", "2", "--data.init_args.num_workers", "0",
    ],
    "tasks.encoders.AWDLSTMEncoder": [
        "--model.init_args.encoder.init_args.embedding_dim", "8", "--model.init_args.encoder.init_args.hidden_size", "16",
        "--model.init_args.encoder.init_args.num_layers", "1", "--model.init_args.encoder.init_args.last_hidden_size", "8",
    ],
}


class TinyConfig:
    """Command-line arguments for a shipped config shrunk to a seconds-long run.

    ``args(*configs, directory=d)`` is ``--config`` for each file of ``configs`` (relative to the
    project or absolute), then :meth:`shrink` of them and :meth:`dirs` of ``d``. A test that needs
    more (a second epoch, another head) appends its options: the last value on the command line wins.
    ``model=False`` leaves the model's sizes alone (an evaluation whose checkpoint decides them).
    """

    root = ROOT
    trainer = TRAINER

    def args(self, *configs: str | Path, directory: Path | None = None, model: bool = True) -> list[str]:
        args = [option for path in self.files(configs) for option in ("--config", str(path))]
        args += self.shrink(*configs, model=model)
        return args + (self.dirs(directory) if directory is not None else [])

    def shrink(self, *configs: str | Path, model: bool = True) -> list[str]:
        """The options that shrink ``configs`` composed in order: data, encoder (unless
        ``model=False``) and :data:`TRAINER`."""
        data, encoder = self.class_paths(self.files(configs))
        return [*SHRINK.get(data, []), *(SHRINK.get(encoder, []) if model else []), *TRAINER]

    @staticmethod
    def files(configs: tuple[str | Path, ...]) -> list[Path]:
        return [Path(config) if Path(config).is_absolute() else ROOT / config for config in configs]

    @staticmethod
    def dirs(directory: Path) -> list[str]:
        """Logs (TensorBoard ``runs/``) and checkpoints under ``directory``."""
        return ["--trainer.default_root_dir", str(directory), "--trainer.logger.init_args.save_dir", str(directory / "runs")]

    @staticmethod
    def class_paths(files: list[Path]) -> tuple[str | None, str | None]:
        """The data and encoder ``class_path`` of ``files`` composed in order (a later file wins)."""
        data = encoder = None
        for path in files:
            config = yaml.safe_load(path.read_text()) or {}
            data = (config.get("data") or {}).get("class_path", data)
            init = ((config.get("model") or {}).get("init_args") or {})
            encoder = (init.get("encoder") or {}).get("class_path", encoder) if isinstance(init.get("encoder"), dict) else encoder
        return data, encoder


@pytest.fixture(scope="session")
def tiny() -> TinyConfig:
    """The shared tiny configuration (see :class:`TinyConfig`)."""
    return TinyConfig()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
