"""Argument checks for heads and their callbacks, each raising the project's one-line error.

Every check names the owner (``Mixtape``), the setting, the rule, the value it got and where to
change it (``where.key``; ``head.init_args`` for a head, e.g. ``the callback's init_args`` for a
callback), and returns the value in the type the owner stores.
"""

from __future__ import annotations

HEAD = "head.init_args"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_int(value: int, key: str, owner: str, minimum: int = 1, where: str = HEAD) -> int:
    """An integer hyper-parameter that must be at least ``minimum``."""
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{owner} needs {key} to be an integer >= {minimum}, got {value!r} (set {where}.{key})")
    return value


def check_power_of_two(value: int, key: str, owner: str, where: str = HEAD) -> int:
    """An integer that must be a power of two ``>= 2`` (the leaves of a complete binary tree)."""
    if not _is_int(value) or value < 2 or value & (value - 1):
        raise ValueError(f"{owner} needs {key} to be a power of two >= 2, got {value!r} (set {where}.{key})")
    return value


def check_dropout(value: float, key: str, owner: str, where: str = HEAD) -> float:
    """A dropout probability, in ``[0, 1)``."""
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{owner} needs {key} in [0, 1), got {value} (set {where}.{key})")
    return float(value)


def check_fraction(value: float, key: str, owner: str, where: str = HEAD) -> float:
    """A share of something that must not be empty, in ``(0, 1]``."""
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{owner} needs {key} in (0, 1], got {value} (set {where}.{key})")
    return float(value)


def check_share(value: float, key: str, owner: str, meaning: str, example: float, where: str = HEAD) -> float:
    """A share that may be zero but not the whole, in ``[0, 1)``; ``meaning`` says what it is a share of."""
    if isinstance(value, bool) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{owner} needs {key} in [0, 1) ({meaning}), got {value!r} (set {where}.{key}, e.g. {example})")
    return float(value)


def check_nonnegative(value: float, key: str, owner: str, where: str = HEAD) -> float:
    """A weight, threshold or noise level, ``>= 0``."""
    if not float(value) >= 0.0:
        raise ValueError(f"{owner} needs {key} >= 0, got {value} (set {where}.{key})")
    return float(value)


def check_positive_or_none(value: float | None, key: str, owner: str, where: str = HEAD) -> float | None:
    """An optional scale: ``None`` (off) or ``> 0``."""
    if value is not None and not float(value) > 0.0:
        raise ValueError(f"{owner} needs {key} > 0 or null, got {value} (set {where}.{key})")
    return None if value is None else float(value)


def check_choice(value: str, key: str, owner: str, choices: tuple[str, ...], where: str = HEAD) -> str:
    """One of a fixed set of names."""
    if value not in choices:
        raise ValueError(
            f"{owner} {key} must be {', '.join(choices[:-1])} or {choices[-1]}, got {value!r} (set {where}.{key})"
        )
    return value
