"""Pluggable output layers on the contract in :mod:`heads.base`.

Importing this package registers every head under its short name (see
:func:`heads.registry.available_heads`).
"""

from heads.base import OutputHead
from heads.registry import available_heads, create_head, head_class, register_head
from heads.softmax import Softmax
from heads.moc import MixtureOfContexts
from heads.mos import MixtureOfSoftmaxes
from heads.mixtape import Mixtape
from heads.sigsoftmax import SigSoftmax
from heads.ds import DSSoftmax
from heads.svd_softmax import SVDSoftmax
from heads.lightrnn import HybridLightRNN

__all__ = [
    "OutputHead",
    "Softmax",
    "MixtureOfContexts",
    "MixtureOfSoftmaxes",
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
