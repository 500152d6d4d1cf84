"""DS-Softmax (Doubly Sparse softmax, Liao et al. 2019) as a package.

* :mod:`heads.ds.head`: the head, :class:`DSSoftmax` (routing, loss, regularisers), built from
  :mod:`heads.ds.storage` (the packed expert rows), :mod:`heads.ds.structure` (pruning, mitosis,
  rewind of the rows) and :mod:`heads.ds.inference` (sparse ``topk``);
* :mod:`heads.ds.interface`: the sparse-experts interface the callbacks and tools rely on;
* :mod:`heads.ds.surgery`: optimizer and DDP surgery after a structure change;
* :mod:`heads.ds.build`: pruned heads built directly (benchmarks, screening);
  :mod:`heads.ds.screening` screens one from a trained softmax with :mod:`heads.ds.kmeans`;
* the training schedule, one callback per module: :class:`Mitosis`, :class:`GroupLassoPruning`,
  :class:`LoadBalancing`, :class:`RoutingLoss`, :class:`SparsityTracker`.

Hyper-parameters have one home each: the head holds ``num_experts`` (where :class:`Mitosis`
starts), ``load_balance_weight`` (what :class:`LoadBalancing` schedules) and
``routing_loss_weight`` (what :class:`RoutingLoss` switches on); the callbacks hold their
schedules.
"""

from heads.ds.balancing import LoadBalancing
from heads.ds.build import pruned_head, random_kept_mask
from heads.ds.head import DSSoftmax
from heads.ds.interface import ParameterRemap, SparseExperts
from heads.ds.mitosis import Mitosis
from heads.ds.pruning import GroupLassoPruning
from heads.ds.routing_loss import RoutingLoss
from heads.ds.screening import screen_softmax
from heads.ds.sparsity import SparsityTracker

__all__ = [
    "DSSoftmax",
    "GroupLassoPruning",
    "LoadBalancing",
    "Mitosis",
    "ParameterRemap",
    "RoutingLoss",
    "SparseExperts",
    "SparsityTracker",
    "pruned_head",
    "random_kept_mask",
    "screen_softmax",
]
