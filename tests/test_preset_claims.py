"""Config headers tell the truth about their numbers.

Convention: a header (the comment lines above a config's first key) writes each value it states
as ``key=value``, where ``key`` is the end of the value's path with ``init_args`` left out
(``optimizer.lr`` is ``model.init_args.optimizer.init_args.lr``). This module proves that

* every ``key=value`` of every header in configs/ names exactly one value of that config and
  equals it, so a header cannot drift from its YAML;
* the presets that claim a paper's setting hold the paper's values, transcribed below from the
  paper at the table or section named (``PAPER``), and their headers state each of them, so a
  wrong number in the header *and* the YAML still fails here.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").rglob("*.yaml"))

#: ``key=value`` in a header: a dotted lower-case key, a number or true/false.
CLAIM = re.compile(r"(?<![\w.=])([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)=(true|false|-?[0-9][0-9.eE+-]*)(?![\w.])")

#: "set, and above zero": a regulariser the paper switches on without giving the rate used.
ON = "on"

#: Paper values of the presets that follow a paper, with where they were read.
PAPER: dict[str, tuple[str, dict[str, object]]] = {
    "configs/lm/ptb_mos.yaml": (
        "MoS (Yang et al. 2018), App. B.1, Table 8, PTB column",
        {
            "optimizer.lr": 20, "data.batch_size": 12, "encoder.embedding_dim": 280, "head.embedding_dim": 280,
            "encoder.num_layers": 3, "encoder.hidden_size": 960, "encoder.last_hidden_size": 620,  # [960, 960, 620]
            "head.num_components": 15,
            "encoder.dropout_embedding": 0.10,  # word-level V-dropout
            "encoder.dropout_input": 0.55,  # embedding V-dropout
            "encoder.dropout_hidden": 0.20,  # hidden state V-dropout
            "encoder.weight_drop": 0.50,  # recurrent weight dropout
            "head.dropout": 0.30, "head.variational_dropout": True,  # context vector V-dropout
        },
    ),
    "configs/lm/wikitext2_mos.yaml": (
        "MoS (Yang et al. 2018), App. B.1, Table 8, WT2 column",
        {
            "optimizer.lr": 15, "data.batch_size": 15, "encoder.embedding_dim": 300, "head.embedding_dim": 300,
            "encoder.num_layers": 3, "encoder.hidden_size": 1150, "encoder.last_hidden_size": 650,  # [1150, 1150, 650]
            "head.num_components": 15,
            "encoder.dropout_embedding": 0.10, "encoder.dropout_input": 0.40, "encoder.dropout_hidden": 0.225,
            "encoder.weight_drop": 0.50, "head.dropout": 0.30, "head.variational_dropout": True,
        },
    ),
    "configs/heads/mixtape_lm.yaml": (
        "Mixtape (Yang et al. 2019), §3.2 (K = 4), §3.3 (r = 0.1 for language modeling), §3.4 (regularisers, "
        "weight normalisation for language modeling; no rates given)",
        {
            "head.num_gates": 4, "head.frequent_fraction": 0.1,
            "head.dropout": ON, "head.gate_dropout": ON, "head.gate_noise": ON, "head.weight_norm_scale": ON,
        },
    ),
    "configs/captioning/coco_karpathy_bpe_mos.yaml": (
        "seed 002 (Kong et al.), Experiment Details (3K code dictionary on MSCOCO) and Table 5 (3 x 3k)",
        {"data.bpe_vocab_size": 3000, "head.num_components": 3},
    ),
}


def header(text: str) -> str:
    """The comment lines above the first YAML line."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


def claims(text: str) -> dict[str, object]:
    """The ``key=value`` pairs of a config's header (a key stated twice must agree with itself)."""
    found: dict[str, object] = {}
    for key, raw in CLAIM.findall(header(text)):
        value = {"true": True, "false": False}.get(raw)
        if value is None:
            value = float(raw)
        assert found.setdefault(key, value) == value, f"header states {key} twice: {found[key]} and {value}"
    return found


