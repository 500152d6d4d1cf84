"""Translation over Hybrid-LightRNN code sequences (tasks/code_search.py): the decoder reads and
predicts codes, the searches score whole words with the same log-probabilities teacher forcing
sums, and the settings it cannot have are one-line errors."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from app.main import main
from datamodules.translation import BOS_ID, EOS_ID
from heads.lightrnn import HybridLightRNNCodes
from tasks.code_search import CodeStep, code_inputs
from tasks.decoding import max_lengths
from tasks.translation import TranslationTask
from tests.shell import run_cli
from tests.test_translation import M30K, TINY, TINY_LSTM, lstm, transformer, write_parallel

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/translation/heads/lstm_hybrid_lightrnn_codes_mos.yaml"
V, SOURCE_V = 23, 19
NETWORKS = {
    "lstm": lstm(embed_dim=16, hidden_size=16, num_layers=1),
    "lstm-contexts": lstm(embed_dim=16, hidden_size=16, num_layers=2, attentional_layer=False),
    "transformer": transformer(d_model=16, num_layers=2, num_heads=2, ffn_dim=32),
}
TABLES = {  # (num_exclusive, rows, cols): both leave empty cells (renormalised code probabilities)
    "hybrid": (5, None, None),  # 18 table words in 4 x 5
    "lightrnn": (0, 5, 5),  # 23 words in 5 x 5
}


def code_task(network: str, table: str, seed: int = 0, **kwargs) -> TranslationTask:
    """A tiny code-input task in float64 with a scrambled table (no word in its frequency slot)."""
    torch.manual_seed(seed)
    K, rows, cols = TABLES[table]
    head = functools.partial(HybridLightRNNCodes, num_exclusive=K, rows=rows, cols=cols, inner="mos")
    task = TranslationTask(num_classes=V, source_vocab_size=SOURCE_V, network=NETWORKS[network], head=head, **kwargs)
    slots = K + torch.randperm(task.head.rows * task.head.cols)[: V - K]
    task.head.set_assignment(torch.cat([torch.arange(K), slots]))
    return task.double().eval()


def batch(seed: int = 1, length: int = 6) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(4, SOURCE_V, (3, 7), generator=generator)
    source[1, 5:] = 0
    source[:, -1] = EOS_ID
    source[1, 4] = EOS_ID
    words = torch.randint(3, V, (3, length), generator=generator)  # UNK and real words
    words[2, 4:] = -100  # a shorter sentence: padding
    target_output = torch.cat([words, torch.full((3, 1), -100)], 1)
    ends = (words != -100).sum(1)
    target_output[torch.arange(3), ends] = EOS_ID
    target_input = torch.cat([torch.full((3, 1), BOS_ID), target_output[:, :-1].clamp_min(0)], 1)
    target_input[2, ends[2] + 1 :] = 0  # PAD after the end, as the collate writes
    return {"source": source, "source_lengths": torch.tensor([7, 5, 7]), "target_input": target_input, "target_output": target_output}


def full_distribution(candidates) -> torch.Tensor:
    values, tokens = candidates
    return torch.full((values.shape[0], V), float("-inf"), dtype=values.dtype).scatter(1, tokens, values)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("network", NETWORKS)
def test_search_scores_are_the_teacher_forced_word_log_probabilities_at_every_position(network, table):
    task, data = code_task(network, table), batch()
    with torch.no_grad():
        nll = task.token_nll(data)  # (B, T): teacher forcing over code inputs
        step = CodeStep(task.network, task.head, width=V)  # every word: the whole distribution
        state = CodeStep.initial(task.network.encode(data["source"], data["source_lengths"]), 3, torch.device("cpu"))
        for t in range(data["target_output"].shape[1]):
            candidates, state = step(data["target_input"][:, : t + 1], state)
            log_probs = full_distribution(candidates)  # (B, V)
            assert torch.allclose(log_probs.double().logsumexp(-1), torch.zeros(3, dtype=torch.float64), atol=1e-5)
            target = data["target_output"][:, t]
            valid = target != -100
            got = log_probs[valid].gather(1, target[valid, None]).squeeze(1).double()
            assert torch.allclose(got, -nll[valid, t], atol=1e-5), f"position {t}: {got} vs {-nll[valid, t]}"


@pytest.mark.parametrize("width", [1, 2])
@pytest.mark.parametrize("network, table", [("lstm", "hybrid"), ("lstm", "lightrnn"), ("transformer", "lightrnn")])
def test_the_top_words_of_a_narrow_step_are_those_of_the_whole_distribution(network, table, width):
    """Rows are visited only while they can hold a top word: the early stop loses nothing."""
    task, data = code_task(network, table, seed=3), batch(seed=4)
    with torch.no_grad():
        state_all = state_few = CodeStep.initial(task.network.encode(data["source"], data["source_lengths"]), 3, torch.device("cpu"))
        every, few = CodeStep(task.network, task.head, width=V), CodeStep(task.network, task.head, width=width)
        for t in range(6):
            prefix = data["target_input"][:, : t + 1]
            whole, state_all = every(prefix, state_all)
            top, state_few = few(prefix, state_few)
            expected = full_distribution(whole).topk(width, dim=-1)
            assert torch.allclose(top.log_probs, expected.values, atol=1e-6)
            assert torch.equal(top.tokens, expected.indices)


def test_row_visits_in_bounded_batches_give_the_same_candidates(monkeypatch):
    """The (context, row) pairs of a step are decoded ROW_BATCH at a time (each copies a decoder state)."""
    import tasks.code_search as code_search

    task, data = code_task("transformer", "lightrnn", seed=7), batch(seed=8)
    with torch.no_grad():
        encoded = task.network.encode(data["source"], data["source_lengths"])
        prefix = data["target_input"][:, :3]
        whole = CodeStep(task.network, task.head, width=V)
        state = CodeStep.initial(encoded, 3, torch.device("cpu"))
        for t in range(1, 4):
            expected, state_next = whole(prefix[:, :t], state)
            monkeypatch.setattr(code_search, "ROW_BATCH", 2)
            got, _ = whole(prefix[:, :t], state)
            monkeypatch.setattr(code_search, "ROW_BATCH", 256)
            assert torch.allclose(got.log_probs, expected.log_probs, atol=1e-6) and torch.equal(got.tokens, expected.tokens)
            state = state_next


@pytest.mark.parametrize("beam_size", [1, 3])
def test_a_translation_scores_what_teacher_forcing_gives_its_words(beam_size):
    task, data = code_task("lstm", "hybrid", seed=5), batch(seed=6)
    task.decoding.max_len_b = 8
    with torch.no_grad():
        hypotheses = task.translate(data["source"], data["source_lengths"], beam_size=beam_size)
        budget = max_lengths(data["source_lengths"] - 1, task.decoding.max_len_a, task.decoding.max_len_b)
        for row, (best,) in enumerate(hypotheses):
            words = torch.tensor(best.tokens + [EOS_ID])
            one = {"source": data["source"][row : row + 1], "source_lengths": data["source_lengths"][row : row + 1],
                   "target_input": torch.cat([torch.tensor([BOS_ID]), words[:-1]])[None], "target_output": words[None]}
            scored = -task.token_nll(one)[0]  # (L + 1,)
            forced_end = len(words) == int(budget[row])  # the search forces EOS at the budget, at log-prob 0
            expected = scored[:-1].sum() if forced_end else scored.sum()
            assert abs(best.log_prob - float(expected)) < 1e-4, (row, best, scored)


def test_code_inputs_keep_the_padding_id_for_padded_words_only():
    task, data = code_task("transformer", "lightrnn"), batch()  # K = 0: code 0 is a real row/column code
    codes = code_inputs(task.head, data["target_input"], data["target_output"])  # (B, 2T)
    padded = (data["target_output"] == -100).repeat_interleave(2, dim=1)
    assert torch.equal(codes == 0, padded)
    assert int(codes.max()) <= task.head.num_input_codes and task.network.target_embedding.num_embeddings == task.head.num_input_codes + 1


@pytest.mark.parametrize("kwargs, message", [
    ({"label_smoothing": 0.1}, "label_smoothing 0.1 needs a word distribution per decoder state, which HybridLightRNNCodes (code inputs) "
                               "does not give from one state: set model.init_args.label_smoothing 0, or use heads.HybridLightRNN"),
    ({"tie_weights": True}, "tie_weights needs word embeddings, but with HybridLightRNNCodes the decoder reads codes: set "
                            "model.init_args.tie_weights false"),
])
def test_settings_a_code_decoder_cannot_have_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError) as caught:
        code_task("lstm", "hybrid", **kwargs)
    assert str(caught.value) == message


def fixture_args(tmp_path: Path) -> list[str]:
    data_dir = write_parallel(tmp_path / "m30k", *M30K[:2], gz=M30K[2])
    return ["--config", str(ROOT / "configs/translation/multi30k_de_en_lstm.yaml"),
            "--config", str(ROOT / "configs/translation/word_level.yaml"), "--config", str(ROOT / CONFIG),
            *TINY_LSTM, *TINY, "--data.init_args.vocab_size", "0", "--data.init_args.min_count", "1",
            "--model.init_args.head.init_args.inner.init_args.embedding_dim", "16",
            "--data.init_args.data_dir", str(data_dir), "--data.init_args.cache_dir", str(tmp_path / "cache"),
            "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]


def test_the_shipped_config_fits_reallocates_and_tests_on_fixtures(tmp_path):
    args = [*fixture_args(tmp_path), "--trainer.max_epochs", "2"]
    cli = main(["fit", *args])
    task = cli.model
    assert task.code_inputs and isinstance(task.head, HybridLightRNNCodes)
    assert task.network.target_embedding.num_embeddings == task.head.num_input_codes + 1
    assert "lightrnn/table_change" in cli.trainer.callback_metrics
    tested = main(["test", *args, "--ckpt_path", cli.trainer.checkpoint_callback.last_model_path])
    assert {"test/bleu", "test/chrf", "test/loss"} <= set(tested.trainer.callback_metrics)
    assert torch.equal(tested.model.head.word_to_slot, task.head.word_to_slot)  # the relearned table came back


def test_label_smoothing_with_code_inputs_is_one_line_at_the_terminal(tmp_path):
    args = [*fixture_args(tmp_path), "--model.init_args.label_smoothing", "0.1"]
    done = run_cli(["fit", *args], tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("error: label_smoothing 0.1 needs a word distribution per decoder state")
    assert not (tmp_path / "runs").exists()  # nothing written: not even the run's empty directories
