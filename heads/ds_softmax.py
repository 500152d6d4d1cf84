"""Old path of :mod:`heads.ds.head`, kept so configs and checkpoints written before the move load."""

from heads.ds.head import GATE_SCALES, LASSO_MODES, DSSoftmax  # noqa: F401
from heads.ds.interface import ParameterRemap, SparseExperts, learning_rate_of, speedup  # noqa: F401
from heads.validation import check_nonnegative  # noqa: F401
