"""Old path of :mod:`heads.lightrnn.codes`, kept so configs and checkpoints written before the move load."""

from heads.lightrnn.codes import EMPTY, HybridLightRNNCodebook, check_encoding_sizes, default_table_shape  # noqa: F401
