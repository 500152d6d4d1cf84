"""Old path of the DS-Softmax callbacks (now in heads.ds), kept so configs and checkpoints written before the move load."""

from heads.ds.accumulator import sparse_experts  # noqa: F401
from heads.ds.balancing import LoadBalancing  # noqa: F401
from heads.ds.mitosis import Mitosis  # noqa: F401
from heads.ds.pruning import REFIT_MODES, GroupLassoPruning  # noqa: F401
from heads.ds.routing_loss import RoutingLoss  # noqa: F401
from heads.ds.sparsity import SparsityTracker, class_names  # noqa: F401
from heads.ds.surgery import apply_structure_change, optimizer_bytes  # noqa: F401
