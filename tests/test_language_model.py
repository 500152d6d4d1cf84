"""The language-modeling task: TBPTT state handling, metrics, encoders as components, checkpoints
of the flat form, bad input."""

from __future__ import annotations

import copy
from functools import partial

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from datamodules.base import HeadDataModule
from datamodules.lm_stream import StreamLoader, TBPTTStream
from tasks.encoders import AWDLSTMEncoder, TransformerLMEncoder
from tasks.language_model import LanguageModel, detach_state
from tests.shell import ROOT, one_error_line, run_cli

V = 30


class StreamData(HeadDataModule):
    """A fixed random stream, enough to drive the task without a real corpus."""

    num_classes = V
    class_names = [f"w{i}" for i in range(V)]
    frequency_ordered = True
    bptt = 6

    def __init__(self, length: int = 600, variable: bool = False):
        super().__init__()
        self.tokens = torch.randint(0, V, (length,), generator=torch.Generator().manual_seed(1))
        self.variable = variable

    def train_dataloader(self):
        # A StreamLoader (as the project's LM datamodules use): a mid-epoch checkpoint resumes.
        return StreamLoader(TBPTTStream(self.tokens, 4, self.bptt, variable_length=self.variable))

    def val_dataloader(self):
        return DataLoader(TBPTTStream(self.tokens, 3, self.bptt), batch_size=None)

    test_dataloader = val_dataloader


ENCODER_DEFAULTS = dict(embedding_dim=8, hidden_size=12, num_layers=2, dropout_input=0.1, weight_drop=0.2)


def tiny_model(encoder: dict | None = None, **kwargs) -> LanguageModel:
    """A small AWD-LSTM language model; ``encoder`` overrides its encoder's arguments."""
    return LanguageModel(V, encoder=partial(AWDLSTMEncoder, **{**ENCODER_DEFAULTS, **(encoder or {})}), **kwargs)


def trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


def test_state_is_carried_between_windows_and_detached():
    model = tiny_model()
    data = StreamData()
    batches = iter(data.train_dataloader())
    first, second = next(batches), next(batches)
    model.training_step(first, 0)
    carried = model._state["train"]
    assert all(not h.requires_grad and not c.requires_grad for h, c in carried)
    # The second window continues from the carried state: same result as running both windows
    # as one sequence (dropout off so the comparison is exact).
    model.eval()
    model._state.clear()
    joined = torch.cat([first["input"], second["input"]], dim=1)
    full, _, _ = model.encode(joined)
    _, _, state = model.encode(first["input"])
    cont, _, _ = model.encode(second["input"], detach_state(state))
    torch.testing.assert_close(cont, full[:, first["input"].shape[1]:])


def test_state_resets_at_each_epoch_start():
    model = tiny_model()
    model._state["train"] = "stale"
    model.on_train_epoch_start()
    assert "train" not in model._state


def test_lr_is_rescaled_by_window_length_and_restored():
    model = tiny_model(optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    data = StreamData(variable=True)
    seen = []

    class Spy(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append((optimizer.param_groups[0]["lr"], pl_module._length_ratio))

    trainer(max_epochs=1, limit_train_batches=5, limit_val_batches=0, callbacks=[Spy()]).fit(model, data)
    assert seen and all(abs(lr - ratio) < 1e-12 for lr, ratio in seen)
    assert len({ratio for _, ratio in seen}) > 1, "variable windows should give different ratios"
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == 1.0


def test_validation_counts_every_target_once_and_ppl_is_exp_of_mean_nll():
    model = tiny_model()
    data = StreamData(length=500)
    metrics = trainer(max_epochs=1, limit_train_batches=2).fit(model, data) or model.trainer.callback_metrics
    assert int(metrics["val/tokens"]) == 499
    assert torch.isclose(metrics["val/ppl"], metrics["val/loss"].exp(), rtol=1e-5)
    assert 0 <= float(metrics["val/acc@1"]) <= float(metrics["val/acc@5"]) <= float(metrics["val/acc@10"]) <= 1


def test_transformer_encoder_trains_and_respects_max_length():
    encoder = partial(TransformerLMEncoder, embedding_dim=8, num_heads=2, feedforward_dim=12, dropout=0.1, max_length=6)
    model = LanguageModel(V, encoder=encoder)
    trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1).fit(model, StreamData())
    with pytest.raises(ValueError, match="max_length 6"):
        model.encode(torch.zeros(1, 7, dtype=torch.long))


def test_tying_shares_embedding_and_mismatch_is_explained():
    model = tiny_model()
    assert model.head.decoder.weight is model.encoder.embedding.weight
    with pytest.raises(ValueError, match="cannot tie"):
        tiny_model({"last_hidden_size": 10})


@pytest.mark.parametrize("key", ["dropout_input", "weight_drop"])
def test_bad_dropout_names_the_key(key):
    with pytest.raises(ValueError, match=f"{key} in \\[0, 1\\), got 1.5"):
        tiny_model({key: 1.5})


def test_unknown_head_name_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown head 'nope': valid names are .*softmax"):
        tiny_model(head="nope")


def test_checkpoint_with_other_vocabulary_size_is_refused(tmp_path):
    model = tiny_model()
    checkpoint = {"hyper_parameters": {"num_classes": V + 5}, "state_dict": model.state_dict()}
    with pytest.raises(ValueError, match=f"vocabulary of {V + 5} classes but the data gives {V}"):
        model.on_load_checkpoint(checkpoint)


def test_non_finite_loss_stops_with_step_batch_and_head_stats():
    model = tiny_model()
    data = StreamData()
    with torch.no_grad():
        model.head.decoder.bias.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match=r"non-finite training loss nan at global step 0, epoch 0, batch 0; head Softmax"):
        trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=0).fit(model, data)


