"""The Lightning callbacks that drive a head's structural methods, one concept per file.

* DS-Softmax's training schedule, on any head with the sparse-experts interface
  (:class:`heads.ds.interface.SparseExperts`): :class:`Mitosis` (``clone_experts``),
  :class:`GroupLassoPruning` (``prune``),
  :class:`LoadBalancing` (the schedule of the balance loss), :class:`RoutingLoss` and
  :class:`SparsityTracker` (statistics); :mod:`tasks.callbacks.surgery` carries optimizer state
  over and rebuilds the DDP wrapper after a structure change;
* :class:`LightRNNReallocation`: Hybrid-LightRNN's table learning (``HybridLightRNN.reallocate``);
* character recognition: :class:`MisclassifiedImages`, :class:`PredictionWriter`;
* :class:`FreezeNetwork`: only the head trains for a number of steps (a network started from a trained run).

The CLI imports this package, so every callback resolves by its short name
(``--trainer.callbacks+=Mitosis``).
"""

from tasks.callbacks.balancing import LoadBalancing
from tasks.callbacks.hanzi import MisclassifiedImages, PredictionWriter
from tasks.callbacks.lightrnn import LightRNNReallocation
from tasks.callbacks.mitosis import Mitosis
from tasks.callbacks.pretrained import FreezeNetwork
from tasks.callbacks.pruning import GroupLassoPruning
from tasks.callbacks.routing_loss import RoutingLoss
from tasks.callbacks.sparsity import SparsityTracker

__all__ = [
    "FreezeNetwork",
    "GroupLassoPruning",
    "LightRNNReallocation",
    "LoadBalancing",
    "MisclassifiedImages",
    "Mitosis",
    "PredictionWriter",
    "RoutingLoss",
    "SparsityTracker",
]
