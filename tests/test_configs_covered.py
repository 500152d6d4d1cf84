"""Every YAML in configs/ is data (plain YAML, no code) and is exercised by some test."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").rglob("*.yaml"))


def mentioned_configs() -> set[str]:
    """Config paths named in test sources, literally or as a glob such as configs/heads/*.yaml."""
    found: set[str] = set()
    for test_file in (ROOT / "tests").glob("*.py"):
        if test_file.name == Path(__file__).name:
            continue
        for pattern in re.findall(r"configs/[A-Za-z0-9_./*{},-]+\.yaml", test_file.read_text(encoding="utf-8")):
            found.update(Path(p).relative_to(ROOT).as_posix() for p in glob.glob(str(ROOT / pattern)))
    return found


def test_there_are_configs():
    assert CONFIGS


@pytest.mark.parametrize("config", CONFIGS)
def test_config_is_plain_yaml(config):
    text = (ROOT / config).read_text(encoding="utf-8")
    assert "!!python" not in text, f"{config}: configs are data, never code"
    assert isinstance(yaml.safe_load(text), dict), f"{config} must be a YAML mapping"


def test_every_config_is_exercised_by_a_test():
    missing = sorted(set(CONFIGS) - mentioned_configs())
    assert not missing, f"configs not run by any test: {missing}"