def leaves(node, path: tuple[str, ...] = ()):
    """``(path without init_args, value)`` of every scalar in a config; a list entry's segment is
    its class name (``trainer.callbacks.GroupLassoPruning.loss_below``), else its position."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, path if key == "init_args" else (*path, str(key)))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            named = isinstance(item, dict) and isinstance(item.get("class_path"), str)
            yield from leaves(item, (*path, item["class_path"].rpartition(".")[2] if named else str(i)))
    else:
        yield path, node


def lookup(config: dict, key: str) -> list[tuple[str, object]]:
    """Every value of ``config`` whose path ends with ``key``."""
    wanted = tuple(key.split("."))
    return [(".".join(path), value) for path, value in leaves(config) if path[-len(wanted):] == wanted]


def same(value, claimed) -> bool:
    if isinstance(claimed, bool) or isinstance(value, bool):
        return value is claimed
    return isinstance(value, (int, float)) and math.isclose(float(value), float(claimed), rel_tol=1e-9)


def check(text: str) -> list[str]:
    """What is wrong between a config's header claims and its values (empty: nothing)."""
    config = yaml.safe_load(text) or {}
    problems = []
    for key, claimed in claims(text).items():
        matches = lookup(config, key)
        if len(matches) != 1:
            where = ", ".join(path for path, _ in matches) or "no value"
            problems.append(f"header's {key}={claimed} names {len(matches)} values ({where}): lengthen the key")
        elif not same(matches[0][1], claimed):
            problems.append(f"header says {key}={claimed}, the config holds {matches[0][0]}: {matches[0][1]}")
    return problems


@pytest.mark.parametrize("config", CONFIGS)
def test_header_numbers_are_the_configs_values(config):
    problems = check((ROOT / config).read_text(encoding="utf-8"))
    assert not problems, f"{config}: " + "; ".join(problems)


@pytest.mark.parametrize("config", sorted(PAPER))
def test_paper_preset_holds_and_states_the_papers_values(config):
    source, values = PAPER[config]
    text = (ROOT / config).read_text(encoding="utf-8")
    stated, data = claims(text), yaml.safe_load(text)
    for key, paper in values.items():
        (path, value), = lookup(data, key)  # exactly one: the key names one value
        if paper is ON:
            assert isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0, (
                f"{config}: {path} is {value}; {source} switches it on"
            )
            continue
        assert same(value, paper), f"{config}: {path} is {value}, {source} gives {paper}"
        assert key in stated and same(stated[key], paper), f"{config}: the header must state {key}={paper} ({source})"


def test_the_check_catches_a_wrong_header():
    """The checker itself: a wrong number, an ambiguous key and an unknown key are reported."""
    text = (ROOT / "configs/lm/ptb_mos.yaml").read_text(encoding="utf-8")
    assert check(text) == []
    wrong = text.replace("optimizer.lr=20", "optimizer.lr=30", 1)
    assert check(wrong) == ["header says optimizer.lr=30.0, the config holds model.optimizer.lr: 20.0"]
    ambiguous = "# embedding_dim=280\n" + text  # the encoder's and the head's
    assert check(ambiguous)[0].startswith("header's embedding_dim=280.0 names 2 values")
    unknown = "# head.gate_noise=0.1\n" + text
    assert "names 0 values (no value)" in check(unknown)[0]


def test_a_callbacks_value_is_found_by_its_class_name():
    """List entries (callbacks) are walked under their class name: a header's ``loss_below=`` is
    checked against the GroupLassoPruning entry, and a wrong one is reported with that path."""
    text = (ROOT / "configs/hanzi/ds32.yaml").read_text(encoding="utf-8")
    assert check(text) == [] and claims(text)["loss_below"] == 1.0
    wrong = text.replace("loss_below=1.0", "loss_below=2.0", 1)
    assert check(wrong) == ["header says loss_below=2.0, the config holds "
                            "trainer.callbacks.GroupLassoPruning.loss_below: 1.0"]
