"""Chinese handwritten character recognition data: CASIA-HWDB ``.gnt`` files
(:mod:`datamodules.hanzi.casia`) and the offline default, GB2312 level-1 characters rendered
from CJK fonts with handwriting-like distortion (:mod:`datamodules.hanzi.font_rendered`), on
one base (:mod:`datamodules.hanzi.base`: classes, loaders, the predict folder of
:mod:`datamodules.hanzi.predict`) and one image cache (:mod:`datamodules.hanzi.cache`).

``datamodules.hanzi.CasiaHWDB`` and ``datamodules.hanzi.FontRenderedHanzi`` are the class
paths configs and checkpoints name. The ``.gnt`` helpers (``gnt_files``, ``tag_code``,
``tag_character``) live in :mod:`datamodules.gnt` and are kept importable from here so code
written before the split still runs.
"""

from datamodules.gnt import gnt_files, tag_character, tag_code  # noqa: F401
from datamodules.hanzi.base import HanziDataModule  # noqa: F401
from datamodules.hanzi.cache import (  # noqa: F401
    CACHE_VERSION,
    DEFAULT_CACHE_DIR,
    CachedCharacters,
    ImageCache,
    settings_key,
    to_input,
    write_cache,
)
from datamodules.hanzi.casia import CasiaHWDB  # noqa: F401
from datamodules.hanzi.font_rendered import (  # noqa: F401
    TEST_SEED_OFFSET,
    VAL_SEED_OFFSET,
    FontRenderedHanzi,
    as_distortion,
)
from datamodules.hanzi.predict import ImageFolder, is_image_file, load_character_image  # noqa: F401
