"""The one map from head names to head classes, and the builders every caller uses.

Each head registers its short name (``@register_head("mos")``), so configs and the command line
can say ``mos`` instead of a class path, and tools build heads by name
(:func:`create_head`, :func:`head_factory`, :func:`build_head`) instead of keeping their own
name-to-class switches. It is also the only list of heads: each head declares there what the
tools need (its family, whether it trains, the size the benches give it), and the demo and the
benches select their heads with :func:`list_heads` (timm's ``list_models``), so a newly
registered head joins them without editing any tool.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, TypeVar, Union

from heads.base import IGNORE_INDEX, OutputHead

#: The families a head declares at :func:`register_head`; the tools compare one family at a time.
FAMILIES = {
    "bottleneck": "softmax and the heads that break its bottleneck (MoC as the low-rank baseline, MoS, Mixtape, "
    "SigSoftmax)",
    "clustered": "heads that factorise a large softmax over frequency clusters, cheap to train and to evaluate "
    "(adaptive softmax)",
    "sparse": "heads that make a large softmax cheap at inference (DS-Softmax, SVD-softmax)",
    "encoding": "vocabulary encodings around an inner head (Hybrid-LightRNN)",
}


#: The families the demo and the benches compare by default: softmax, the heads that break its
#: bottleneck, and the factorisation that makes it cheap (in registration order: adaptive softmax
#: registers right after softmax, so its rows sit beside the baseline's).
COMPARED_FAMILIES = ("bottleneck", "clustered")


@dataclass(frozen=True)
class HeadEntry:
    """What a head declares where it registers (see :func:`register_head`)."""

    name: str
    cls: type[OutputHead]
    size_argument: str | None = None
    family: str | None = None
    trainable: bool = True
    bench_size: int | None = None


#: Short name -> entry, in registration order (``heads/__init__.py`` imports softmax first, the
#: baseline every comparison divides by).
_REGISTRY: dict[str, HeadEntry] = {}

H = TypeVar("H", bound=type[OutputHead])


def register_head(
    name: str, size_argument: str | None = None, *, family: str | None = None, trainable: bool = True,
    bench_size: int | None = None,
) -> Callable[[H], H]:
    """Class decorator: make ``name`` resolve to the decorated head class.

    Args:
        size_argument: the constructor argument that sets the head's number of components
            (``num_components`` for MoS, ``num_gates`` for Mixtape), the ``K`` of a ``mos:15`` head
            spec in the tools; ``None`` for a head that has no such size.
        family: one of :data:`FAMILIES`; the demo and the benches take their default heads from
            it (:func:`list_heads`). ``None``: built by name only, in no default comparison.
        trainable: ``False`` for an inference-only head built from a trained one (SVD-softmax);
            the training benches leave it out.
        bench_size: the ``K`` the training bench gives the head by default and writes in its row
            label (``mos:15``); ``None``: the bench leaves the head's own default, label ``name``.
    """
    if family is not None and family not in FAMILIES:
        raise ValueError(f"head {name!r}: family must be one of {', '.join(FAMILIES)} or None, got {family!r}")
    if bench_size is not None and size_argument is None:
        raise ValueError(f"head {name!r}: bench_size={bench_size} needs a size_argument for it to set")

    def decorator(cls: H) -> H:
        if name in _REGISTRY and _REGISTRY[name].cls is not cls:
            raise ValueError(f"head name {name!r} is already registered to {_REGISTRY[name].cls}")
        _REGISTRY[name] = HeadEntry(name, cls, size_argument, family, trainable, bench_size)
        cls.short_name = name
        cls.size_argument = size_argument
        return cls

    return decorator


def available_heads() -> list[str]:
    """Registered short names, sorted."""
    return sorted(_REGISTRY)


def list_heads(family: str | tuple[str, ...] | None = None, trainable: bool | None = None) -> list[str]:
    """Registered short names in registration order (softmax first), filtered by what each head
    declared at :func:`register_head`: its ``family`` (one name or a tuple of them) and whether
    it is ``trainable``; ``None`` does not filter (``list_heads()`` is every head)."""
    families = (family,) if isinstance(family, str) else family
    for name in families or ():
        if name not in FAMILIES:
            raise ValueError(f"unknown head family {name!r}: valid are {', '.join(FAMILIES)}")
    return [
        entry.name for entry in _REGISTRY.values()
        if (families is None or entry.family in families) and (trainable is None or entry.trainable == trainable)
    ]


def head_entry(name: str) -> HeadEntry:
    """What the head registered as ``name`` declared; an unknown name is one ``ValueError``
    listing the registered ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown head {name!r}: valid names are {', '.join(available_heads())}")
    return _REGISTRY[name]


def check_heads(names: list[str], valid: list[str], option: str, hint: str = "") -> None:
    """One ``ValueError`` for the first of ``names`` (given in ``option``) not in ``valid``, listing
    ``valid`` (then ``hint``, e.g. how to write a size); an empty ``names`` is an error too."""
    if not names:
        raise ValueError(f"{option} is empty: give some of {', '.join(valid)}")
    unknown = [name for name in names if name not in valid]
    if unknown:
        raise ValueError(f"unknown head {unknown[0]!r} in {option}: valid are {', '.join(valid)}{hint}")


def head_class(name: str | type[OutputHead]) -> type[OutputHead]:
    """Resolve a short name (``"mos"``), a class name, a dotted class path or a class."""
    if isinstance(name, type):
        if not issubclass(name, OutputHead):
            raise ValueError(f"{name} is not an OutputHead subclass (derive from heads.base.OutputHead)")
        return name
    if name in _REGISTRY:
        return _REGISTRY[name].cls
    for entry in _REGISTRY.values():
        if entry.cls.__name__ == name:
            return entry.cls
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


def short_name(name: str | type[OutputHead]) -> str | None:
    """The registered short name of a head given by short name, class name, class path or class;
    ``None`` when it is not a registered head (nothing is imported to find out)."""
    if isinstance(name, type):
        entry = _REGISTRY.get(getattr(name, "short_name", ""))
        return entry.name if entry is not None and entry.cls is name else None
    if name in _REGISTRY:
        return name
    class_name = name.rpartition(".")[2]
    return next((key for key, entry in _REGISTRY.items() if entry.cls.__name__ == class_name), None)


def size_argument(name: str | type[OutputHead]) -> str | None:
    """The constructor argument a head's size ``K`` sets (see :func:`register_head`), or ``None``."""
    return getattr(head_class(name), "size_argument", None)


def create_head(
    name: str | type[OutputHead], in_features: int, num_classes: int, size: int | None = None, **kwargs: Any
) -> OutputHead:
    """Build a head by name with the sizes the task knows and any init arguments; ``size`` sets
    the head's :func:`size_argument` (``create_head("mos", 400, 10_000, size=15)``)."""
    cls = head_class(name)
    if size is not None:
        key = getattr(cls, "size_argument", None)
        if key is None:
            raise ValueError(f"head {cls.__name__} takes no size K (give it without one)")
        kwargs[key] = size
    return cls(in_features=in_features, num_classes=num_classes, **kwargs)


def head_factory(name: str | type[OutputHead], size: int | None = None, **kwargs: Any) -> Callable[[int, int], OutputHead]:
    """A factory ``(in_features, num_classes) -> head`` for :func:`build_head` and for heads that
    wrap other heads (Hybrid-LightRNN's ``inner``); the name is checked now, the head built later."""
    cls = head_class(name)

    def factory(in_features: int, num_classes: int) -> OutputHead:
        return create_head(cls, in_features, num_classes, size=size, **kwargs)

    return factory


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
