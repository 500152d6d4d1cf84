"""SigSoftmax (Kanai, Fujiwara, Yamanaka & Adachi, NeurIPS 2018, "Sigsoftmax: Reanalysis of the
Softmax Bottleneck"; the Mixtape paper cites it (§3, ref. [9]) as another way to break the bottleneck,
which it calls less efficient than MoS because it computes sigmoids in addition to softmaxes).

SigSoftmax replaces ``exp(z)`` by ``exp(z) * sigmoid(z)`` (the definition of sigsoftmax in Kanai et al.):

    p(x | g) = exp(z_x) sigmoid(z_x) / sum_v exp(z_v) sigmoid(z_v)
             = softmax(z + log sigmoid(z))_x,

so the log-probability is a non-linear function of the logits and is not confined to the
``d + 1`` rank bound of the softmax. It is computed as ``log_softmax(z + logsigmoid(z))``,
which never overflows. With ``num_components > 1`` it becomes a mixture of SigSoftmaxes
(Kanai et al.'s paper is not among the project's paper copies, so its mixture setting is not
checked here), sharing the memory-lean normaliser of :mod:`heads.mixture`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from heads.base import IGNORE_INDEX, at_least_fp32
from heads.mixture import MixtureHead
from heads.registry import register_head
from heads.validation import check_positive_int


def sigsoftmax_scores(logits: Tensor) -> Tensor:
    """``z + log sigmoid(z)``: the log of SigSoftmax's unnormalised weight ``exp(z) sigmoid(z)``."""
    return logits + F.logsigmoid(logits)


@register_head("sigsoftmax", family="bottleneck")
class SigSoftmax(MixtureHead):
    """SigSoftmax output layer, optionally a mixture of SigSoftmaxes.

    Args:
        in_features: hidden size of the encoder output ``g``.
        num_classes: vocabulary size ``V``.
        num_components: ``K``; 1 is plain SigSoftmax, more is a mixture with a softmax prior
            and ``K`` context vectors ``tanh(W_k g)`` as in MoS.
        embedding_dim: width ``d`` of the context vector(s). With ``K = 1`` and no value the
            logits are a linear map of ``g`` itself; with a value (or ``K > 1``) a ``tanh``
            latent layer of that width comes first (``in_features`` if unset).
        dropout: dropout on the context vector(s).
        bias: learn a per-class bias.
        chunk_size: rows per chunk of the mixture's normaliser (see :mod:`heads.mixture`).
        ignore_index: target value that contributes zero loss.
    """

    sigmoid_weighting = True

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        num_components: int = 1,
        embedding_dim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        chunk_size: int | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        if embedding_dim is not None:  # 0 is refused here, not read as "unset"
            check_positive_int(embedding_dim, "embedding_dim", type(self).__name__)
        multi = isinstance(num_components, int) and num_components > 1
        super().__init__(
            in_features, num_classes, num_components, embedding_dim, dropout, bias, ignore_index,
            chunk_size=chunk_size, use_prior=multi, use_latent=multi or embedding_dim is not None,
        )

    def component_scores(self, logits: Tensor) -> Tensor:
        return sigsoftmax_scores(logits)

    def unigram_bias(self, log_unigram: Tensor) -> Tensor:
        """``b`` with ``b + log sigmoid(b) = log u + C``: SigSoftmax scores ``exp(b) sigmoid(b)``, not ``exp(b)``.

        With ``a = e^b`` the condition is ``a^2 / (a + 1) = e^y`` (``y = log u - max log u``), so
        ``a = (e^y + sqrt(e^{2y} + 4 e^y)) / 2``.
        """
        y = (log_unigram - log_unigram.max()).double().exp()
        return torch.log((y + torch.sqrt(y * y + 4 * y)) / 2).to(log_unigram.dtype)

    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Per-token NLL.

        Shape:
            hidden ``(..., in_features)``, target ``(...)`` -> ``(...)``, zero at ``ignore_index``.
        """
        if self.num_components == 1:
            scores = sigsoftmax_scores(at_least_fp32(self.decoder(self.contexts(hidden.reshape(-1, self.in_features))[:, 0])))
            nll = F.cross_entropy(scores, target.reshape(-1), ignore_index=self.ignore_index, reduction="none")
            return nll.view(target.shape)
        return self.mixture_forward(hidden, target)  # the same lean normaliser as MoS, SigSoftmax weighting inside

    def log_prob(self, hidden: Tensor) -> Tensor:
        """Shape: ``(..., in_features) -> (..., V)`` float32 (token-chunked for mixtures)."""
        return self.mixture_log_prob(hidden)
