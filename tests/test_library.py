"""Heads as a library (docs/library.md): importable from ``heads`` by their paper names and short
aliases, and trained by a plain PyTorch loop (examples/plain_pytorch.py) with the contract only.

What is proved: the example file runs as a user runs it (a fresh process, from another directory),
and each of Mixtape, MoS and DS-Softmax lowers its held-out loss; DS-Softmax's mitosis and pruning
ran as plain calls (4 experts, fewer rows than 4 x V).
"""

from __future__ import annotations

import re
import subprocess
import sys

import heads
from tests.shell import ENV, ROOT


def test_heads_are_importable_by_paper_name_and_short_alias():
    assert heads.MoS is heads.MixtureOfSoftmaxes and heads.MoC is heads.MixtureOfContexts
    for name in ("Softmax", "Mixtape", "MixtureOfSoftmaxes", "MoS", "DSSoftmax", "SigSoftmax", "SVDSoftmax", "HybridLightRNN"):
        assert issubclass(getattr(heads, name), heads.OutputHead) and name in heads.__all__


def test_the_plain_pytorch_example_trains_mixtape_mos_and_ds_softmax(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "examples/plain_pytorch.py"), "--steps", "60"], cwd=tmp_path,
                            env={**ENV, "PYTHONPATH": ""}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = {name: (float(a), float(b)) for name, a, b in re.findall(r"^(\w+): held-out loss ([\d.]+) -> ([\d.]+)", result.stdout, re.M)}
    assert sorted(losses) == ["DSSoftmax", "Mixtape", "MoS"], result.stdout
    for name, (before, after) in losses.items():
        assert after < before - 0.5, (name, before, after)
    experts, kept = map(int, re.search(r"DSSoftmax.*\((\d+) experts, (\d+) of", result.stdout).groups())
    assert experts == 4 and kept < 4 * 60, result.stdout  # one mitosis from 2, then pruning removed rows
