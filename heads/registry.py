"""Short names for heads, so configs and the command line can say ``mos`` instead of a class path."""

from __future__ import annotations

import importlib
from typing import Any, Callable, TypeVar, Union

from heads.base import IGNORE_INDEX, OutputHead

_REGISTRY: dict[str, type[OutputHead]] = {}

H = TypeVar("H", bound=type[OutputHead])


def register_head(name: str) -> Callable[[H], H]:
    """Class decorator: make ``name`` resolve to the decorated head class."""

    def decorator(cls: H) -> H:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"head name {name!r} is already registered to {_REGISTRY[name]}")
        _REGISTRY[name] = cls
        cls.short_name = name
        return cls

    return decorator


def available_heads() -> list[str]:
    """Registered short names, sorted."""
    return sorted(_REGISTRY)


def head_class(name: str | type[OutputHead]) -> type[OutputHead]:
    """Resolve a short name (``"mos"``), a class name, a dotted class path or a class."""
    if isinstance(name, type):
        if not issubclass(name, OutputHead):
            raise ValueError(f"{name} is not an OutputHead subclass (derive from heads.base.OutputHead)")
        return name
    if name in _REGISTRY:
        return _REGISTRY[name]
    for cls in _REGISTRY.values():
        if cls.__name__ == name:
            return cls
    if "." in name:
        module_name, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):
            cls = None
        if isinstance(cls, type) and issubclass(cls, OutputHead):
            return cls
    raise ValueError(
        f"unknown head {name!r}: valid names are {', '.join(available_heads())} "
        f"(or a class path such as heads.Softmax)"
    )


def create_head(name: str | type[OutputHead], in_features: int, num_classes: int, **kwargs: Any) -> OutputHead:
    """Build a head by name with the sizes the task knows and any init arguments."""
    return head_class(name)(in_features=in_features, num_classes=num_classes, **kwargs)


#: A head given as a short name (``"mos"``) or as a factory called with
#: ``(in_features, num_classes)``; LightningCLI builds the factory from ``class_path`` +
#: ``init_args`` so configs never repeat sizes the data knows.
HeadSpec = Union[str, Callable[[int, int], OutputHead]]


def build_head(
    spec: HeadSpec, in_features: int, num_classes: int, ignore_index: int = IGNORE_INDEX, setting: str = "model.init_args.head"
) -> OutputHead:
    """Instantiate a head from a short name, class path or factory; ``setting`` names the
    config key in error messages."""
    if isinstance(spec, str):
        return create_head(spec, in_features, num_classes, ignore_index=ignore_index)
    if isinstance(spec, OutputHead):
        raise ValueError(
            f"got an already built {type(spec).__name__} for {setting}; pass its name or class_path so it can be "
            f"sized with in_features={in_features} and num_classes={num_classes}"
        )
    head = spec(in_features, num_classes)
    if not isinstance(head, OutputHead):
        raise ValueError(f"{setting} factory returned {type(head).__name__}, not an OutputHead subclass")
    return head
