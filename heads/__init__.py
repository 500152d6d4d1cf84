"""Pluggable output layers on the contract in :mod:`heads.base`, usable without Lightning.

    import heads
    head = heads.MoS(in_features=256, num_classes=10_000, num_components=5)  # or heads.Mixtape, heads.DSSoftmax, heads.AdaptiveSoftmax
    loss = head(hidden, target).mean() + sum(head.regularization().values())

Importing this package registers every head under its short name (see
:func:`heads.registry.available_heads`). docs/library.md describes the contract and a plain
PyTorch training loop (examples/plain_pytorch.py); :mod:`heads.export` exports a head's
inference path with ``torch.export``.
"""

from heads.base import OutputHead
from heads.registry import available_heads, create_head, head_class, register_head
from heads.softmax import Softmax
from heads.adaptive_softmax import AdaptiveSoftmax
from heads.moc import MixtureOfContexts
from heads.mos import MixtureOfSoftmaxes
from heads.mixtape import Mixtape
from heads.sigsoftmax import SigSoftmax
from heads.ds import DSSoftmax
from heads.svd_softmax import SVDSoftmax
from heads.lightrnn import HybridLightRNN

#: Short aliases of the mixture heads' paper names.
MoS = MixtureOfSoftmaxes
MoC = MixtureOfContexts

__all__ = [
    "OutputHead",
    "Softmax",
    "AdaptiveSoftmax",
    "MixtureOfContexts",
    "MoC",
    "MixtureOfSoftmaxes",
    "MoS",
    "Mixtape",
    "SigSoftmax",
    "DSSoftmax",
    "SVDSoftmax",
    "HybridLightRNN",
    "available_heads",
    "create_head",
    "head_class",
    "register_head",
]
