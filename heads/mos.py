"""Mixture of Softmaxes (Yang, Dai, Salakhutdinov & Cohen, ICLR 2018, "Breaking the Softmax
Bottleneck: A High-Rank RNN Language Model", §2.4).

The log-probability matrix of a softmax over ``d``-wide contexts has rank at most ``d + 1``
(§2.1). MoS mixes ``K`` softmaxes in probability space, which makes ``log p`` a non-linear
(log-sum-exp) function of the contexts and lifts that bound:

    pi_k   = softmax_k(w_pi . g)                            (prior, Eq. in §2.4)
    h_k    = tanh(W_k g)                                    (K context vectors, width d)
    log p(x | g) = logsumexp_k( log pi_k + h_k . w_x + b_x - logsumexp_v(h_k . w_v + b_v) )

Everything is computed in log space: there is no ``log(p + eps)`` anywhere. Training never
materialises an ``(N, K, V)`` tensor: the NLL and its gradients come from the chunked kernel
:func:`heads.mixture_kernel.mixture_nll`, which holds one ``(chunk, V)`` block at a time.
"""

from __future__ import annotations

from torch import Tensor

from heads.base import IGNORE_INDEX
from heads.mixture import MixtureHead
from heads.registry import register_head


@register_head("mos", size_argument="num_components", family="bottleneck", bench_size=15)
class MixtureOfSoftmaxes(MixtureHead):
    """Mixture of Softmaxes output layer (Yang et al. 2018, §2.4).

    Args:
        in_features: hidden size of the encoder output ``g``.
        num_classes: vocabulary size ``V``.
        num_components: number of mixture components ``K`` (the paper uses 15 on PTB).
        embedding_dim: width ``d`` of each context vector and of the (tieable) class
            embeddings; defaults to ``in_features``.
        dropout: dropout on the context vectors ``h_k`` (the paper's "context vector V-dropout",
            0.30 on PTB and WT2 in its Table 8; none on 1B Word, its Table 10).
        variational_dropout: one dropout mask per sequence shared over its time steps, as the
            paper's V-dropout (Table 8); off: a fresh mask per token.
        bias: learn a per-class bias ``b``.
        chunk_size: rows of ``(token, component)`` pairs per chunk of the normaliser; by
            default about 8 MiB of fp32 logits per chunk (small enough to stay in cache between the passes over it).
        ignore_index: target value that contributes zero loss.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        num_components: int = 15,
        embedding_dim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        chunk_size: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        variational_dropout: bool = False,
    ) -> None:
        super().__init__(
            in_features, num_classes, num_components, embedding_dim, dropout, bias, ignore_index, chunk_size=chunk_size,
            variational_dropout=variational_dropout,
        )

    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Per-token NLL without materialising any ``(N, K, V)`` tensor.

        Shape:
            hidden ``(..., in_features)``, target ``(...)`` -> ``(...)`` float32, zero at
            ``ignore_index``.
        """
        return self.mixture_forward(hidden, target)

    def log_prob(self, hidden: Tensor) -> Tensor:
        """Full log-probabilities, computed in token chunks so at most one chunk's
        ``(c, K, V)`` block exists at a time.

        Shape:
            ``(..., in_features) -> (..., V)`` float32.
        """
        return self.mixture_log_prob(hidden)
