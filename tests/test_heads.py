"""Adaptive softmax, MoC, MoS, Mixtape and SigSoftmax: fast paths equal the papers' equations, defining
properties hold (rank, MoS K=1 = softmax, sigmoid tree, gate sharing), numerics are stable,
bad input is refused, and the head configs build."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from app.analyze.rank import empirical_rank
from heads import Mixtape, MixtureOfContexts, MixtureOfSoftmaxes, SigSoftmax, head_class
from heads.mixtape import sigmoid_tree, tree_mix
from heads.mixture import mixture_nll
from heads.reference import REFERENCES, nll_from_log_prob, sigmoid_tree_products

ROOT = Path(__file__).resolve().parent.parent
IN, V = 16, 50

# (short name, init args): small chunk sizes make the chunked paths take several chunks.
CASES = [
    ("softmax", {"embedding_dim": 6}),
    ("adaptive_softmax", {}),
    ("adaptive_softmax", {"cutoffs": [5, 20, 30], "div_value": 2.0, "head_bias": True, "embedding_dim": 8}),
    ("moc", {"num_components": 3, "embedding_dim": 6}),
    ("mos", {"num_components": 3, "embedding_dim": 6, "chunk_size": 7}),
    ("mos", {"num_components": 1}),
    ("mixtape", {"num_gates": 4, "embedding_dim": 6, "gate_dim": 5, "frequent_fraction": 0.1}),
    ("mixtape", {"num_gates": 8, "gate_dim": 3, "frequent_fraction": 0.5, "weight_norm_scale": 2.0}),
    ("mixtape", {"num_gates": 2, "frequent_fraction": 1.0}),
    ("sigsoftmax", {}),
    ("sigsoftmax", {"embedding_dim": 6}),
    ("sigsoftmax", {"num_components": 3, "embedding_dim": 6, "chunk_size": 5}),
]
IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'default'}" for name, kw in CASES]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: extra intra-op threads only add synchronisation (badly so on a
    loaded machine), so run this module single-threaded and restore the setting after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def build(name: str, **kwargs) -> torch.nn.Module:
    """A float64 head in eval mode with non-zero biases (so bias paths are exercised)."""
    torch.manual_seed(0)
    head = head_class(name)(IN, V, **kwargs).double().eval()
    with torch.no_grad():
        for pname, p in head.named_parameters():
            if "bias" in pname:
                p.normal_(0.0, 0.5)
    return head


def inputs(shape=(3, 5)):
    hidden = torch.randn(*shape, IN, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, V, shape)
    target[0, 0] = -100  # an ignored position
    return hidden, target


def assert_close(actual, expected, what, rtol=1e-6, atol=1e-10):
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert torch.allclose(actual, expected, rtol=rtol, atol=atol), f"{what}: max |diff| = {err:.3g}"


# ---------------------------------------------------------------------- reference equivalence
@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=IDS)
def test_fast_path_equals_reference_equations_in_float64(name, kwargs):
    """log_prob, the NLL and every gradient equal the direct transcription in heads.reference."""
    head = build(name, **kwargs)
    hidden, target = inputs()
    reference_log_probs = REFERENCES[name](head, hidden)
    assert_close(head.log_prob(hidden), reference_log_probs, f"{name} log_prob")
    nll = head(hidden, target)
    reference_nll = nll_from_log_prob(reference_log_probs, target)
    assert_close(nll, reference_nll, f"{name} nll")
    assert nll[0, 0] == 0.0
    # A uniform upstream gradient (mean loss) and a non-uniform one take different paths in MoS.
    params = [hidden, *head.parameters()]
    for weights in (torch.ones_like(nll), torch.rand_like(nll)):
        fast = torch.autograd.grad((nll * weights).sum(), params, retain_graph=True)
        ref = torch.autograd.grad((reference_nll * weights).sum(), params, retain_graph=True)
        for (pname, _), a, b in zip([("hidden", None), *head.named_parameters()], fast, ref):
            assert_close(a, b, f"{name} gradient of {pname}")


@pytest.mark.parametrize("sigmoid_weighting", [False, True])
def test_mixture_nll_gradcheck(sigmoid_weighting):
    """The custom autograd function of MoS/SigSoftmax mixtures passes gradcheck (several chunks)."""
    torch.manual_seed(0)
    n, K, d, classes = 5, 3, 4, 11
    log_prior = torch.log_softmax(torch.randn(n, K, dtype=torch.float64), -1).requires_grad_()
    contexts = torch.randn(n, K, d, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(classes, d, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(classes, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, classes, (n,))

    def fn(*args):
        return mixture_nll(*args, target, chunk_tokens=2, sigmoid_weighting=sigmoid_weighting)

    assert torch.autograd.gradcheck(fn, (log_prior, contexts, weight, bias))
    assert torch.autograd.gradcheck(lambda c, w: fn(log_prior, c, w, None), (contexts, weight))


# ---------------------------------------------------------------------- defining properties
def test_mos_with_one_component_equals_softmax():
    softmax = build("softmax", embedding_dim=6)
    mos = build("mos", num_components=1, embedding_dim=6)
    with torch.no_grad():
        mos.latent.load_state_dict(softmax.projection.state_dict())
        mos.decoder.load_state_dict(softmax.decoder.state_dict())
    hidden, target = inputs()
    assert_close(mos.log_prob(hidden), softmax.log_prob(hidden), "MoS K=1 vs softmax log_prob")
    assert_close(mos(hidden, target), softmax(hidden, target), "MoS K=1 vs softmax nll")


def test_rank_of_log_probability_matrix_softmax_moc_bounded_mos_mixtape_not():
    """On 120 random contexts with d = 4 and V = 50: Softmax and MoC stay at rank <= d + 1;
    MoS and Mixtape exceed it (the softmax bottleneck and its breaking, MoS §2.1-2.4).
    Without a class bias: a bias adds the rank-one term 1 b^T, making the bound d + 2."""
    d = 4
    heads = {
        "softmax": build("softmax", embedding_dim=d, bias=False),
        "moc": build("moc", num_components=5, embedding_dim=d, bias=False),
        "mos": build("mos", num_components=5, embedding_dim=d),
        "mixtape": build("mixtape", num_gates=4, embedding_dim=d, gate_dim=4, frequent_fraction=1.0),
    }
    hidden = 3 * torch.randn(120, IN, dtype=torch.float64)
    ranks = {}
    for name, head in heads.items():
        with torch.no_grad():
            head.decoder.weight.mul_(4.0)  # sharper distributions: non-linearities matter more
            ranks[name] = empirical_rank(head.log_prob(hidden)).rank
    assert ranks["softmax"] <= d + 1 and ranks["moc"] <= d + 1, ranks
    assert ranks["mos"] > d + 1 and ranks["mixtape"] > d + 1, ranks


@pytest.mark.parametrize("num_gates", [2, 4, 8])
def test_sigmoid_tree_is_a_distribution_and_matches_path_products(num_gates):
    logits = 3 * torch.randn(6, num_gates - 1, 5, dtype=torch.float64)
    prior = sigmoid_tree(logits)  # (6, K, 5)
    assert prior.shape == (6, num_gates, 5)
    assert (prior >= 0).all()
    assert_close(prior.sum(1), torch.ones(6, 5, dtype=torch.float64), "sum of priors")
    assert_close(prior, sigmoid_tree_products(logits.transpose(1, 2)).transpose(1, 2), "path products")
    leaves = torch.randn(6, num_gates, 5, dtype=torch.float64)
    assert_close(tree_mix(leaves, logits), (prior * leaves).sum(1), "bottom-up lerps vs sum_k pi_k leaves")


def test_sigmoid_tree_matches_the_papers_four_gate_formula():
    """Mixtape Eq. 3: pi = (g1 g2, g1 (1-g2), (1-g1) g3, (1-g1)(1-g3))."""
    logits = torch.randn(7, 3, dtype=torch.float64)
    g1, g2, g3 = torch.sigmoid(logits).unbind(-1)
    expected = torch.stack([g1 * g2, g1 * (1 - g2), (1 - g1) * g3, (1 - g1) * (1 - g3)], -1)
    assert_close(sigmoid_tree(logits), expected, "K=4 sigmoid tree")


def test_gate_sharing_with_r_one_equals_no_sharing():
    """r = 1 gives every token its own gates; a shared-gate token behaves exactly like an
    own-gate token whose v_x and b_x are zero (Eq. 6), so r < 1 equals r = 1 with those zeroed."""
    shared = build("mixtape", num_gates=4, gate_dim=5, frequent_fraction=0.2)
    full = build("mixtape", num_gates=4, gate_dim=5, frequent_fraction=1.0)
    S = shared.num_frequent
    assert (S, full.num_frequent) == (10, V)
    with torch.no_grad():
        for name in ("context", "gate_projection", "shared_gate", "decoder"):
            getattr(full, name).load_state_dict(getattr(shared, name).state_dict())
        full.gate_embedding.zero_()
        full.gate_embedding[:S] = shared.gate_embedding
        full.gate_bias.zero_()
        full.gate_bias[:S] = shared.gate_bias
    hidden, target = inputs()
    assert_close(shared.log_prob(hidden), full.log_prob(hidden), "shared gates vs r=1 with zero gates")
    assert_close(shared(hidden, target), full(hidden, target), "nll")


def test_mos_forward_never_saves_a_n_k_v_tensor():
    """Memory: the MoS fast path saves nothing of size N*K*V for backward; the reference does."""
    N, K = 40, 5
    head = MixtureOfSoftmaxes(IN, V, num_components=K, embedding_dim=6, chunk_size=20)
    hidden, target = torch.randn(N, IN, requires_grad=True), torch.randint(0, V, (N,))

    def largest_saved(compute) -> int:
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            compute()
        return max(sizes)

    assert largest_saved(lambda: head(hidden, target)) < N * K * V // 4
    assert largest_saved(lambda: REFERENCES["mos"](head, hidden)) >= N * K * V


# ---------------------------------------------------------------------- numerics
def class_scoring_weights(head) -> list[torch.Tensor]:
    """The matrices that turn a latent into class scores: the decoder, or the adaptive softmax's
    head softmax and each tail cluster's output matrix."""
    if hasattr(head, "adaptive"):
        return [head.adaptive.head.weight, *(up.weight for _, up in head.adaptive.tail)]
    return [head.decoder.weight]


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=IDS)
def test_stable_with_huge_logits(name, kwargs):
    head = build(name, **kwargs).float()
    with torch.no_grad():
        for weight in class_scoring_weights(head):
            weight.mul_(1e4)
    hidden = torch.randn(4, IN, requires_grad=True)
    target = torch.randint(0, V, (4,))
    log_probs = head.log_prob(hidden)
    assert torch.isfinite(log_probs).all()
    assert torch.allclose(torch.logsumexp(log_probs, -1), torch.zeros(4), atol=1e-4)
    nll = head(hidden, target)
    assert torch.isfinite(nll).all() and (nll >= -1e-4).all()
    nll.sum().backward()
    assert torch.isfinite(hidden.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in head.parameters() if p.grad is not None)


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=IDS)
def test_bf16_autocast_is_float32_accumulated_and_close(name, kwargs):
    head = build(name, **kwargs).float()
    hidden = torch.randn(6, IN)
    target = torch.randint(0, V, (6,))
    exact = head(hidden, target)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        nll = head(hidden, target)
        log_probs = head.log_prob(hidden)
    assert nll.dtype == torch.float32 and log_probs.dtype == torch.float32
    assert torch.isfinite(nll).all()
    assert torch.allclose(nll, exact, atol=0.15, rtol=0.05), f"max diff {(nll - exact).abs().max():.3g}"
    hidden.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = head(hidden, target).mean()
    loss.backward()
    assert torch.isfinite(hidden.grad).all()


