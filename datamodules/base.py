"""The data contract: what tasks and tools may ask of a datamodule.

Every datamodule of the project derives from :class:`HeadDataModule`. A task and a tool read a
datamodule only through the members declared here (and through Lightning's own hooks and
loaders); they never probe attributes by name. Members a few sources have are small capability
protocols, checked with ``isinstance``:

* :class:`SourceVocabulary` -- inputs with a vocabulary of their own (translation's source side);
* :class:`FeatureInputs` -- fixed-size feature vectors (the synthetic hierarchy);
* :class:`ClassHierarchy` -- classes grouped into known super-classes;
* :class:`TokenWindows` -- truncated-BPTT windows of one token stream (language modeling).

Sizes: ``num_classes``, ``source_vocab_size`` and ``num_features`` (:data:`DATA_LINKS`) are linked
into the model by the CLI (``link_arguments(..., apply_on="instantiate")``), i.e. read right after
the datamodule is built, before ``prepare_data`` and ``setup``. So they are valid from construction
on; reading one may do the I/O it needs (read the training split, train a tokenizer) and caches it.
A size a datamodule does not have is not linked (and a model that needs it says it is missing).

Checkpoints: ``tasks.base.HeadTask`` stores :meth:`HeadDataModule.state_for_checkpoint` as
``checkpoint["datamodule_state"]``, one schema for every source (:class:`DataState`), so a model
restored without its datamodule still names and decodes its classes (:class:`StateDecoder`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol, Sequence, TypedDict, runtime_checkable

import lightning.pytorch as pl
from torch import Tensor

from datamodules.bpe import TextTokenizer, decode_ids

#: Datamodule sizes the CLI (``app/cli.py``) links into the model's arguments of the same name, when
#: the datamodule has the size and the model's ``__init__`` takes it.
DATA_LINKS = ("num_classes", "source_vocab_size", "num_features")


class DataState(TypedDict):
    """``checkpoint["datamodule_state"]``: the same four keys for every data source.

    Keys:
        class_names: ``list[str]``, the label of every class id the head predicts, in id order
            (words of a language model, caption / target pieces, characters, hierarchy names).
        tokenizer: ``dict | None``, :meth:`datamodules.bpe.TextTokenizer.state` of the tokenizer
            that turns class pieces into text (captioning, translation target side); ``None``
            when every class is a whole label (class names joined by spaces).
        source_vocabulary: ``list[str] | None``, the input vocabulary in id order for sources
            whose inputs have a vocabulary of their own (translation's source side); else ``None``.
        source_tokenizer: ``dict | None``, the tokenizer state of those inputs; else ``None``.
    """

    class_names: list[str]
    tokenizer: dict[str, Any] | None
    source_vocabulary: list[str] | None
    source_tokenizer: dict[str, Any] | None


#: The keys of :class:`DataState`, in declaration order.
STATE_KEYS: tuple[str, ...] = tuple(DataState.__annotations__)


def check_data_state(state: Any, where: str = "checkpoint") -> DataState:
    """``state`` itself when it has exactly the :class:`DataState` keys; else one line naming
    what is missing or unknown."""
    if not isinstance(state, dict):
        raise ValueError(
            f"{where} has no datamodule_state (got {type(state).__name__}): it was not written by a HeadTask run "
            f"with a datamodules.base.HeadDataModule; retrain it with python -m app fit"
        )
    missing = [key for key in STATE_KEYS if key not in state]
    unknown = sorted(str(key) for key in state if key not in STATE_KEYS)
    if missing or unknown:
        problem = ", ".join(filter(None, (missing and f"missing {', '.join(missing)}", unknown and f"unknown {', '.join(unknown)}")))
        raise ValueError(
            f"{where} has a datamodule_state with keys {sorted(map(str, state))} ({problem}); the schema is "
            f"{', '.join(STATE_KEYS)} (datamodules.base.DataState): retrain it with python -m app fit"
        )
    return state


def decode_classes(ids: Sequence[int], class_names: Sequence[str], tokenizer: TextTokenizer | None) -> str:
    """Text of a sequence of class ids: with a tokenizer, its detokenisation of the pieces (stopping
    at EOS, skipping PAD and BOS, :func:`datamodules.bpe.decode_ids`); without, the class names
    joined by spaces."""
    if tokenizer is None:
        return " ".join(class_names[int(i)] for i in ids)
    return decode_ids(ids, class_names, tokenizer)


class StateDecoder:
    """Class names and ids -> text from a :class:`DataState` alone (a model restored without its
    datamodule): the same decoding as :meth:`HeadDataModule.decode` of the source that wrote it."""

    def __init__(self, state: DataState, where: str = "checkpoint") -> None:
        state = check_data_state(state, where)
        self.class_names: list[str] = list(state["class_names"])
        tokenizer = state["tokenizer"]
        self.tokenizer = None if tokenizer is None else TextTokenizer.from_state(tokenizer, "datamodule_state.tokenizer", where)

    def decode(self, ids: Sequence[int]) -> str:
        return decode_classes(ids, self.class_names, self.tokenizer)


class HeadDataModule(pl.LightningDataModule, ABC):
    """Base of every datamodule: the data side of a task built around one output head.

    A subclass implements :attr:`num_classes` and :attr:`class_names` and overrides the members
    below whose defaults do not describe it. Sizes and class names are valid from construction
    on (see the module docstring); everything else is valid once the member is first read (it may
    build what it needs).
    """

    #: ``True`` when class ids are sorted by decreasing training frequency after the specials
    #: (what heads with ``requires_frequency_order`` need: Mixtape's gate sharing, adaptive-style
    #: heads). Default ``False``: nothing claimed.
    frequency_ordered: ClassVar[bool] = False

    @property
    @abstractmethod
    def num_classes(self) -> int:
        """``int > 0``: the number of classes the head predicts (vocabulary or label-set size).
        Linked into ``model.init_args.num_classes`` by the CLI; valid from construction on."""

    @property
    @abstractmethod
    def class_names(self) -> list[str]:
        """``list[str]`` of length :attr:`num_classes`: the label of every class id, in id order
        (what a checkpoint stores, what reports and samples show). Valid from construction on."""

    @property
    def text_tokenizer(self) -> TextTokenizer | None:
        """The tokenizer that turns class pieces into text (:meth:`decode`), ``None`` when every
        class is a whole label (the default)."""
        return None

    def class_counts(self) -> Tensor | None:
        """``(num_classes,)`` int64 occurrences of each class among the training targets (heads
        start their biases from the log unigram), or ``None`` when the source does not count them
        (the default; the bias initialisation is then skipped). May read the training split."""
        return None

    @property
    def true_entropy(self) -> float | None:
        """Mean nats per test target under the true distribution, known only for generated data
        whose distribution is exact; ``None`` otherwise (the default)."""
        return None

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated class ids (:func:`decode_classes` with :attr:`class_names` and
        :attr:`text_tokenizer`)."""
        return decode_classes(ids, self.class_names, self.text_tokenizer)

    def state_for_checkpoint(self) -> DataState:
        """What a checkpoint needs to name and decode the classes without the data (:class:`DataState`).
        A source with an input vocabulary of its own fills the ``source_*`` keys."""
        tokenizer = self.text_tokenizer
        return DataState(
            class_names=[str(name) for name in self.class_names],
            tokenizer=None if tokenizer is None else tokenizer.state(),
            source_vocabulary=None,
            source_tokenizer=None,
        )

    def load_state_for_checkpoint(self, state: DataState, where: str = "checkpoint") -> None:
        """Adopt a checkpoint's :class:`DataState` (a source whose ids depend on what it built from
        its files, e.g. a vocabulary or a trained tokenizer, takes the checkpoint's instead). The
        default checks the schema and adopts nothing: the source's labels follow from its settings.
        ``where`` (``checkpoint <path>``) names the file in a refusal."""
        check_data_state(state, where)


@runtime_checkable
class SourceVocabulary(Protocol):
    """Inputs with a vocabulary of their own (translation's source side)."""

    @property
    def source_vocab_size(self) -> int:
        """``int > 0``: input vocabulary size, linked into ``model.init_args.source_vocab_size``;
        valid from construction on."""

    @property
    def source_vocabulary(self) -> list[str]:
        """``list[str]`` of length ``source_vocab_size``: the input token of every id, in id order."""


@runtime_checkable
class FeatureInputs(Protocol):
    """Inputs that are fixed-size feature vectors."""

    @property
    def num_features(self) -> int:
        """``int > 0``: the input dimension, linked into ``model.init_args.num_features``; valid
        from construction on."""


@runtime_checkable
class ClassHierarchy(Protocol):
    """Classes grouped into known super-classes (analyses check whether experts rediscover them)."""

    @property
    def super_class_of(self) -> list[int]:
        """``list[int]`` of length ``num_classes``: the super-class of every class id."""


@runtime_checkable
class TokenWindows(Protocol):
    """One token stream served as truncated-BPTT windows."""

    #: ``int > 0``: the nominal window length (tokens per row per batch); training windows of
    #: random length scale the learning rate by ``length / bptt``.
    bptt: int


def as_head_datamodule(datamodule: Any) -> HeadDataModule | None:
    """``datamodule`` when it is a :class:`HeadDataModule`, ``None`` for no datamodule; any other
    object is refused in one line (tasks and tools read data only through the contract)."""
    if datamodule is None or isinstance(datamodule, HeadDataModule):
        return datamodule
    cls = type(datamodule)
    raise TypeError(
        f"{cls.__module__}.{cls.__qualname__} is not a datamodules.base.HeadDataModule: tasks read sizes, class names "
        f"and checkpoint state through that contract (derive the datamodule from datamodules.base.HeadDataModule)"
    )
