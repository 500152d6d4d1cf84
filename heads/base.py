"""The output-head contract every head in this package follows.

A head maps hidden states ``(..., in_features)`` to a distribution over ``num_classes``
classes. In the spirit of :class:`torch.nn.AdaptiveLogSoftmaxWithLoss`, it owns its loss
and its inference path, so a task never calls cross-entropy itself:

* ``forward(hidden, target)`` returns the per-token negative log-likelihood, zero where
  ``target == ignore_index``, computed the cheapest exact way the method allows;
* ``log_prob(hidden)`` returns normalised log-probabilities over all classes;
* ``topk(hidden, k)`` returns the ``k`` best classes (log-probabilities and indices);
* ``regularization()`` returns named auxiliary losses, already weighted, that the task sums
  into the training loss and logs one by one;
* ``stats()`` returns named scalars/tensors for logging;
* ``after_optimizer_step(optimizer)`` runs after every optimizer step (the task calls it), for
  work that must follow a weight update (DS-Softmax drops its inference cache); a no-op by default;
* ``structure()`` / ``load_structure(structure)`` save and restore what a checkpoint needs
  besides the state dict to rebuild a head whose shape changes in training; ``{}`` by default.

Sizes known only from data (``in_features`` from the encoder, ``num_classes`` from the
vocabulary) are passed by the task when it builds the head from a factory, so configs never
repeat them. Heads that rely on class ids being sorted by decreasing frequency set
``requires_frequency_order = True``; every datamodule in this project delivers vocabularies
in that order (specials first, then most frequent).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from heads.validation import check_positive_int

#: Target value a head does not score (padding, positions without a label): PyTorch's
#: ``ignore_index`` convention. Datamodules write it, tasks and heads skip it.
IGNORE_INDEX = -100


def at_least_fp32(x: Tensor) -> Tensor:
    """Upcast half-precision activations (autocast) to float32; keep float32/float64 as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class OutputHead(nn.Module):
    """Base class of all output layers.

    Args:
        in_features: size of the hidden state the head receives.
        num_classes: number of output classes (vocabulary size).
        ignore_index: target value whose positions contribute zero loss.

    Subclasses implement :meth:`log_prob` and usually a cheaper :meth:`forward`; the
    defaults here are exact but generic.
    """

    #: True when the head assumes class ids sorted by decreasing frequency.
    requires_frequency_order: ClassVar[bool] = False
    #: The constructor argument setting the head's number of components, if it has one
    #: (set by :func:`heads.registry.register_head`).
    size_argument: ClassVar[str | None] = None

    def __init__(self, in_features: int, num_classes: int, ignore_index: int = IGNORE_INDEX) -> None:
        super().__init__()
        name = type(self).__name__
        check_positive_int(in_features, "in_features", name)
        check_positive_int(num_classes, "num_classes", name, minimum=2)
        self.in_features = in_features
        self.num_classes = num_classes
        self.ignore_index = ignore_index

    # ------------------------------------------------------------------ contract
    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Per-token negative log-likelihood.

        Shape:
            hidden: ``(..., in_features)``; target: ``(...)`` integer class ids.
            Returns ``(...)`` float, zero where ``target == ignore_index``.
        """
        log_probs = self.log_prob(hidden)  # (..., V)
        return self._gather_nll(log_probs, target)

    def log_prob(self, hidden: Tensor) -> Tensor:
        """Normalised log-probabilities, shape ``(..., in_features) -> (..., num_classes)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement log_prob")

    @torch.no_grad()
    def topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The ``k`` most probable classes.

        Shape:
            hidden: ``(..., in_features)``; returns ``(log_probs, indices)``, each ``(..., k)``.
        """
        return self.log_prob(hidden).topk(k, dim=-1)

    def regularization(self) -> dict[str, Tensor]:
        """Named auxiliary losses, already weighted; the task sums and logs them."""
        return {}

    def stats(self) -> dict[str, Tensor | float]:
        """Named scalars (or tensors for histograms) describing the head's state."""
        return {}

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called by the task after every optimizer step (e.g. to drop caches of the weights); no-op here."""

    # ------------------------------------------------------------------ structure
    def structure(self) -> dict[str, Any]:
        """What a checkpoint must carry besides the state dict to rebuild this head's shape
        (DS-Softmax's experts and kept rows, Hybrid-LightRNN's table); ``{}`` for a head whose
        shape its constructor arguments fix. Plain JSON-like values."""
        return {}

    def load_structure(self, structure: dict[str, Any]) -> None:
        """Resize this head to a saved :meth:`structure` before its state dict is loaded; a head
        without a structure accepts only ``{}``."""
        if structure:
            raise ValueError(
                f"checkpoint carries a head structure but {type(self).__name__} cannot load "
                f"one (build the model with the head the checkpoint was trained with)"
            )

    # ------------------------------------------------------------------ initialisation
    @torch.no_grad()
    def init_unigram_bias(self, log_unigram: Tensor) -> bool:
        """Start the class biases at the training data's log unigram distribution.

        A head whose biases start at zero spends its first steps learning the unigram through
        every parameter it has; behind a ``tanh`` latent layer that drives the latent units into
        saturation, which blocks the gradient to the encoder, and training can sit at the unigram
        perplexity for thousands of steps (docs/lm.md). Starting at the unigram removes that
        phase. Heads whose biases live in ``self.decoder.bias`` get this for free; heads that
        keep them elsewhere override :meth:`class_bias_parameter`, heads that transform their
        logits override :meth:`unigram_bias`. Returns False when the head has no class bias to set.

        Shape:
            log_unigram ``(num_classes,)``, normalised log-probabilities.
        """
        bias = self.class_bias_parameter()
        if bias is None:
            return False
        if log_unigram.shape != (self.num_classes,):
            raise ValueError(
                f"{type(self).__name__} needs a log-unigram vector of shape ({self.num_classes},), got "
                f"{tuple(log_unigram.shape)} (the counts must come from the head's own vocabulary)"
            )
        bias.copy_(self.unigram_bias(log_unigram.to(bias)))
        return True

    def class_bias_parameter(self) -> Tensor | None:
        """The ``(num_classes,)`` class bias :meth:`init_unigram_bias` sets, if the head has one."""
        return getattr(getattr(self, "decoder", None), "bias", None)

    def unigram_bias(self, log_unigram: Tensor) -> Tensor:
        """The bias that makes the head's distribution the unigram when the context carries no signal."""
        return log_unigram

    # ------------------------------------------------------------------ tying
    @property
    def output_embedding_dim(self) -> int | None:
        """Width of the class-embedding matrix, if the head has one that can be tied."""
        return None

    def tie_to(self, embedding: nn.Embedding) -> None:
        """Share the class-embedding matrix with an input embedding (Press & Wolf 2017)."""
        raise ValueError(
            f"{type(self).__name__} has no class-embedding matrix to tie "
            f"(set model.init_args.tie_weights: false)"
        )

    # ------------------------------------------------------------------ helpers
    def _gather_nll(self, log_probs: Tensor, target: Tensor) -> Tensor:
        """NLL at ``target`` from full log-probabilities, zero at ignored positions."""
        valid = target != self.ignore_index
        safe_target = target.masked_fill(~valid, 0)
        nll = -log_probs.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
        return nll.masked_fill(~valid, 0.0)

    def _check_tie(self, embedding: nn.Embedding, width: int) -> None:
        if embedding.num_embeddings != self.num_classes or embedding.embedding_dim != width:
            raise ValueError(
                f"{type(self).__name__} cannot tie a {embedding.num_embeddings}x"
                f"{embedding.embedding_dim} input embedding to its {self.num_classes}x{width} "
                f"class embeddings: sizes must match (make the embedding size {width} or set "
                f"model.init_args.tie_weights: false)"
            )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}"
