"""Hybrid-LightRNN: an output layer over a small code dictionary (seed 002; LightRNN, Li et al. 2016).

* :mod:`heads.lightrnn.codes` -- the word <-> code-sequence table (:class:`HybridLightRNNCodebook`);
* :mod:`heads.lightrnn.head` -- the output-only head (:class:`HybridLightRNN`), any registered head run over
  the codes while the network reads words;
* :mod:`heads.lightrnn.code_lm` -- the language model over code sequences of seed 002's Eq. 4
  (:class:`HybridLightRNNCodes`): the network reads codes, one code dictionary;
* :mod:`heads.lightrnn.allocation` -- the Eq. 6 reallocation costs and the matchings that minimise them;
* the Lightning callback that alternates training and reallocation is ``tasks.callbacks.LightRNNReallocation``.
"""

from heads.lightrnn.codes import HybridLightRNNCodebook
from heads.lightrnn.head import HybridLightRNN
from heads.lightrnn.code_lm import HybridLightRNNCodes

__all__ = ["HybridLightRNN", "HybridLightRNNCodebook", "HybridLightRNNCodes"]
