"""LightningModules: one task per file, each built around one output head.

Every task class is exported here, so ``--model tasks.<Task>`` works and ``python -m app fit --help``
lists them all (LightningCLI shows the subclasses that are imported)."""

from tasks.base import HeadTask, build_head
from tasks.captioning import CaptioningTask
from tasks.classification import ClassificationTask
from tasks.language_model import LanguageModel
from tasks.translation import TranslationTask

__all__ = ["CaptioningTask", "ClassificationTask", "HeadTask", "LanguageModel", "TranslationTask", "build_head"]
