"""Old path of :mod:`heads.lightrnn.head`, kept so configs and checkpoints written before the move load."""

from heads.lightrnn.allocation import ReallocationCosts  # noqa: F401
from heads.lightrnn.head import HybridLightRNN  # noqa: F401
