"""The Hugging Face encoder (tasks/encoders/huggingface.py): any head on a ``transformers`` model.

What is proved: a tiny random GPT-2 (2 layers, width 16) written with save_pretrained trains two
steps through the real CLI with a softmax and a MoS head, and the checkpoint restores with the
saved weights; a BERT-like masked model runs causally (as a decoder) and a model that cannot be
made causal is refused; a missing directory and a missing transformers package are one error line;
a model directory whose pickled weights ask to import code is one line in ``test`` and ``analyze rank``,
and the code never runs.
No network: the hub usage is documented in docs/library.md, not run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from app.checkpoint_io import restore  # noqa: E402
from tasks.encoders import HuggingFaceEncoder  # noqa: E402
from tests.conftest import TinyConfig  # noqa: E402
from tests.shell import ROOT, one_error_line, run_cli  # noqa: E402

FIT = [
    "fit", "--config", str(ROOT / "configs/lm/synthetic.yaml"),
    "--model.init_args.encoder", "tasks.encoders.HuggingFaceEncoder",
    "--data.init_args.vocab_size", "60", "--data.init_args.train_tokens", "2000", "--data.init_args.valid_tokens", "300",
    "--data.init_args.test_tokens", "300", "--data.init_args.bptt", "8", "--data.init_args.batch_size", "4",
    "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
]
MOS = ["--model.init_args.head", "heads.MoS", "--model.init_args.head.init_args.num_components", "2"]


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=64)
    transformers.AutoModel.from_config(config).save_pretrained(path)
    return path


def test_softmax_and_mos_heads_train_on_a_saved_gpt2_through_the_cli(tiny_gpt2, tmp_path):
    """Softmax and MoS: each fits two steps, writes last.ckpt, and the checkpoint rebuilds a model
    whose encoder is the GPT-2 with the trained weights."""
    for name, extra in (("softmax", []), ("mos", MOS)):
        out = tmp_path / name
        result = run_cli([*FIT, "--model.init_args.encoder.init_args.model", str(tiny_gpt2), *extra,
                          *TinyConfig.dirs(out), "--checkpoint.dirpath", str(out / "ckpt")])
        assert result.returncode == 0, (name, result.stderr[-3000:])
        checkpoint = torch.load(out / "ckpt" / "last.ckpt", weights_only=True)
        assert checkpoint["global_step"] == 2
        assert checkpoint["hyper_parameters"]["encoder"]["class_path"] == "tasks.encoders.HuggingFaceEncoder"
        # the directory the encoder loads from is the user's (a config), never the checkpoint's
        config = out / "encoder.yaml"
        config.write_text(f"model:\n  init_args:\n    encoder:\n      class_path: tasks.encoders.HuggingFaceEncoder\n"
                          f"      init_args:\n        model: {tiny_gpt2}\n")
        model = restore(str(out / "ckpt" / "last.ckpt"), data=False, config=[str(config)])[0]
        assert type(model.encoder.network).__name__ == "GPT2Model"
        assert type(model.head).__name__ == ("MixtureOfSoftmaxes" if name == "mos" else "Softmax")
        trained = checkpoint["state_dict"]["encoder.network.h.0.attn.c_attn.weight"]
        assert torch.equal(model.encoder.network.h[0].attn.c_attn.weight, trained)
        assert not torch.equal(trained, transformers.AutoModel.from_pretrained(tiny_gpt2).h[0].attn.c_attn.weight)
        tokens = torch.randint(0, 60, (2, 8))
        hidden, _, state = model.encoder(tokens)
        assert hidden.shape == (2, 8, 16) and state is None and model.encoder.embedding.num_embeddings == 60


def test_a_masked_model_runs_as_a_decoder_and_a_non_causal_one_is_refused(tmp_path):
    bert = tmp_path / "bert"
    transformers.AutoModel.from_config(transformers.BertConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=50)).save_pretrained(bert)
    encoder = HuggingFaceEncoder(60, str(bert))
    tokens = torch.randint(0, 60, (1, 6))
    changed = tokens.clone()
    changed[0, -1] = (tokens[0, -1] + 1) % 60
    encoder.eval()
    assert torch.allclose(encoder(tokens)[0][0, :-1], encoder(changed)[0][0, :-1], atol=1e-6)  # no look-ahead
    distil = tmp_path / "distil"
    transformers.AutoModel.from_config(transformers.DistilBertConfig(
        n_layers=1, dim=16, n_heads=2, hidden_dim=32, vocab_size=50)).save_pretrained(distil)
    with pytest.raises(ValueError, match="is not causal"):
        HuggingFaceEncoder(60, str(distil))
    with pytest.raises(ValueError, match="has no field 'no_such_field'"):
        HuggingFaceEncoder(60, str(bert), config_overrides={"no_such_field": 1})


def test_a_missing_directory_is_one_error_line_from_the_cli(tmp_path):
    missing = tmp_path / "no-such-model"
    result = run_cli([*FIT, "--model.init_args.encoder.init_args.model", str(missing), *TinyConfig.dirs(tmp_path)])
    one_error_line(result, f"model directory {str(missing)!r} does not exist", "model.init_args.encoder.init_args.model")
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # nothing written


def test_a_missing_transformers_package_is_one_line_naming_the_install(monkeypatch, tiny_gpt2):
    """``sys.modules["transformers"] = None`` makes ``import transformers`` fail as on a machine without
    it (in this process: torchmetrics imports transformers at start-up whenever it is installed, so
    a new process cannot be shown a machine without it). The CLI prints this ValueError as the
    one line the test above reads."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ValueError) as error:
        HuggingFaceEncoder(60, str(tiny_gpt2))
    message = str(error.value)
    assert "\n" not in message and "needs the transformers package" in message and "pip install -e '.[hf]'" in message