# ---------------------------------------------------------------------- training-time behaviour
def test_dropout_and_gate_noise_only_in_training():
    head = build("mixtape", dropout=0.3, gate_dropout=0.3, gate_noise=1.0).float()
    hidden, target = torch.randn(5, IN), torch.randint(0, V, (5,))
    head.eval()
    assert torch.equal(head(hidden, target), head(hidden, target))
    head.train()
    assert not torch.equal(head(hidden, target), head(hidden, target))


def test_stats_report_prior_entropy_and_usage():
    hidden, target = torch.randn(8, IN), torch.randint(0, V, (8,))
    for cls in (MixtureOfSoftmaxes, MixtureOfContexts):
        head = cls(IN, V, num_components=4).train()
        assert head.stats() == {}
        head(hidden, target)
        stats = head.stats()
        assert 0.0 <= float(stats["prior_entropy"]) <= math.log(4) + 1e-6
        assert stats["component_usage"].shape == (4,)
        assert abs(float(stats["component_usage"].sum()) - 1.0) < 1e-5
    mixtape = Mixtape(IN, V, num_gates=4).train()
    mixtape(hidden, target)
    stats = mixtape.stats()
    for key in ("gate_entropy_frequent", "gate_entropy_shared"):
        assert 0.0 <= float(stats[key]) <= math.log(4) + 1e-6
    assert Mixtape.requires_frequency_order and not MixtureOfSoftmaxes.requires_frequency_order


