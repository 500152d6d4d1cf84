"""Full softmax: the baseline output layer whose rank is bounded by its embedding size."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.base import IGNORE_INDEX, OutputHead, at_least_fp32
from heads.fused_nll import fusable, linear_nll
from heads.registry import register_head
from heads.validation import check_dropout, check_positive_int


@register_head("softmax", family="bottleneck")
class Softmax(OutputHead):
    """Linear projection to logits followed by a log-softmax.

    ``log p(x | g) = z_x - logsumexp(z)``, ``z = W h + b``, where ``h = g`` or, with
    ``embedding_dim`` different from ``in_features``, ``h = tanh(P g)`` (the latent layer AWD-LSTM-MoS puts between a
    620-unit LSTM and its 280-wide embedding, so the comparison with MoS is like for like).
    The log-probability matrix over any set of contexts has rank at most ``dim(h) + 1``:
    the softmax bottleneck (Yang et al. 2018, §2.1).

    Args:
        in_features: hidden size of the encoder output ``g``.
        num_classes: vocabulary size ``V``.
        embedding_dim: width of the class embeddings; when it differs from ``in_features`` a
            ``tanh`` latent layer projects to it (same name and meaning as in MoS, MoC, Mixtape).
        bias: learn a per-class bias ``b``.
        dropout: dropout on the latent ``h`` before the decoder.
        ignore_index: target value that contributes zero loss.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        embedding_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        super().__init__(in_features, num_classes, ignore_index)
        if embedding_dim is not None:
            check_positive_int(embedding_dim, "embedding_dim", "Softmax")
        self.dropout = check_dropout(dropout, "dropout", "Softmax")
        width = embedding_dim or in_features
        self.projection = nn.Linear(in_features, width) if width != in_features else None
        self.decoder = nn.Linear(width, num_classes, bias=bias)
        # (weight it was made from, its storage and version, its (d, V) contiguous transpose): topk's inference cache
        self._inference_cache: tuple[Tensor, tuple[int, int], Tensor] | None = None

    @property
    def output_embedding_dim(self) -> int:
        return self.decoder.in_features

    def tie_to(self, embedding: nn.Embedding) -> None:
        self._check_tie(embedding, self.decoder.in_features)
        self.decoder.weight = embedding.weight

    def latent(self, hidden: Tensor) -> Tensor:
        """The vector the class embeddings score: ``(..., in_features) -> (..., d)``."""
        if self.projection is not None:
            hidden = torch.tanh(self.projection(hidden))  # (..., d)
        return F.dropout(hidden, self.dropout, True) if self.training and self.dropout else hidden

    def logits(self, hidden: Tensor) -> Tensor:
        """Unnormalised scores ``(..., in_features) -> (..., V)``, in float32 under autocast."""
        return at_least_fp32(self.decoder(self.latent(hidden)))  # (..., V)

    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Per-token NLL.

        Shape:
            hidden ``(..., in_features)``, target ``(...)`` -> ``(...)``.
        """
        h = self.latent(hidden)
        if fusable(h, self.decoder.weight):  # one pass per row chunk, no (N, V) temporaries
            flat = h.reshape(-1, h.shape[-1])  # (N, d)
            nll = linear_nll(flat, self.decoder.weight, self.decoder.bias, target.reshape(-1), self.ignore_index)
        else:  # autocast / mixed dtypes: the plain path, logits upcast to float32
            flat = at_least_fp32(self.decoder(h)).reshape(-1, self.num_classes)  # (N, V)
            nll = F.cross_entropy(flat, target.reshape(-1), ignore_index=self.ignore_index, reduction="none")
        return nll.view(target.shape)

    def log_prob(self, hidden: Tensor) -> Tensor:
        """Shape: ``(..., in_features) -> (..., V)``."""
        return torch.log_softmax(self.logits(hidden), dim=-1)

    def topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The ``k`` most probable classes, exactly: the logits are ranked first (the normaliser is
        shared), then only the ``k`` best are normalised.

        In eval mode the logits are one ``addmv`` (one context) or ``addmm`` against a cached
        contiguous ``(d, V)`` copy of the class embeddings (:meth:`decoder_columns`): on CPU BLAS
        a product of few contexts with ``(d, V)`` columns is faster than ``F.linear``'s with the
        ``(V, d)`` rows, and those few contexts are the latency setting. ``k = 1`` takes the row
        maximum (faster than ``topk(1)``), which is also the normaliser's shift.

        Shape:
            hidden ``(..., in_features)`` -> ``(log_probs, indices)``, each ``(..., k)``.
        """
        if torch.is_grad_enabled():  # entered only when needed: a no_grad context costs about as much as the max
            with torch.no_grad():
                return self._topk(hidden, k)
        return self._topk(hidden, k)

    def _topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        h = self.latent(hidden)
        columns = self.decoder_columns(h)
        if columns is None:  # training, a tracer, autocast or another dtype: the module's own product
            logits = at_least_fp32(self.decoder(h))  # (..., V)
        else:
            bias = self.decoder.bias
            if h.dim() == 2 and h.shape[0] == 1:  # one context: a matrix-vector product, z = b + (W^T)^T h
                logits = (torch.mv(columns.t(), h[0]) if bias is None else torch.addmv(bias, columns.t(), h[0])).unsqueeze(0)  # (1, V)
            else:
                flat = h.reshape(-1, h.shape[-1])  # (N, d)
                logits = flat @ columns if bias is None else torch.addmm(bias, flat, columns)  # (N, V)
                logits = logits.view(*h.shape[:-1], self.num_classes)
        values, indices = logits.max(-1, keepdim=True) if k == 1 else logits.topk(k, dim=-1)  # (..., k)
        best = values if k == 1 else values[..., :1]  # the largest logit: logsumexp's own shift, already at hand
        log_normaliser = best + (logits - best).exp_().sum(-1, keepdim=True).log_()  # (..., 1)
        return values - log_normaliser, indices

    def decoder_columns(self, h: Tensor) -> Tensor | None:
        """The class embeddings as a contiguous ``(d, V)`` matrix (``W^T``), an inference cache for
        :meth:`topk` in eval mode; None where it is not used (training mode, ``torch.export`` /
        ``torch.compile``, autocast, half precision, latents of another dtype or device than the
        weight, weights made under ``torch.inference_mode``).

        The copy costs as much memory as the weight (:meth:`clear_inference_cache` frees it). It is
        rebuilt when the weight changes: its key is the weight object (tying to another embedding
        replaces it), its storage and its version counter, which in-place updates bump
        (``load_state_dict``, non-fused optimizers); switching to training mode, ``.to()``, and every optimizer step of a task
        (:meth:`after_optimizer_step`) drop it, since fused optimizers (``fused=True``) and writes
        through ``.data`` bump no version counter: outside a task, after such writes in eval mode,
        call :meth:`clear_inference_cache`.
        """
        weight = self.decoder.weight
        if (
            self.training or torch.compiler.is_compiling() or weight.is_inference()
            or h.dtype != weight.dtype or h.dtype not in (torch.float32, torch.float64) or h.device != weight.device
            or torch.is_autocast_enabled("cpu" if h.is_cpu else h.device.type)
        ):
            return None
        key = (weight.data_ptr(), weight._version)
        cache = self._inference_cache
        if cache is None or cache[0] is not weight or cache[1] != key:
            with torch.no_grad():
                cache = self._inference_cache = (weight, key, weight.detach().t().contiguous())  # (d, V)
        return cache[2]

    def clear_inference_cache(self) -> None:
        """Drop :meth:`decoder_columns`' copy of the weight."""
        self._inference_cache = None

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the inference cache (fused optimizers update the weight without bumping its version)."""
        self._inference_cache = None

    def train(self, mode: bool = True) -> "Softmax":
        if mode:
            self._inference_cache = None  # training updates the weight; the cache is rebuilt in eval mode
        return super().train(mode)

    def _apply(self, fn, recurse=True):
        self._inference_cache = None  # .to() / .half() make new weights
        return super()._apply(fn, recurse)