class Payload:
    """Unpickling this runs ``touch <marker>``: what a hostile weights file does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def payload_model(tiny_gpt2, tmp_path_factory) -> Path:
    """The tiny GPT-2's config beside a ``pytorch_model.bin`` (no safetensors) whose pickle asks
    to import ``os.system``."""
    import shutil

    path = tmp_path_factory.mktemp("hf") / "payload-model"
    path.mkdir()
    shutil.copy(tiny_gpt2 / "config.json", path / "config.json")
    torch.save({"weights": Payload(path / "ran")}, path / "pytorch_model.bin")
    return path


def payload_line(path: Path) -> str:
    return (f"error: HuggingFaceEncoder refused the weights of {str(path)!r}: its pickled weights (pytorch_model*.bin) "
            f"ask to import posix.system, and weights may hold only tensors, numbers, strings and containers (nothing was "
            f"run; use a model saved as safetensors by save_pretrained, or another model; set "
            f"model.init_args.encoder.init_args.model)")


def test_a_model_directory_whose_weights_pickle_imports_code_is_one_line_in_test(payload_model, tmp_path):
    """Before: a multi-line "Union subtypes" dump. After: one line naming the directory and the
    import; the payload never runs."""
    result = run_cli(["test", *FIT[1:], "--model.init_args.encoder.init_args.model", str(payload_model),
                      *TinyConfig.dirs(tmp_path)])
    assert one_error_line(result) == payload_line(payload_model)
    assert not (payload_model / "ran").exists()


def test_a_model_directory_whose_weights_pickle_imports_code_is_one_line_in_analyze_rank(tiny_gpt2, payload_model, tmp_path):
    """Before: an UnpicklingError traceback. After: the same line as ``test``; the payload never runs."""
    out = tmp_path / "fit"
    trained = run_cli([*FIT, "--model.init_args.encoder.init_args.model", str(tiny_gpt2), *TinyConfig.dirs(out),
                       "--checkpoint.dirpath", str(out / "ckpt")])
    assert trained.returncode == 0, trained.stderr[-3000:]
    config = tmp_path / "encoder.yaml"
    config.write_text(f"model:\n  init_args:\n    encoder:\n      class_path: tasks.encoders.HuggingFaceEncoder\n"
                      f"      init_args:\n        model: {payload_model}\n")
    result = run_cli(["analyze", "rank", "--ckpt_path", str(out / "ckpt" / "last.ckpt"), "--config", str(config),
                      "--output_dir", str(tmp_path / "rank")], tmp_path)
    assert one_error_line(result) == payload_line(payload_model)
    assert not (payload_model / "ran").exists() and not (tmp_path / "rank").exists()
