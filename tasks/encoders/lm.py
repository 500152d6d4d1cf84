"""The contract of a language model's encoder, and the argument checks its implementations share.

A :class:`tasks.LanguageModel` builds its encoder from ``model.init_args.encoder``
(``class_path`` + ``init_args``) and passes the one size only the data knows, the vocabulary
size, as the first argument; the head's ``in_features`` is then the encoder's ``out_features``.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

from torch import Tensor, nn


class LMEncoder(nn.Module):
    """What a language model's encoder offers the task.

    ``forward(tokens, state) -> (hidden, raw, state)`` encodes one TBPTT window, continuing from
    ``state`` (``None`` at the start of a stream): ``hidden`` goes to the head, ``raw`` is the
    last layer's output before output dropout (temporal activation regularisation, AWD-LSTM §4.6).
    ``embedding`` is the input embedding (``tie_weights`` shares it with the head's class
    embeddings); ``out_features`` is the width the head receives. ``max_length`` is the longest
    window the encoder reads at once, ``None`` when a carried state holds the context instead
    (sampling feeds a stateless encoder the last ``max_length`` tokens).
    """

    embedding: nn.Embedding
    out_features: int
    max_length: int | None = None

    def forward(self, tokens: Tensor, state: Any = None) -> tuple[Tensor, Tensor, Any]:
        """Shape: tokens ``(B, T)`` -> hidden ``(B, T, out_features)``, raw ``(B, T, H)``, new state."""
        raise NotImplementedError


def check_sizes(owner: str, **sizes: int | None) -> None:
    """Refuse a size that is not an integer >= 1 (``None`` means "use the default")."""
    for key, value in sizes.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(
                f"{owner} needs {key} to be an integer >= 1, got {value!r} (set model.init_args.encoder.init_args.{key})"
            )


def check_dropouts(owner: str, **probabilities: float) -> None:
    """Refuse a dropout probability outside [0, 1)."""
    for key, value in probabilities.items():
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{owner} needs {key} in [0, 1), got {value} (set model.init_args.encoder.init_args.{key})")


def encoder_factory(spec: Any) -> Callable[[int], LMEncoder]:
    """The callable that builds the encoder from the vocabulary size.

    ``spec`` is what the CLI passes (a factory), a class or ``functools.partial`` from Python, or
    ``{"class_path": ..., "init_args": {...}}`` as saved in a checkpoint and handed back unparsed
    when a model is rebuilt from the file alone; such a class path must name an
    :class:`LMEncoder` of the ``tasks`` package.
    """
    if callable(spec):
        return spec
    if isinstance(spec, dict) and isinstance(spec.get("class_path"), str):
        module_name, _, name = spec["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module_name), name, None) if module_name.split(".")[0] == "tasks" else None
        if isinstance(cls, type) and issubclass(cls, LMEncoder):
            return functools.partial(cls, **(spec.get("init_args") or {}))
    raise ValueError(
        f"LanguageModel needs an encoder class_path naming a tasks.encoders.LMEncoder, got {spec!r} "
        f"(set model.init_args.encoder.class_path, e.g. tasks.encoders.AWDLSTMEncoder)"
    )


def component_config(value: Any) -> dict[str, Any] | None:
    """``value`` (an encoder given to a task) as a ``class_path`` + ``init_args`` dictionary a
    checkpoint can hold: kept when it is one already, built from a class or a
    ``functools.partial`` of a class with plain keyword arguments, ``None`` for anything else."""
    if isinstance(value, dict):
        return value
    func, keywords = value, {}
    if isinstance(value, functools.partial):
        if value.args:
            return None
        func, keywords = value.func, dict(value.keywords)
    plain = (str, int, float, bool, type(None), list, tuple, dict)
    if not isinstance(func, type) or not all(isinstance(v, plain) for v in keywords.values()):
        return None
    return {"class_path": f"{func.__module__}.{func.__qualname__}", "init_args": keywords}
