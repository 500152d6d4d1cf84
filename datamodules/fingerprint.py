"""What a checkpoint was trained on: task, head and a fingerprint of the data's class labels.

A head's output row ``i`` means "class ``i`` of the training vocabulary". Loading its weights with
data whose vocabulary has the same size but another order (another corpus, another tokenizer
setting, a vocabulary rebuilt from different files) raises no error and scores nonsense. So every
checkpoint stores ``checkpoint["headbench"] = {"task", "head", "data_fingerprint"}``
(``tasks.base.HeadTask.on_save_checkpoint``) and loading compares it with the model and data at
hand (:func:`origin_mismatch`).

The fingerprint is the SHA-256 of the class labels in id order: the data contract's
``class_names`` (:class:`datamodules.base.HeadDataModule`), and for a source with an input
vocabulary of its own (:class:`datamodules.base.SourceVocabulary`, translation) its source
vocabulary too.
"""

from __future__ import annotations

import hashlib
from typing import Any

from datamodules.base import HeadDataModule, SourceVocabulary


def class_path(obj: Any) -> str:
    """``module.QualifiedName`` of an object's class."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def class_labels(datamodule: HeadDataModule) -> dict[str, list[str]]:
    """The datamodule's class labels in id order, by role: ``classes``, or ``source`` and
    ``target`` for a source with an input vocabulary of its own."""
    classes = [str(name) for name in datamodule.class_names]
    if isinstance(datamodule, SourceVocabulary):
        return {"source": list(datamodule.source_vocabulary), "target": classes}
    return {"classes": classes}


def data_fingerprint(datamodule: HeadDataModule) -> str:
    """SHA-256 (hex) of the datamodule's class labels."""
    labels = class_labels(datamodule)
    digest = hashlib.sha256()
    for role in sorted(labels):
        digest.update(role.encode("utf-8") + b"\0")
        for label in labels[role]:
            # length-prefixed, so no choice of labels can collide by concatenation
            encoded = label.encode("utf-8", "surrogatepass")
            digest.update(len(encoded).to_bytes(4, "little") + encoded)
    return digest.hexdigest()


def checkpoint_origin(model: Any, datamodule: HeadDataModule | None) -> dict[str, Any]:
    """``{"task", "head", "data_fingerprint"}`` of a model and its datamodule (``None`` fields
    where unknown)."""
    return {
        "task": class_path(model),
        "head": class_path(model.head),
        "data_fingerprint": None if datamodule is None else data_fingerprint(datamodule),
    }


def origin_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """What differs between a checkpoint's stored origin and the model/data loading it, as the
    tail of one error line; ``None`` when they agree (or a field is unknown on either side)."""
    if saved.get("task") and current.get("task") and saved["task"] != current["task"]:
        return (
            f"was written by task {saved['task']} but the model is {current['task']}: evaluate it with that task's "
            f"config (or without --model/--config model settings)"
        )
    if saved.get("head") and current.get("head") and saved["head"] != current["head"]:
        return (
            f"holds a {saved['head']} head but the model builds {current['head']}: drop the head setting "
            f"(--model.init_args.head / a heads/*.yaml config) or pass the checkpoint's head"
        )
    expected, found = saved.get("data_fingerprint"), current.get("data_fingerprint")
    if expected and found and expected != found:
        return (
            f"was trained on a vocabulary / label set with fingerprint {expected[:12]} but the data gives {found[:12]} "
            f"(same size, other labels or order): use the data and vocabulary settings it was trained with"
        )
    return None