def test_gradient_norm_is_logged():
    model = tiny_model()
    trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=0).fit(model, StreamData())
    assert float(model.trainer.callback_metrics["train/grad_norm"]) > 0


class CountedStreamData(StreamData):
    def class_counts(self):
        return torch.bincount(self.tokens, minlength=V)


def test_fit_starts_the_head_bias_at_the_training_unigram():
    data = CountedStreamData()
    counts = torch.bincount(data.tokens, minlength=V).double()
    expected = torch.log((counts + 1) / (counts + 1).sum()).float()
    fitted = tiny_model(head="softmax", tie_weights=False)
    seen = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, module):
            seen["bias"] = module.head.decoder.bias.detach().clone()

    trainer(max_steps=1, callbacks=[Probe()]).fit(fitted, datamodule=data)
    torch.testing.assert_close(seen["bias"], expected)
    off = tiny_model(head="softmax", tie_weights=False, unigram_bias_init=False)
    before = off.head.decoder.bias.detach().clone()
    seen.clear()
    trainer(max_steps=1, callbacks=[Probe()]).fit(off, datamodule=data)
    torch.testing.assert_close(seen["bias"], before)


def test_resumed_fit_keeps_the_checkpoint_bias(tmp_path):
    data = CountedStreamData()
    model = tiny_model(head="softmax", tie_weights=False)
    run = pl.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     max_steps=3, limit_val_batches=1)
    run.fit(model, datamodule=data)
    path = tmp_path / "last.ckpt"
    run.save_checkpoint(path)
    # its datamodule is a test class, outside read_checkpoint's allow-list of project classes
    saved = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]["head.decoder.bias"]
    resumed = tiny_model(head="softmax", tie_weights=False)
    seen = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, module):
            seen["bias"] = module.head.decoder.bias.detach().clone()

    pl.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False, enable_model_summary=False,
               max_steps=4, limit_val_batches=1, callbacks=[Probe()]).fit(resumed, datamodule=data, ckpt_path=path)
    torch.testing.assert_close(seen["bias"], saved)


# ------------------------------------------------------------------ encoders as components

def test_an_encoder_from_python_is_saved_as_class_path_and_rebuilds():
    model = tiny_model()
    assert model.hparams.encoder == {"class_path": "tasks.encoders.awd_lstm.AWDLSTMEncoder", "init_args": ENCODER_DEFAULTS}
    # What a model rebuilt from the file alone receives: the dictionary, unparsed.
    rebuilt = LanguageModel(**copy.deepcopy(dict(model.hparams)))
    assert isinstance(rebuilt.encoder, AWDLSTMEncoder) and rebuilt.encoder.out_features == 8
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}


@pytest.mark.parametrize("class_path", ["os.system", "tasks.encoders.MLPEncoder", "tasks.language_model.LanguageModel"])
def test_an_encoder_class_path_must_name_a_language_model_encoder(class_path):
    with pytest.raises(ValueError, match=f"needs an encoder class_path naming a tasks.encoders.LMEncoder, got .*{class_path}"):
        LanguageModel(V, encoder={"class_path": class_path, "init_args": {}})

def test_a_bad_encoder_setting_on_the_command_line_is_one_line_naming_the_new_key():
    result = run_cli(["fit", "--config", "configs/lm/synthetic.yaml", "--model.init_args.encoder.init_args.dropout_hidden",
                      "1.5", "--trainer.logger", "false"])
    one_error_line(result, "AWDLSTMEncoder needs dropout_hidden in [0, 1), got 1.5 "
                           "(set model.init_args.encoder.init_args.dropout_hidden)")


def test_print_config_shows_the_encoder_as_a_class_path_block():
    result = run_cli(["fit", "--config", "configs/lm/synthetic.yaml", "--model.init_args.encoder.init_args.hidden_size",
                      "24", "--print_config"])
    assert result.returncode == 0, result.stderr[-2000:]
    block = result.stdout[result.stdout.index("\n    encoder:\n"):]
    assert block.startswith("\n    encoder:\n      class_path: tasks.encoders.AWDLSTMEncoder\n      init_args:\n"
                            "        embedding_dim: 64\n        hidden_size: 24\n"), block[:400]


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs" / "lm").glob("*.yaml")))
def test_every_lm_config_names_its_encoder_by_class_path(config, capsys):
    from app.main import main

    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", str(ROOT / "configs" / "lm" / config), "--print_config"])
    assert exited.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "\n    encoder:\n      class_path: tasks.encoders.AWDLSTMEncoder\n      init_args:\n" in printed


def test_predict_score_prints_the_test_splits_token_count_nll_and_perplexity(tmp_path, capsys):
    """``predict_mode score`` sums the NLL and counts the tokens of the predict split (the test
    loader here) in a torchmetrics metric: the same figures as ``test``, whose sums are reduced the
    same way, and written to ``predict_output``."""
    import math

    class ScoredData(StreamData):
        predict_dataloader = StreamData.val_dataloader

    model = tiny_model(predict_output=str(tmp_path / "score.txt"))
    data = ScoredData()
    tested = trainer().test(model, data, verbose=False)[0]
    trainer().predict(model, data, return_predictions=False)
    lines = dict(line.split("\t") for line in (tmp_path / "score.txt").read_text().splitlines())
    assert int(lines["tokens"]) == int(tested["test/tokens"]) > 0
    assert float(lines["nll"]) == pytest.approx(tested["test/loss"], abs=1e-6)
    assert float(lines["ppl"]) == pytest.approx(math.exp(float(lines["nll"])), rel=1e-5)
    assert capsys.readouterr().out.endswith((tmp_path / "score.txt").read_text())
