"""LightningModules: one task per file, each built around one output head."""

from tasks.base import HeadTask, build_head
from tasks.language_model import LanguageModel

__all__ = ["HeadTask", "LanguageModel", "build_head"]
