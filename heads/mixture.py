"""The parameterisation shared by MoC, MoS and mixtures of SigSoftmaxes.

Those heads share one parameterisation (Yang et al., ICLR 2018, §2.4-2.5): a softmax prior
over ``K`` components and ``K`` context vectors from one stacked latent layer, scored by one
decoder (the tieable class embeddings):

    pi_k = softmax_k(w_pi . g),    h_k = tanh(W_k g),    z_k = W h_k + b.

:class:`MixtureHead` holds those parameters (``prior``, ``latent``, ``decoder``), their
validation, tying and the prior statistics; the heads say how the components combine (in
probability space for MoS, in context space for MoC). The chunked NLL they train with is
:mod:`heads.mixture_kernel`.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.base import IGNORE_INDEX, OutputHead, at_least_fp32
from heads.mixture_kernel import auto_chunk_rows, mixture_nll, prior_stats  # noqa: F401  (mixture_nll: public here too)
from heads.validation import check_dropout, check_positive_int


class MixtureHead(OutputHead):
    """Base of the heads with a softmax prior over ``K`` tanh context vectors and one decoder.

    Args:
        in_features: hidden size of the encoder output ``g``.
        num_classes: vocabulary size ``V``.
        num_components: number of components ``K``.
        embedding_dim: width ``d`` of the context vectors and of the (tieable) class
            embeddings; ``in_features`` when unset.
        dropout: dropout on the context vectors ``h_k``.
        bias: learn a per-class bias ``b``.
        ignore_index: target value that contributes zero loss.
        chunk_size: rows of ``(token, component)`` pairs per chunk of the normaliser; by
            default about :data:`heads.fused_nll.CHUNK_BYTES` of fp32 logits per chunk.
        use_prior: build the prior ``w_pi`` (a single component needs none).
        use_latent: build the latent layer ``W_k`` (without it the context is ``g`` itself).
        variational_dropout: one dropout mask per sequence, shared over its time steps
            (variational dropout, Gal & Ghahramani 2016; the MoS paper's "context vector
            V-dropout", its Table 8), instead of a fresh mask per token. A sequence is a row of
            the first dimension of ``hidden`` ``(B, T, ...)``; a 2-D ``hidden`` is one token per
            row, so it gets per-token dropout either way.

    Subclasses set :attr:`sigmoid_weighting` (and override :meth:`component_scores`) when a
    component's unnormalised weight is ``exp(z) sigmoid(z)`` rather than ``exp(z)``.
    """

    #: Whether component weights are ``exp(z) sigmoid(z)`` (SigSoftmax) instead of ``exp(z)``.
    sigmoid_weighting: ClassVar[bool] = False

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        num_components: int,
        embedding_dim: int | None,
        dropout: float,
        bias: bool,
        ignore_index: int = IGNORE_INDEX,
        chunk_size: int | None = None,
        use_prior: bool = True,
        use_latent: bool = True,
        variational_dropout: bool = False,
    ) -> None:
        super().__init__(in_features, num_classes, ignore_index)
        name = type(self).__name__
        self.num_components = check_positive_int(num_components, "num_components", name)
        self.embedding_dim = check_positive_int(embedding_dim or in_features, "embedding_dim", name)
        if chunk_size is not None:
            check_positive_int(chunk_size, "chunk_size", name)
        self.chunk_size = chunk_size
        self.dropout = check_dropout(dropout, "dropout", name)
        if not isinstance(variational_dropout, bool):
            raise ValueError(
                f"{name} needs variational_dropout to be true or false, got {variational_dropout!r} "
                f"(set head.init_args.variational_dropout)"
            )
        self.variational_dropout = variational_dropout
        K, d = self.num_components, self.embedding_dim
        self.prior = nn.Linear(in_features, K, bias=False) if use_prior else None  # w_pi
        self.latent = nn.Linear(in_features, K * d) if use_latent else None  # W_k stacked: h_k = tanh(W_k g)
        self.decoder = nn.Linear(d, num_classes, bias=bias)  # class embeddings w_x and bias b_x
        self._last_prior_entropy: Tensor | None = None
        self._last_component_usage: Tensor | None = None

    # ------------------------------------------------------------------ tying
    @property
    def output_embedding_dim(self) -> int:
        return self.embedding_dim

    def tie_to(self, embedding: nn.Embedding) -> None:
        self._check_tie(embedding, self.embedding_dim)
        self.decoder.weight = embedding.weight

    # ------------------------------------------------------------------ pieces
    def log_prior(self, g: Tensor) -> Tensor:
        """Mixture prior ``log pi`` (float32); records the prior statistics in training.

        Shape: ``(N, in_features) -> (N, K)``.
        """
        if self.prior is None:
            return at_least_fp32(g.new_zeros(g.shape[0], 1))
        log_prior = torch.log_softmax(at_least_fp32(self.prior(g)), dim=-1)  # (N, K)
        if self.training:
            self._last_prior_entropy, self._last_component_usage = prior_stats(log_prior.detach())
        return log_prior

    def context_mask(self, hidden: Tensor) -> Tensor | None:
        """The variational dropout mask of a batch, one per sequence repeated over its time steps
        (scaled by ``1 / (1 - p)``), or None when per-token dropout (or none) applies.

        Shape: hidden ``(B, T, ..., in_features)`` -> ``(B T ..., K', d)`` (``K' = 1`` without a
        latent layer), rows in ``hidden.reshape(-1, in_features)`` order.
        """
        if not (self.variational_dropout and self.training and self.dropout > 0 and hidden.dim() >= 3):
            return None
        width = self.num_components if self.latent is not None else 1
        d = self.embedding_dim if self.latent is not None else self.in_features
        keep = hidden.new_empty(hidden.shape[0], 1, width, d).bernoulli_(1.0 - self.dropout) / (1.0 - self.dropout)
        steps = hidden[0, ..., 0].numel()  # time steps (and any further positions) per sequence
        return keep.expand(-1, steps, -1, -1).reshape(-1, width, d)  # (B T, K', d)

    def contexts(self, g: Tensor, mask: Tensor | None = None) -> Tensor:
        """Context vectors ``h_k = tanh(W_k g)`` after dropout (``g`` itself without a latent layer):
        ``mask`` (from :meth:`context_mask`, rows matching ``g``) if given, else per-token dropout.

        Shape: ``(N, in_features) -> (N, K, d)``.
        """
        if self.latent is None:
            h = g.unsqueeze(1)  # (N, 1, d)
        else:
            h = torch.tanh(self.latent(g)).view(g.shape[0], self.num_components, self.embedding_dim)  # (N, K, d)
        if mask is not None:
            return h * mask.to(h.dtype)
        return F.dropout(h, self.dropout, self.training)

    def component_scores(self, logits: Tensor) -> Tensor:
        """Log of a component's unnormalised class weights from its logits (``z`` for a softmax)."""
        return logits

    def chunk_tokens(self) -> int:
        """Tokens per chunk of the mixture's normaliser (``K`` rows each)."""
        return max(1, auto_chunk_rows(self.num_classes, self.chunk_size) // self.num_components)

    # ------------------------------------------------------------------ probability-space mixture
    def mixture_forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Per-token NLL of the mixture of the components' (sig)softmaxes, without any
        ``(N, K, V)`` tensor (:func:`mixture_nll`).

        Shape:
            hidden ``(..., in_features)``, target ``(...)`` -> ``(...)`` float32, zero at
            ``ignore_index``.
        """
        flat_target = target.reshape(-1)  # (N,)
        valid = flat_target != self.ignore_index
        if torch.compiler.is_compiling():
            # torch.compile: no boolean indexing (a data-dependent shape is a graph break). Every row
            # is scored; ignored ones carry target -1, which the kernel gives zero NLL and no gradient.
            g = hidden.reshape(-1, self.in_features)  # (N, in)
            log_prior, contexts = self.log_prior(g), self.contexts(g, self.context_mask(hidden))  # (N, K), (N, K, d)
            return mixture_nll(
                log_prior, contexts, self.decoder.weight, self.decoder.bias, torch.where(valid, flat_target, -1),
                self.chunk_tokens(), sigmoid_weighting=self.sigmoid_weighting,
            ).view(target.shape)
        g = hidden.reshape(-1, self.in_features)[valid]  # (n, in) -- ignored rows cost nothing
        x = flat_target[valid]  # (n,)
        mask = self.context_mask(hidden)  # (N, K, d) or None
        log_prior, contexts = self.log_prior(g), self.contexts(g, None if mask is None else mask[valid])  # (n, K), (n, K, d)
        token_nll = mixture_nll(
            log_prior, contexts, self.decoder.weight, self.decoder.bias, x, self.chunk_tokens(),
            sigmoid_weighting=self.sigmoid_weighting,
        )  # (n,)
        nll = hidden.new_zeros(flat_target.shape, dtype=token_nll.dtype)
        nll[valid] = token_nll
        return nll.view(target.shape)

    def mixture_log_prob(self, hidden: Tensor) -> Tensor:
        """Full log-probabilities of the mixture, in token chunks so at most one chunk's
        ``(c, K, V)`` block exists at a time.

        Shape:
            ``(..., in_features) -> (..., V)`` float32.
        """
        g = hidden.reshape(-1, self.in_features)  # (N, in)
        log_prior, contexts = self.log_prior(g), self.contexts(g, self.context_mask(hidden))  # (N, K), (N, K, d)
        rows = self.chunk_tokens()
        # a program traced for any batch size (torch.export, heads/export.py) cannot loop over its
        # chunks: it computes the (N, K, V) block at once
        starts = [0] if torch.compiler.is_compiling() else range(0, g.shape[0], rows)
        rows = g.shape[0] if torch.compiler.is_compiling() else rows
        pieces = []
        for start in starts:
            scores = self.component_scores(at_least_fp32(self.decoder(contexts[start : start + rows])))  # (c, K, V)
            component_log_p = torch.log_softmax(scores, dim=-1)  # (c, K, V)
            pieces.append(torch.logsumexp(log_prior[start : start + rows, :, None] + component_log_p, dim=1))
        out = torch.cat(pieces) if pieces else g.new_zeros(0, self.num_classes, dtype=log_prior.dtype)
        return out.view(*hidden.shape[:-1], self.num_classes)

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict[str, Tensor | float]:
        """Prior entropy (nats, mean over the last training batch) and per-component usage
        (mean prior, a ``(K,)`` tensor, logged as a histogram) plus its minimum, which flags
        dead components."""
        if self._last_prior_entropy is None:
            return {}
        usage = self._last_component_usage
        return {
            "prior_entropy": self._last_prior_entropy,
            "prior_entropy_max": math.log(self.num_components),
            "component_usage": usage,
            "component_usage_min": usage.min(),
        }

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, num_classes={self.num_classes}, "
            f"num_components={self.num_components}, embedding_dim={self.embedding_dim}"
        )
