"""Parallel text for machine translation: the corpora on disk (:mod:`.sources`), token-count
batching sharded over DDP ranks (:mod:`.batching`) and the data module that tokenises and
builds vocabularies (:mod:`.datamodule`).

``datamodules.translation.TranslationDataModule`` is the class path configs and checkpoints
name; the other names are kept importable from here so code written before the split runs.
"""

from datamodules.bpe import BOS_ID, EOS_ID, PAD_ID, decode_ids  # noqa: F401
from datamodules.translation.batching import (  # noqa: F401
    Example,
    TokenBatchStream,
    collate,
    shard_batches,
    token_batches,
)
from datamodules.translation.datamodule import (  # noqa: F401
    BOS,
    EOS,
    PAD,
    SPECIALS,
    UNK,
    TranslationDataModule,
    check_tokenizer_state,
)
from datamodules.translation.sources import (  # noqa: F401
    MULTI30K_TASK1_SHA256,
    MULTI30K_URL,
    SOURCES,
    ParallelSource,
    find_text_file,
    read_lines,
    read_parallel,
    synthetic_corpus,
)
from heads.base import IGNORE_INDEX  # noqa: F401
