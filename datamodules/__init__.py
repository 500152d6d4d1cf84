"""Data sources: one LightningDataModule per source plus shared text/vocab/download helpers."""

from datamodules.captioning import KarpathyCaptions  # noqa: F401
from datamodules.hanzi import CasiaHWDB, FontRenderedHanzi  # noqa: F401
from datamodules.hierarchy import HierarchyDataModule  # noqa: F401
from datamodules.lm import LanguageModelingDataModule
from datamodules.lm_synthetic import SyntheticLanguage, SyntheticLM
from datamodules.multi30k_captions import Multi30kCaptions
from datamodules.scenes import SyntheticScenes  # noqa: F401
from datamodules.text_corpus import TextCorpus
from datamodules.translation import TranslationDataModule
from datamodules.vocab import Vocabulary

__all__ = [
    "HierarchyDataModule",
    "LanguageModelingDataModule",
    "Multi30kCaptions",
    "SyntheticLM",
    "SyntheticLanguage",
    "TextCorpus",
    "TranslationDataModule",
    "Vocabulary",
]
