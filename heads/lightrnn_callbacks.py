"""Old path of :mod:`heads.lightrnn.callbacks`, kept so configs and checkpoints written before the move load."""

from heads.lightrnn.allocation import (  # noqa: F401
    RELATIVE_TOLERANCE,
    approximate_reallocation,
    assignment_cost,
    block_descent,
    exact_reallocation,
    greedy_by_regret,
)
from heads.lightrnn.callbacks import LightRNNReallocation  # noqa: F401
