"""Hybrid-LightRNN over code sequences (seed 002 Eq. 4, heads/lightrnn/code_lm.py): the network
reads codes from one code dictionary, a word's second code is conditioned on its first through the
network, the word probabilities are exact, and the language model trains, reallocates its table
and tests through the CLI."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from heads.lightrnn import HybridLightRNN, HybridLightRNNCodes
from heads.lightrnn.codes import EMPTY
from heads.registry import available_heads, head_class, head_factory, short_name
from tests.shell import run_cli

H = 6


class CodeLSTM(nn.Module):
    """A real embedding + LSTM over code ids: ``(B, L) -> (B, L, H)``, state carried."""

    def __init__(self, num_inputs: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_inputs, H)
        self.lstm = nn.LSTM(H, H, batch_first=True)

    def forward(self, codes, state=None):
        out, state = self.lstm(self.embedding(codes), state)
        return out, state


def build(inner="softmax", num_words=11, num_exclusive=3, rows=None, cols=None, slots=None, seed=0):
    torch.manual_seed(seed)
    head = HybridLightRNNCodes(H, num_words, num_exclusive=num_exclusive, rows=rows, cols=cols, inner=inner).double()
    if slots is not None:
        head.set_assignment(torch.tensor(slots))
    net = CodeLSTM(head.num_input_codes).double()
    return head.eval(), net.eval()


LAYOUTS = {
    "full-square": dict(num_words=12, num_exclusive=3, rows=3, cols=3),
    "empty-cells": dict(num_words=11, num_exclusive=3),  # 8 table words in a 3 x 3 table
    "empty-row": dict(num_words=9, num_exclusive=3, rows=3, cols=3, slots=[0, 1, 2, 3, 4, 5, 6, 7, 8]),  # row 2 empty
    "fewer-rows": dict(num_words=9, num_exclusive=3, rows=2, cols=4),
}
INNERS = {"softmax": "softmax", "mos": head_factory("mos", num_components=2)}


def context_and_word_log_probs(head, net):
    """After the words (4, 0): the state S, and the next word's exact distribution from one network
    step (reading word 0's last code) plus one step per row (reading the row's code)."""
    K = head.num_exclusive
    with torch.no_grad():
        _, state = net(head.code_sequence(torch.tensor([[4]]), torch.tensor([[0]])))  # codes of 4, then 0's first
        first_out, first_state = net(head.code_sequence(torch.tensor([[0]]), torch.tensor([[0]]))[:, :1], state)
        expanded = tuple(s.expand(-1, head.rows, -1).contiguous() for s in first_state)
        row_out, _ = net(torch.arange(head.rows).view(-1, 1) + K, expanded)  # (d1, 1, H)
        log_p = head.word_log_prob(first_out[:, -1], row_out[:, -1].unsqueeze(0))  # (1, V)
    return state, log_p


@pytest.mark.parametrize("inner", sorted(INNERS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_word_probabilities_are_exact_and_forward_scores_them(layout, inner):
    """The next word's distribution (one network step per row) sums to one, and forward's NLL of
    each word w, with the network run over the window (input 0, target w), is -log p(w)."""
    head, net = build(INNERS[inner], **LAYOUTS[layout])
    state, log_p = context_and_word_log_probs(head, net)
    assert torch.allclose(log_p.exp().sum(), torch.ones((), dtype=torch.float64), atol=1e-12)
    for w in range(head.num_classes):
        target = torch.tensor([[w]])
        with torch.no_grad():
            out, _ = net(head.code_sequence(torch.tensor([[0]]), target), state)  # (1, 2, H)
            nll = head(out, target)
        assert torch.allclose(nll[0, 0], -log_p[0, w], atol=1e-10), (layout, w)


def test_code_sequence_reads_second_codes_then_first_codes_of_one_dictionary():
    head, _ = build(num_words=12, num_exclusive=3, rows=3, cols=3)
    K, END = head.num_exclusive, head.end_code
    assert (head.num_codes, head.num_input_codes, END) == (6, 7, 6)
    # word 3 is the first table word: cell (0, 0) -> codes (K + 0, K + 0); word 7 -> cell (1, 1)
    inputs, targets = torch.tensor([[1, 3, 7]]), torch.tensor([[3, 7, -100]])
    codes = head.code_sequence(inputs, targets)[0].tolist()
    assert codes == [END, K + 0, K + 0, K + 1, K + 1, END]
    # a row and a column share the code id: one dictionary for both positions
    assert int(head.first_code[7]) == K + 1 and int(head.column_code[7]) + K == K + 1


def test_second_code_depends_on_the_first_through_the_network():
    """Same previous words, different row of the target: the second code's distribution differs
    (the network read the row's code), although the head has no row embedding of its own."""
    head, net = build(num_words=12, num_exclusive=3, rows=3, cols=3)
    assert not any("row_embedding" in name for name, _ in head.named_parameters())
    with torch.no_grad():
        a, _ = net(head.code_sequence(torch.tensor([[1]]), torch.tensor([[3]])))  # word 3: row 0
        b, _ = net(head.code_sequence(torch.tensor([[1]]), torch.tensor([[7]])))  # word 7: row 1
    assert torch.allclose(a[:, 0], b[:, 0]) and not torch.allclose(a[:, 1], b[:, 1])


def test_reallocation_costs_and_table_change_keep_probabilities_exact():
    head, net = build(num_words=11, num_exclusive=3)
    slots = head.word_to_slot.clone()
    slots[3:] = slots[3:].flip(0)
    head.set_assignment(slots)
    state, log_p = context_and_word_log_probs(head, net)
    assert torch.allclose(log_p.exp().sum(), torch.ones((), dtype=torch.float64), atol=1e-12)
    target = torch.tensor([[9]])
    with torch.no_grad():
        out, _ = net(head.code_sequence(torch.tensor([[0]]), target), state)
    assert torch.allclose(head(out, target)[0, 0], -log_p[0, 9], atol=1e-10)


def test_refusals_are_one_line():
    with pytest.raises(ValueError, match=r"needs rows <= cols .* got rows=4, cols=3"):
        HybridLightRNNCodes(H, 15, num_exclusive=3, rows=4, cols=3)
    head, _ = build()
    with pytest.raises(ValueError, match=r"scores \(B, 2T, H\) code-step outputs against \(B, T\) words"):
        head(torch.randn(2, 3, H, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="no log_prob from one hidden state"):
        head.log_prob(torch.randn(2, H, dtype=torch.float64))


TINY = [
    "--model.init_args.encoder.init_args.embedding_dim", "16", "--model.init_args.encoder.init_args.hidden_size", "24",
    "--model.init_args.encoder.init_args.num_layers", "2", "--model.init_args.encoder.init_args.last_hidden_size", "16",
    "--data.init_args.batch_size", "4", "--data.init_args.eval_batch_size", "3", "--data.init_args.bptt", "8",
    "--data.init_args.vocab_size", "60", "--data.init_args.train_tokens", "3000",
    "--data.init_args.valid_tokens", "600", "--data.init_args.test_tokens", "600",
    "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "2", "--trainer.limit_test_batches", "2",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
]


def test_code_lm_fits_and_reallocates_through_the_cli_and_refuses_sampling_in_one_line(tmp_path):
    """fit with the shipped config (the table relearned after epoch 1); the network embeds the code
    dictionary; sampling needs word distributions, which code inputs do not give: one error line.
    (Fit then test of this config in-process: tests/test_cli.py, every head config.)"""
    config = ["--config", "configs/lm/synthetic.yaml", "--config", "configs/heads/hybrid_lightrnn_codes.yaml", *TINY]
    dirs = ["--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]
    fit = run_cli(["fit", *config, *dirs, "--trainer.max_epochs", "2"])
    assert fit.returncode == 0, fit.stderr[-3000:]
    ckpt = next((tmp_path / "runs").rglob("last.ckpt"))
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert saved["head_structure"]["word_to_slot"] == saved["state_dict"]["head.word_to_slot"].tolist()
    embedding = next(v for k, v in saved["state_dict"].items() if k.startswith("encoder.") and "embedding" in k)
    assert embedding.shape[0] == round(0.3 * 60) + saved["head_structure"]["cols"] + 1  # K + d2 codes + end marker
    from app.main import main  # the refusal in-process (app.main.run prints any ValueError as one line)

    with pytest.raises(ValueError, match="predict_mode sample needs a word distribution per step, which HybridLightRNNCodes"):
        main(["predict", *config, *dirs, "--ckpt_path", str(ckpt), "--model.init_args.predict_mode", "sample"])


def test_head_accumulates_eq6_costs_from_its_code_likelihoods():
    """In a reallocation epoch each table word's row costs are -log P(first code) over every row and
    its column costs -log P(second code) over every column, under its current row (Eq. 6)."""
    from heads.lightrnn.allocation import ReallocationCosts

    head, net = build(num_words=12, num_exclusive=3, rows=3, cols=3)
    head.train()
    head.cost_accumulator = ReallocationCosts(head.num_classes - 3, head.rows, head.cols, torch.device("cpu"))
    inputs, target = torch.tensor([[0, 7]]), torch.tensor([[7, 4]])
    out, _ = net(head.code_sequence(inputs, target))
    nll = head(out, target)
    costs = head.cost_accumulator
    # word 7 is table word 4 (cell (1, 1)), word 4 table word 1 (cell (0, 1)); its own cell's costs sum to its NLL
    for word, column_step, t in ((7, 1, 0), (4, 3, 1)):
        w, row, col = word - 3, (word - 3) // 3, (word - 3) % 3
        assert torch.allclose(costs.row_cost[w, row] + costs.col_cost[w, col], nll[0, t].double().detach(), atol=1e-9)
    assert int(costs.tokens.sum()) == 2


def test_the_code_sequence_model_is_not_a_registered_head():
    """Off the head contract (code steps against words, no log_prob / topk): not among the names
    the tools, the contract tests and ``inner`` take, and it does not claim HybridLightRNN's name;
    its class path still resolves, as its configs give it."""
    assert HybridLightRNNCodes not in {head_class(name) for name in available_heads()}
    assert short_name(HybridLightRNNCodes) is None and HybridLightRNNCodes.short_name is None
    assert HybridLightRNN.short_name == "hybrid_lightrnn" and head_class("hybrid_lightrnn") is HybridLightRNN
    assert head_class("heads.lightrnn.HybridLightRNNCodes") is HybridLightRNNCodes
