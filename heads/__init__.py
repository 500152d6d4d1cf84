"""Pluggable output layers on the contract in :mod:`heads.base`.

Importing this package registers every head under its short name (see
:func:`heads.registry.available_heads`).
"""

from heads.base import OutputHead
from heads.registry import available_heads, create_head, head_class, register_head
from heads.softmax import Softmax

__all__ = [
    "OutputHead",
    "Softmax",
    "available_heads",
    "create_head",
    "head_class",
    "register_head",
]
