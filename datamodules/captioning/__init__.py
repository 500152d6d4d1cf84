"""Image captioning data: images with several reference captions each. The shared base
(:mod:`.base`), records, dataset and batching (:mod:`.dataset`), Karpathy's COCO / Flickr
splits (:mod:`.karpathy`); the embedded default source is :mod:`datamodules.scenes`.

``datamodules.captioning.KarpathyCaptions`` is the class path configs and checkpoints name;
the other names are kept importable from here so code written before the split runs.
"""

from datamodules.bpe import BOS_ID, EOS_ID, PAD_ID, decode_ids  # noqa: F401
from datamodules.captioning.base import (  # noqa: F401
    BOS,
    EOS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    PAD,
    SPECIALS,
    TOKENIZERS,
    UNK,
    CaptionDataModule,
)
from datamodules.captioning.dataset import (  # noqa: F401
    CaptionDataset,
    CaptionRecord,
    collate_captions,
    load_image,
    padding_image,
    simple_words,
)
from datamodules.captioning.karpathy import (  # noqa: F401
    KARPATHY_SPLITS,
    KarpathyCaptions,
    check_karpathy_entry,
    read_karpathy_json,
)
from heads.base import IGNORE_INDEX  # noqa: F401