@pytest.mark.parametrize("cls", [MixtureOfContexts, MixtureOfSoftmaxes, Mixtape, SigSoftmax])
def test_tying_shares_the_class_embeddings(cls):
    head = cls(IN, V, embedding_dim=6)
    assert head.output_embedding_dim == 6
    embedding = torch.nn.Embedding(V, 6)
    head.tie_to(embedding)
    assert head.decoder.weight is embedding.weight
    with pytest.raises(ValueError, match="sizes must match"):
        head.tie_to(torch.nn.Embedding(V, 7))


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("cls", "kwargs", "pattern"),
    [
        (Mixtape, {"num_gates": 3}, r"num_gates to be a power of two >= 2, got 3 \(set head.init_args.num_gates\)"),
        (Mixtape, {"num_gates": 1}, r"power of two >= 2, got 1"),
        (Mixtape, {"num_gates": 0}, r"power of two >= 2, got 0"),
        (Mixtape, {"frequent_fraction": 0.0}, r"frequent_fraction in \(0, 1\], got 0.0 \(set head.init_args"),
        (Mixtape, {"frequent_fraction": 1.5}, r"frequent_fraction in \(0, 1\], got 1.5"),
        (Mixtape, {"gate_noise": -0.1}, r"gate_noise >= 0, got -0.1"),
        (Mixtape, {"weight_norm_scale": 0.0}, r"weight_norm_scale > 0 or null, got 0.0"),
        (Mixtape, {"gate_dim": 0}, r"gate_dim to be an integer >= 1, got 0"),
        (Mixtape, {"dropout": 1.0}, r"dropout in \[0, 1\), got 1.0 \(set head.init_args.dropout\)"),
        (Mixtape, {"gate_dropout": -0.1}, r"gate_dropout in \[0, 1\), got -0.1"),
        (MixtureOfSoftmaxes, {"num_components": 0}, r"num_components to be an integer >= 1, got 0 \(set head"),
        (MixtureOfSoftmaxes, {"dropout": 1.0}, r"dropout in \[0, 1\), got 1.0"),
        (MixtureOfSoftmaxes, {"chunk_size": 0}, r"chunk_size to be an integer >= 1, got 0"),
        (MixtureOfContexts, {"num_components": 0}, r"num_components to be an integer >= 1, got 0"),
        (MixtureOfContexts, {"dropout": -0.5}, r"dropout in \[0, 1\), got -0.5"),
        (SigSoftmax, {"num_components": 0}, r"num_components to be an integer >= 1, got 0"),
        (SigSoftmax, {"dropout": 1.0}, r"dropout in \[0, 1\), got 1.0"),
        (SigSoftmax, {"embedding_dim": 0}, r"embedding_dim to be an integer >= 1, got 0"),
    ],
)
def test_bad_input_is_one_line_value_error(cls, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        cls(IN, V, **kwargs)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------- configs
HEAD_CONFIGS = [
    "configs/heads/softmax.yaml",
    "configs/heads/moc.yaml",
    "configs/heads/mos.yaml",
    "configs/heads/mixtape.yaml",
    "configs/heads/sigsoftmax.yaml",
]


@pytest.mark.parametrize("path", HEAD_CONFIGS)
def test_head_config_builds_its_head(path):
    config = yaml.safe_load((ROOT / path).read_text())
    spec = config["model"]["init_args"]["head"]
    cls = head_class(spec["class_path"])
    head = cls(IN, V, **spec.get("init_args", {}))
    hidden, target = torch.randn(4, IN), torch.randint(0, V, (4,))
    assert torch.isfinite(head(hidden, target)).all()
    assert Path(path).stem in (cls.short_name, "softmax")


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_mixtape_recomputed_gates_equal_the_autograd_path(noise):
    """recompute_gates keeps only the frequent block's inputs and recomputes (N, K, S) in the
    backward: same NLL and gradients as keeping them (float64, training with dropout and noise)."""
    from heads import Mixtape

    torch.manual_seed(0)
    kwargs = dict(num_gates=4, embedding_dim=6, gate_dim=5, frequent_fraction=0.4, dropout=0.2, gate_dropout=0.2, gate_noise=noise)
    fast, plain = (Mixtape(9, 30, recompute_gates=flag, **kwargs).double() for flag in (True, False))
    plain.load_state_dict(fast.state_dict())
    hidden = torch.randn(37, 9, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 30, (37,))
    results = []
    for head in (fast, plain):
        torch.manual_seed(1)  # same dropout masks and gate noise in both
        nll = head(hidden, target)
        grads = torch.autograd.grad((nll * torch.linspace(0.5, 1.5, 37, dtype=torch.float64)).sum(), [hidden, *head.parameters()])
        results.append((nll, grads))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)


def test_mixtape_recomputed_frequent_block_passes_gradcheck():
    from heads.mixtape import _RecomputedFrequent

    torch.manual_seed(2)
    n, K, d, d2, S = 5, 4, 3, 2, 6
    inputs = [torch.randn(*shape, dtype=torch.float64, requires_grad=True)
              for shape in ((n, K, d), (S, d), (n, K - 1, d2), (S, d2), (n, K - 1), (S, K - 1))]
    assert torch.autograd.gradcheck(lambda *x: _RecomputedFrequent.apply(2, None, *x), inputs)
