"""DS-Softmax (Doubly Sparse softmax, Liao et al. 2019) as a package.

* :mod:`heads.ds.head`: the head, :class:`DSSoftmax`, top to bottom in one file (packed expert
  storage, routing, loss, sparse ``topk``, regularisers, pruning, mitosis);
* :mod:`heads.ds.interface`: the sparse-experts interface the callbacks and tools rely on, and
  :func:`carry_optimizer_state` for plain PyTorch optimizers after a structure change;
* :mod:`heads.ds.memory`: the head's training memory (App. B);
* :mod:`heads.ds.build`: pruned heads built directly (benchmarks, screening);
  :mod:`heads.ds.screening` screens one from a trained softmax with :mod:`heads.ds.kmeans`.

The Lightning callbacks that drive the training schedule (mitosis, pruning, balancing, routing
loss, sparsity tracking) live in :mod:`tasks.callbacks`; nothing here imports Lightning.
"""

from heads.ds.build import pruned_head, random_kept_mask
from heads.ds.head import DSSoftmax
from heads.ds.interface import ParameterRemap, SparseExperts, carry_optimizer_state
from heads.ds.screening import screen_softmax

__all__ = [
    "DSSoftmax",
    "ParameterRemap",
    "SparseExperts",
    "carry_optimizer_state",
    "pruned_head",
    "random_kept_mask",
    "screen_softmax",
]
