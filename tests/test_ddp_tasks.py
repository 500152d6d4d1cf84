"""Real DDP on CPU (two gloo processes) for translation, captioning and classification.

The language-model version is tests/test_ddp_lm.py; these tests prove the same claims of issue 9
item 1 for the other tasks, each through ``python -m app fit ... --trainer.devices 2
--trainer.strategy ddp --trainer.accelerator cpu`` against one process on the same global batch:

* the two ranks' training batches together are the single process's batch (recorded per step);
* the loss (mean of the ranks' losses) and every parameter after each step agree within 1e-6
  relative, although the ranks hold different numbers of target tokens (each rank divides its
  summed loss by the *global* mean count, ``tasks.classification.global_mean_count``);
* validation metrics are sums over ranks in which every sample counts exactly once: the split
  sizes are odd, so a ``DistributedSampler`` would have repeated one sample.

Dropout is off (each process would draw its own masks).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from app.main import main
from datamodules.translation import TokenBatchStream, TranslationDataModule, collate
from tests.test_ddp_lm import relative

ROOT = Path(__file__).resolve().parent.parent
QUIET = [
    "--trainer.max_epochs", "1", "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false", "--trainer.log_every_n_steps", "1", "--trainer.accelerator", "cpu",
]


class RecordBatches(pl.Callback):
    """Writes, per rank, each training step's sample identities (``batch[identity]``), its
    number of targets (``batch[target] != -100``), the loss, the gradients the optimizer receives
    (after DDP's all-reduce) and the parameters after the step, plus the final validation
    metrics, to ``<directory>/rank<r>.pt``."""

    def __init__(self, directory: str, identity: str, target: str) -> None:
        self.directory, self.identity, self.target = directory, identity, target
        self.steps: list[dict] = []
        self._grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._grads = {k: p.grad.detach().cpu().clone() for k, p in pl_module.named_parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({
            "identity": batch[self.identity].cpu().clone(),
            "targets": int((batch[self.target] != -100).sum()),
            "loss": float(outputs["loss"]),
            "grads": self._grads,
            "params": {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()},
        })

    def on_fit_end(self, trainer, pl_module) -> None:
        self._save(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "validate":  # `python -m app validate`: no fit end
            self._save(trainer)

    def _save(self, trainer) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        torch.save({"steps": self.steps, "val": metrics, "world_size": trainer.world_size},
                   os.path.join(self.directory, f"rank{trainer.global_rank}.pt"))


class MergedRankBatches(TranslationDataModule):
    """The one-process reference of a ``simulated_world``-process translation run: training step
    ``k`` is the union of the token batches the ranks take at step ``k`` (rank 0's sentences
    first), i.e. the DDP run's global batch. Token batching has no other single-process
    equivalent: one process with ``W x max_tokens`` would cut the sorted corpus differently."""

    def __init__(self, simulated_world: int = 2, **kwargs) -> None:
        super().__init__(**kwargs)
        self.simulated_world = simulated_world

    def train_dataloader(self) -> DataLoader:
        hp, W = self.hparams, self.simulated_world
        examples = self.examples("train")
        shares = [TokenBatchStream(examples, hp.max_tokens, hp.max_sentences, True, hp.seed, rank, W, True).batches(self._current_epoch())
                  for rank in range(W)]
        steps = [collate([examples[i] for share in shares for i in share[k]]) for k in range(len(shares[0]))]
        return DataLoader(steps, batch_size=None)


def fit(tmp_path: Path, name: str, devices: int, args: list[str], identity: str, target: str, command_name: str = "fit") -> list[dict]:
    """``python -m app fit`` (or ``command_name``) with ``devices`` gloo processes (1: in this
    process); the per-rank records of :class:`RecordBatches`."""
    out = tmp_path / f"{name}-devices{devices}"
    out.mkdir()
    callbacks = out / "callbacks.yaml"
    callbacks.write_text(
        "trainer:\n  callbacks:\n    - class_path: tests.test_ddp_tasks.RecordBatches\n"
        f"      init_args: {{directory: {str(out)!r}, identity: {identity}, target: {target}}}\n"
    )
    command = [sys.executable, "-m", "app", command_name, *args, *QUIET, "--config", str(callbacks),
               "--trainer.devices", str(devices), "--trainer.strategy", "ddp" if devices > 1 else "auto",
               "--trainer.default_root_dir", str(out), "--trainer.logger.init_args.save_dir", str(out / "runs")]
    if devices == 1:
        main(command[3:])
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        done = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(devices)]


def sorted_rows(rows: torch.Tensor) -> torch.Tensor:
    """Rows in lexicographic order (compares two batches as multisets of samples)."""
    flat = rows.flatten(1).double()
    order = sorted(range(flat.size(0)), key=lambda i: flat[i].tolist())
    return flat[order]


def check_same_steps(single: dict, ranks: list[dict], same_batch) -> list[tuple[float, float]]:
    """Asserts the global batch, the loss, the gradients and the parameters of every step;
    returns each step's (loss, worst gradient, worst parameter) relative difference."""
    assert ranks[0]["world_size"] == 2 and len(single["steps"]) == len(ranks[0]["steps"]) == len(ranks[1]["steps"]) >= 1
    figures = []
    for step, reference in enumerate(single["steps"]):
        parts = [rank["steps"][step] for rank in ranks]
        assert same_batch([p["identity"] for p in parts], reference["identity"]), f"step {step + 1}: not the same global batch"
        assert sum(p["targets"] for p in parts) == reference["targets"]
        loss = sum(p["loss"] for p in parts) / 2
        loss_difference = abs(loss - reference["loss"]) / abs(reference["loss"])
        assert loss_difference <= 1e-6, (step, loss, reference["loss"])
        assert reference["grads"].keys() == parts[0]["grads"].keys() and reference["grads"]
        worst_grad = 0.0
        for name, value in reference["grads"].items():
            difference = relative(parts[0]["grads"][name], value)
            assert difference <= 1e-6, f"step {step + 1}: gradient of {name} differs from 1 process by {difference:.3g} (relative)"
            worst_grad = max(worst_grad, difference)
        worst = 0.0
        for name, value in reference["params"].items():
            assert torch.equal(parts[0]["params"][name], parts[1]["params"][name]), f"ranks diverged at {name}"
            difference = relative(parts[0]["params"][name], value)
            assert difference <= 1e-6, f"step {step + 1}: {name} differs from 1 process by {difference:.3g} (relative)"
            worst = max(worst, difference)
        # Shown with pytest -s; docs/results/reliability.md (R2) records these figures.
        print(f"step {step + 1}: targets per rank {[p['targets'] for p in parts]}, loss relative difference "
              f"{loss_difference:.2e}, largest gradient relative difference {worst_grad:.2e}, "
              f"largest parameter relative difference {worst:.2e}")
        figures.append((loss_difference, worst_grad, worst))
    return figures


def check_same_validation(single: dict, ranks: list[dict], names: list[str]) -> None:
    for name in names:
        one, two = single["val"][name], ranks[0]["val"][name]
        assert two == pytest.approx(one, rel=1e-6, abs=1e-9), name
        print(f"{name}: 1 process {one:.8f}, 2 processes {two:.8f}")


# ---------------------------------------------------------------------------------- translation
def translation_args(tmp_path: Path) -> list[str]:
    """configs/translation/synthetic_lstm.yaml shrunk: 210 training pairs, 21 validation pairs
    (odd), a 16-wide LSTM, token batches of at most 60 tokens.

    SGD instead of the config's Adam: Adam's first step ``lr * g / (|g| + eps)`` turns a
    float-rounding difference (summation order) in a gradient element of size ~eps into a visible
    parameter change (measured with Adam: 1 of 512 elements of ``bridge_c.weight`` moved 8.9e-6,
    3.8e-6 relative to the tensor, while every gradient agreed within 1e-6); the gradients are the
    claim, and SGD carries them into the parameters linearly."""
    return [
        "--config", str(ROOT / "configs/translation/synthetic_lstm.yaml"),
        "--data.init_args.data_dir", str(tmp_path / "corpus"), "--data.init_args.cache_dir", str(tmp_path / "cache"),
        "--data.init_args.synthetic_size", "210", "--data.init_args.max_tokens", "60",
        "--model.init_args.network.init_args.embed_dim", "16", "--model.init_args.network.init_args.hidden_size", "16",
        "--model.init_args.val_bleu_sentences", "-1", "--trainer.limit_train_batches", "2",
        "--model.init_args.optimizer.class_path", "torch.optim.SGD", "--model.init_args.optimizer.init_args.lr", "0.5",
    ]


@pytest.mark.slow  # DDP: two processes
def test_translation_two_processes_equal_one_process(tmp_path):
    """Token batches give the ranks different numbers of target tokens at every step: the step
    is exact only because each rank divides by the global mean token count. Validation decodes
    every sentence once (strided shares, an unscored filler batch for a short rank)."""
    args = translation_args(tmp_path)
    corpus = tmp_path / "corpus" / "size210-seed0"  # where the datamodule writes the generated pair
    single = fit(tmp_path, "translation", 1, [*args, "--data", "tests.test_ddp_tasks.MergedRankBatches",
                                             "--data.init_args.simulated_world", "2"], "index", "target_output")[0]
    ranks = fit(tmp_path, "translation", 2, args, "index", "target_output")

    def same_batch(parts, reference):
        return torch.equal(torch.cat(parts), reference)

    check_same_steps(single, ranks, same_batch)
    assert any(s["targets"] != t["targets"] for s, t in zip(ranks[0]["steps"], ranks[1]["steps"])), \
        "the ranks should hold different numbers of target tokens (else the test proves less)"
    valid_lines = (corpus / "valid.src").read_text().splitlines()
    assert len(valid_lines) % 2 == 1
    tokens = sum(len(line.split()) + 1 for line in (corpus / "valid.tgt").read_text().splitlines())  # words + EOS
    assert single["val"]["val/tokens"] == ranks[0]["val"]["val/tokens"] == tokens
    assert single["val"]["val/sentences"] == ranks[0]["val"]["val/sentences"] == len(valid_lines)
    check_same_validation(single, ranks, ["val/loss", "val/bleu", "val/chrf"])


# ---------------------------------------------------------------------------------- captioning
def captioning_args() -> list[str]:
    """configs/captioning/synthetic.yaml shrunk. The encoder is frozen: a trainable ResNet's
    batch norm normalises with each rank's own images (docs/ddp.md). Five captions per
    image are all five references, so the (per-process random) caption choice cannot differ."""
    return [
        "--config", str(ROOT / "configs/captioning/synthetic.yaml"),
        "--data.init_args.num_train", "16", "--data.init_args.num_val", "5", "--data.init_args.num_test", "5",
        "--data.init_args.image_size", "32", "--data.init_args.captions_per_image", "5",
        "--model.init_args.decoder.init_args.embed_dim", "16", "--model.init_args.decoder.init_args.hidden_size", "16",
        "--model.init_args.decoder.init_args.attention_dim", "8", "--model.init_args.decoder.init_args.dropout", "0.0",
        "--model.init_args.encoder.init_args.trainable", "false",
        "--model.init_args.val_caption_images", "-1", "--model.init_args.meteor", "false",
        "--model.init_args.metric_tokenizer", "simple", "--trainer.limit_train_batches", "2",
    ]


@pytest.mark.slow  # DDP: two processes
def test_captioning_two_processes_equal_one_process(tmp_path):
    """1 process x 4 images against 2 x 2 (the datamodule's seeded shuffle cuts one order the same
    way for any world size). Validation over 5 images: rank 1 gets one padding image that it
    runs but neither counts nor decodes, so val/images is 5, not the 6 a DistributedSampler
    would give, and val/loss, val/tokens and the COCO metrics equal the single process's."""
    args = captioning_args()
    single = fit(tmp_path, "captioning", 1, [*args, "--data.init_args.batch_size", "4", "--data.init_args.eval_batch_size", "4"], "image_id", "caption_output")[0]
    ranks = fit(tmp_path, "captioning", 2, [*args, "--data.init_args.batch_size", "2", "--data.init_args.eval_batch_size", "2"], "image_id", "caption_output")

    def same_batch(parts, reference):
        return sorted(torch.cat(parts).tolist()) == sorted(reference.tolist())

    check_same_steps(single, ranks, same_batch)
    assert single["val"]["val/images"] == ranks[0]["val"]["val/images"] == 5
    assert single["val"]["val/tokens"] == ranks[0]["val"]["val/tokens"]
    names = sorted(k for k in single["val"] if k not in ("val/images", "val/tokens"))
    assert {"val/loss", "val/CIDEr-D", "val/BLEU-4"} <= set(names)
    check_same_validation(single, ranks, names)


# ---------------------------------------------------------------------------------- classification
@pytest.mark.slow  # DDP: two processes
def test_hierarchy_classification_two_processes_equal_one_process(tmp_path):
    """configs/hierarchy/softmax10x10.yaml at 1x5 classes: 1 process x 16 samples against 2 x 8;
    15 validation samples (odd), each counted once (val/samples)."""
    args = ["--config", str(ROOT / "configs/hierarchy/softmax10x10.yaml"),
            "--data.init_args.num_super", "1", "--data.init_args.num_sub", "5", "--data.init_args.train_per_class", "8",
            "--data.init_args.val_per_class", "3", "--model.init_args.eval_topk", "[1, 2]",
            "--model.init_args.encoder.init_args.hidden_sizes", "[16]", "--trainer.limit_train_batches", "2"]
    single = fit(tmp_path, "hierarchy", 1, [*args, "--data.init_args.batch_size", "16"], "input", "target")[0]
    ranks = fit(tmp_path, "hierarchy", 2, [*args, "--data.init_args.batch_size", "8"], "input", "target")

    def same_batch(parts, reference):
        return torch.equal(sorted_rows(torch.cat(parts)), sorted_rows(reference))

    check_same_steps(single, ranks, same_batch)
    assert single["val"]["val/samples"] == ranks[0]["val"]["val/samples"] == 15
    check_same_validation(single, ranks, ["val/loss", "val/acc@1", "val/acc@2"])


# ---------------------------------------------------------------------------------- sharding helpers
@pytest.mark.parametrize("total, world", [(7, 2), (8, 2), (10, 3), (2, 3)])
def test_evaluation_shards_score_every_sample_once_and_keep_ranks_in_step(total, world):
    """The ranks' shards together hold every sample once; all have ceil(N/W) items, the extra
    ones padding copies whose target the loss and metrics ignore; rank 0 never pads."""
    from datamodules.hierarchy import HierarchyDataset
    from datamodules.sharding import EvaluationShard, evaluation_loader, ignored_target

    dataset = HierarchyDataset(torch.arange(total, dtype=torch.float).unsqueeze(1), torch.arange(total))
    scored = []
    for rank in range(world):
        shard = EvaluationShard(dataset, rank, world, ignored_target)
        assert len(shard) == -(-total // world)
        batches = list(evaluation_loader(dataset, rank, world, ignored_target, batch_size=2))
        targets = torch.cat([b["target"] for b in batches])
        assert targets.numel() == len(shard)
        scored += targets[targets != -100].tolist()
        assert rank > 0 or (targets != -100).all()
    assert sorted(scored) == list(range(total))


def test_training_order_gives_the_same_global_batches_on_any_world_size():
    """1 process x 6 rows and 2 processes x 3 rows (and 3 x 2) see the same samples at every
    step of an epoch, and another epoch reshuffles."""
    from datamodules.sharding import training_sampler

    dataset = list(range(24))

    def global_batches(world: int, epoch: int) -> list[list[int]]:
        orders = []
        for rank in range(world):
            sampler = training_sampler(dataset, rank, world)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        rows = 6 // world
        return [sorted(i for order in orders for i in order[k * rows:(k + 1) * rows]) for k in range(4)]

    assert global_batches(1, 0) == global_batches(2, 0) == global_batches(3, 0)
    assert global_batches(1, 0) != global_batches(1, 1)


def test_evaluation_shard_refuses_a_rank_outside_the_world():
    from datamodules.sharding import EvaluationShard, ignored_target

    with pytest.raises(ValueError, match=r"needs 0 <= rank < world_size, got rank 2 of world size 2 \(pass the trainer"):
        EvaluationShard([], 2, 2, ignored_target)


def test_captioning_padding_image_is_neither_counted_nor_decoded(tmp_path):
    from datamodules.captioning import collate_captions, padding_image
    from datamodules.scenes import SyntheticScenes

    scenes = SyntheticScenes(num_train=4, num_val=2, num_test=2, image_size=32)
    dataset = scenes.dataset("val")
    batch = collate_captions([dataset[0], padding_image(dataset[1])])
    padded_rows = batch["caption_image"] == 1
    assert batch["scored"].tolist() == [True, False]
    assert (batch["caption_output"][padded_rows] == -100).all() and (batch["caption_output"][~padded_rows] != -100).any()
    assert padding_image(None) is None


@pytest.mark.slow
def test_hanzi_validation_counts_every_image_once_under_ddp(tmp_path):
    """configs/hanzi/font_rendered.yaml (8 classes, 24-pixel renders) through ``python -m app
    validate`` on 1 and 2 processes: the same (seeded) model scores every validation image once
    (val/samples = the split's size) and gives the same loss and accuracies. Training is not
    compared: the CNN's batch norm normalises with each rank's own images, and SyncBatchNorm
    (``--trainer.sync_batchnorm true``) needs GPUs (docs/ddp.md)."""
    from datamodules.hanzi import FontRenderedHanzi

    cache = tmp_path / "cache"
    args = ["--config", str(ROOT / "configs/hanzi/font_rendered.yaml"), "--data.init_args.image_size", "24",
            "--data.init_args.num_classes_limit", "7", "--data.init_args.train_writers", "1",
            "--data.init_args.batch_size", "8", "--data.init_args.cache_dir", str(cache),
            "--model.init_args.encoder.init_args.channels", "[8, 16]", "--model.init_args.encoder.init_args.out_features", "16",
            "--model.init_args.encoder.init_args.dropout", "0.0"]
    single = fit(tmp_path, "hanzi", 1, args, "input", "target", command_name="validate")[0]
    ranks = fit(tmp_path, "hanzi", 2, args, "input", "target", command_name="validate")
    data = FontRenderedHanzi(image_size=24, num_classes_limit=7, train_writers=1, cache_dir=str(cache))
    data.setup("validate")
    size = len(data.datasets["val"])
    print(f"validation images {size}: 1 process {single['val']['val/samples']}, 2 processes {ranks[0]['val']['val/samples']}")
    assert single["val"]["val/samples"] == ranks[0]["val"]["val/samples"] == size
    check_same_validation(single, ranks, ["val/loss", "val/acc@1", "val/acc@5"])
