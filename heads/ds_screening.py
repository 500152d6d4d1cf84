"""Old path of :mod:`heads.ds.screening`, kept so configs and checkpoints written before the move load."""

from heads.ds.kmeans import CHUNK, nearest, spherical_kmeans  # noqa: F401
from heads.ds.screening import dense_topk, kept_mask, screen_softmax  # noqa: F401
