"""Plain transcriptions of each head's equations, for equivalence tests and benchmarks.

Each function reads the parameters of a head instance and computes log-probabilities the
straightforward way the paper writes them, with no memory or speed tricks: full ``(N, K, V)``
tensors, probabilities instead of log-probabilities, dense per-token gates. The tests check
every fast path against these (float64, <= 1e-6 relative) and ``python -m app bench heads``
times them as the baseline the fast paths must beat. Dropout and noise are not applied:
call them on heads in eval mode (or with those set to zero).
"""

from __future__ import annotations

import torch
from torch import Tensor

from heads.adaptive_softmax import AdaptiveSoftmax
from heads.base import IGNORE_INDEX
from heads.mixtape import Mixtape
from heads.moc import MixtureOfContexts
from heads.mos import MixtureOfSoftmaxes
from heads.sigsoftmax import SigSoftmax
from heads.softmax import Softmax


def _flat(head, hidden: Tensor) -> Tensor:
    return hidden.reshape(-1, head.in_features)  # (N, in)


def _out(head, hidden: Tensor, log_probs: Tensor) -> Tensor:
    return log_probs.view(*hidden.shape[:-1], head.num_classes)  # (..., V)


def nll_from_log_prob(log_probs: Tensor, target: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Per-token NLL from full log-probabilities ``(..., V)`` and targets ``(...)``; 0 at ignored."""
    valid = target != ignore_index
    picked = log_probs.gather(-1, target.masked_fill(~valid, 0).unsqueeze(-1)).squeeze(-1)
    return (-picked).masked_fill(~valid, 0.0)


def softmax_log_prob(head: Softmax, hidden: Tensor) -> Tensor:
    """``log softmax(W h + b)``, ``h = g`` or ``tanh(P g)``."""
    g = _flat(head, hidden)
    h = torch.tanh(head.projection(g)) if head.projection is not None else g
    return _out(head, hidden, torch.log_softmax(head.decoder(h), dim=-1))


def adaptive_softmax_log_prob(head: AdaptiveSoftmax, hidden: Tensor) -> Tensor:
    """Grave et al. 2017, in probability space: a shortlist class has its head-softmax probability;
    a class ``x`` of tail cluster ``c`` has ``p(c | h) p(x | c, h)``, the cluster token's head
    probability times a softmax over the cluster through its ``d -> d // div_value**c`` projection."""
    g = _flat(head, hidden)
    h = torch.tanh(head.projection(g)) if head.projection is not None else g  # (N, d)
    adaptive = head.adaptive
    head_logits = h @ adaptive.head.weight.t()  # (N, shortlist + C)
    if adaptive.head.bias is not None:
        head_logits = head_logits + adaptive.head.bias
    head_probs = torch.softmax(head_logits, dim=-1)
    shortlist = adaptive.shortlist_size
    probs = [head_probs[:, :shortlist]]
    for c, (down, up) in enumerate(adaptive.tail):
        within = torch.softmax(h @ down.weight.t() @ up.weight.t(), dim=-1)  # (N, |cluster c|)
        probs.append(head_probs[:, shortlist + c].unsqueeze(1) * within)
    return _out(head, hidden, torch.log(torch.cat(probs, dim=1)))


def moc_log_prob(head: MixtureOfContexts, hidden: Tensor) -> Tensor:
    """MoS paper §2.5: ``h = sum_k pi_k tanh(W_k g)``, one softmax."""
    g = _flat(head, hidden)
    N, K, d = g.shape[0], head.num_components, head.embedding_dim
    prior = torch.softmax(head.prior(g), dim=-1)  # (N, K)
    contexts = torch.tanh(head.latent(g)).view(N, K, d)  # (N, K, d)
    mixed = (prior.unsqueeze(-1) * contexts).sum(1)  # (N, d)
    return _out(head, hidden, torch.log_softmax(head.decoder(mixed), dim=-1))


def mos_log_prob(head: MixtureOfSoftmaxes, hidden: Tensor, eps: float = 0.0) -> Tensor:
    """MoS paper §2.4 in probability space, as the public AWD-LSTM-MoS code computes it:
    ``log(sum_k pi_k softmax(h_k W + b) + eps)`` (that code uses ``eps = 1e-8``)."""
    g = _flat(head, hidden)
    N, K, d = g.shape[0], head.num_components, head.embedding_dim
    prior = torch.softmax(head.prior(g), dim=-1)  # (N, K)
    contexts = torch.tanh(head.latent(g)).view(N, K, d)  # (N, K, d)
    probs = torch.softmax(head.decoder(contexts), dim=-1)  # (N, K, V)
    mixture = (prior.unsqueeze(-1) * probs).sum(1)  # (N, V)
    return _out(head, hidden, torch.log(mixture + eps))


def sigsoftmax_log_prob(head: SigSoftmax, hidden: Tensor) -> Tensor:
    """Kanai et al. 2018: ``p = exp(z) sigmoid(z) / sum exp(z) sigmoid(z)``, mixed over
    components in probability space when ``K > 1``. Overflows for huge logits by design
    (it is the literal formula)."""
    g = _flat(head, hidden)
    N, K, d = g.shape[0], head.num_components, head.embedding_dim
    if head.latent is None:
        contexts = g.unsqueeze(1)  # (N, 1, d)
    else:
        contexts = torch.tanh(head.latent(g)).view(N, K, d)  # (N, K, d)
    logits = head.decoder(contexts)  # (N, K, V)
    weights = torch.exp(logits) * torch.sigmoid(logits)
    probs = weights / weights.sum(-1, keepdim=True)  # (N, K, V)
    prior = torch.softmax(head.prior(g), dim=-1) if head.prior is not None else g.new_ones(N, 1)
    return _out(head, hidden, torch.log((prior.unsqueeze(-1) * probs).sum(1)))


def sigmoid_tree_products(gate_logits: Tensor) -> Tensor:
    """Eq. 3 written leaf by leaf: ``pi_k = prod over the path of gamma or (1 - gamma)``.

    Shape: ``(..., K - 1) -> (..., K)``; nodes in heap order (children of ``j`` are ``2j+1``, ``2j+2``).
    """
    num_gates = gate_logits.shape[-1] + 1
    depth = num_gates.bit_length() - 1
    gamma = torch.sigmoid(gate_logits)
    priors = []
    for leaf in range(num_gates):
        node, value = 0, torch.ones_like(gate_logits[..., 0])
        for level in reversed(range(depth)):
            go_right = (leaf >> level) & 1
            value = value * (1 - gamma[..., node] if go_right else gamma[..., node])
            node = 2 * node + 1 + go_right
        priors.append(value)
    return torch.stack(priors, dim=-1)


def mixtape_log_prob(head: Mixtape, hidden: Tensor) -> Tensor:
    """Mixtape (Yang et al. 2019, Eqs. 1-6) with dense per-token gates: every token gets its
    own ``(K - 1)`` gate logits and ``K`` priors; shared-gate tokens simply have ``v_x = 0``
    and ``b_{x,k} = 0`` (Eq. 6), and the logits are ``sum_k pi_{x,k} h_k . w_x`` for all ``x``."""
    g = _flat(head, hidden)
    N, K, d, d2 = g.shape[0], head.num_gates, head.embedding_dim, head.gate_dim
    V, S = head.num_classes, head.num_frequent
    contexts = torch.tanh(head.context(g)).view(N, K, d)  # (N, K, d)
    gate_hidden = torch.tanh(g @ head.gate_projection_weight().t() + head.gate_projection.bias).view(N, K - 1, d2)  # (N, K-1, d2)
    v = torch.cat([head.gate_embedding, head.gate_embedding.new_zeros(V - S, d2)])  # (V, d2)
    b = torch.cat([head.gate_bias, head.gate_bias.new_zeros(V - S, K - 1)])  # (V, K-1)
    gate_logits = (
        torch.einsum("vc,njc->nvj", v, gate_hidden) + head.shared_gate(g).unsqueeze(1) + b.unsqueeze(0)
    )  # (N, V, K-1)
    prior = sigmoid_tree_products(gate_logits)  # (N, V, K)
    component_logits = torch.einsum("nkd,vd->nvk", contexts, head.decoder.weight)  # (N, V, K)
    logits = (prior * component_logits).sum(-1)  # (N, V)
    if head.decoder.bias is not None:
        logits = logits + head.decoder.bias
    return _out(head, hidden, torch.log_softmax(logits, dim=-1))


#: The reference for each registered short name.
REFERENCES = {
    "softmax": softmax_log_prob,
    "adaptive_softmax": adaptive_softmax_log_prob,
    "moc": moc_log_prob,
    "mos": mos_log_prob,
    "mixtape": mixtape_log_prob,
    "sigsoftmax": sigsoftmax_log_prob,
}
