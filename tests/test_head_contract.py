"""The output-head contract (heads/base.py), checked for every registered head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from heads import OutputHead, Softmax, available_heads, create_head, head_class

IN, V = 16, 50


def make(name: str) -> OutputHead:
    torch.manual_seed(0)
    return create_head(name, in_features=IN, num_classes=V).double()


@pytest.fixture(params=available_heads())
def head(request) -> OutputHead:
    return make(request.param)


def test_registry_lists_the_core_heads():
    assert "softmax" in available_heads()


def test_shapes_and_finite_loss(head):
    head.train()
    hidden = torch.randn(3, 5, IN, dtype=torch.double)
    target = torch.randint(0, V, (3, 5))
    nll = head(hidden, target)
    assert nll.shape == (3, 5)
    assert torch.isfinite(nll).all() and (nll >= 0).all()
    assert head.log_prob(hidden).shape == (3, 5, V)
    values, indices = head.topk(hidden, 4)
    assert values.shape == indices.shape == (3, 5, 4)


def test_loss_equals_nll_of_log_prob_and_log_prob_is_normalised(head):
    head.eval()
    hidden = torch.randn(7, IN, dtype=torch.double)
    target = torch.randint(0, V, (7,))
    log_probs = head.log_prob(hidden)
    expected = -log_probs.gather(1, target[:, None]).squeeze(1)
    torch.testing.assert_close(head(hidden, target), expected, rtol=1e-6, atol=1e-8)
    total = log_probs.exp().sum(-1)
    assert torch.allclose(total, torch.ones_like(total), atol=1e-6), f"max |sum p - 1| = {(total - 1).abs().max()}"


def test_topk_agrees_with_log_prob(head):
    head.eval()
    hidden = torch.randn(6, IN, dtype=torch.double)
    values, indices = head.topk(hidden, 3)
    log_probs = head.log_prob(hidden)
    torch.testing.assert_close(values, log_probs.gather(1, indices))
    assert (values[:, :-1] >= values[:, 1:]).all()


def test_gradients_reach_the_input(head):
    head.train()
    hidden = torch.randn(4, IN, dtype=torch.double, requires_grad=True)
    target = torch.randint(0, V, (4,))
    loss = head(hidden, target).sum() + sum(head.regularization().values(), torch.zeros((), dtype=torch.double))
    loss.backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_ignore_index_contributes_nothing(head):
    head.eval()
    hidden = torch.randn(6, IN, dtype=torch.double, requires_grad=True)
    target = torch.randint(0, V, (6,))
    target[::2] = head.ignore_index
    nll = head(hidden, target)
    assert (nll[::2] == 0).all()
    nll.sum().backward()
    assert hidden.grad[::2].abs().max() == 0, "ignored positions must not send gradient"


def test_very_large_inputs_stay_finite(head):
    head.eval()
    hidden = torch.randn(5, IN, dtype=torch.double) * 1e4
    target = torch.randint(0, V, (5,))
    assert torch.isfinite(head(hidden, target)).all()
    assert torch.isfinite(head.log_prob(hidden)).all()


def test_regularization_and_stats_are_dicts(head):
    assert isinstance(head.regularization(), dict)
    assert isinstance(head.stats(), dict)


def test_softmax_equals_cross_entropy():
    head = Softmax(IN, V).double()
    hidden = torch.randn(9, IN, dtype=torch.double)
    target = torch.randint(0, V, (9,))
    target[3] = -100
    expected = F.cross_entropy(head.decoder(hidden), target, reduction="none")
    torch.testing.assert_close(head(hidden, target), expected)


def test_softmax_tying_shares_the_matrix_and_rejects_mismatched_sizes():
    head = Softmax(IN, V)
    embedding = torch.nn.Embedding(V, IN)
    head.tie_to(embedding)
    assert head.decoder.weight is embedding.weight
    with pytest.raises(ValueError, match=r"cannot tie a 50x8 .* 50x16"):
        Softmax(IN, V).tie_to(torch.nn.Embedding(V, 8))


def exact_topk(head: Softmax, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain transcription: log-softmax of ``W h + b`` over all classes, then its top k."""
    with torch.no_grad():
        latent = torch.tanh(head.projection(hidden)) if head.projection is not None else hidden
        return torch.log_softmax(F.linear(latent, head.decoder.weight, head.decoder.bias), -1).topk(k, dim=-1)


def assert_topk_is_exact(head: Softmax, hidden: torch.Tensor, k: int) -> None:
    values, indices = head.topk(hidden, k)
    want_values, want_indices = exact_topk(head, hidden, k)
    assert torch.equal(indices, want_indices)
    assert torch.allclose(values, want_values, atol=1e-5), f"max diff {(values - want_values).abs().max()}"
    assert not values.requires_grad, "topk builds no graph"


@pytest.mark.parametrize("embedding_dim", [None, 12])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), ()])
@pytest.mark.parametrize("k", [1, 5])
def test_softmax_topk_fast_path_equals_the_exact_topk(shape, k, bias, embedding_dim):
    """The eval path (one addmv / addmm against the cached (d, V) columns, the top logit as the
    normaliser's shift) returns the log-softmax's top k: one context, a batch, a sequence batch."""
    head = Softmax(IN, V, embedding_dim=embedding_dim, bias=bias).eval()
    hidden = torch.randn(*shape, IN)
    assert_topk_is_exact(head, hidden, k)
    assert head.decoder_columns(head.latent(hidden)) is not None, "eval mode uses the transposed copy"
    head.train()
    assert head.decoder_columns(head.latent(hidden)) is None and head._inference_cache is None
    assert_topk_is_exact(head, hidden, k)  # training mode (no dropout): the module's own product


@pytest.mark.parametrize("fused", [False, True])
def test_softmax_topk_cache_follows_every_weight_change(fused):
    """The transposed copy never serves a stale weight: optimizer steps (fused ones bump no version
    counter; a task calls after_optimizer_step), load_state_dict, in-place edits, tying to another
    embedding, .to(), training mode, weights made under inference_mode."""
    head = Softmax(IN, V).eval()
    single, batch = torch.randn(1, IN), torch.randn(9, IN)
    assert_topk_is_exact(head, batch, 3)
    assert head._inference_cache is not None
    optimizer = torch.optim.Adam(head.parameters(), lr=0.5, fused=fused)
    for _ in range(2):  # updates between calls, in eval mode, as a task's validation sees them
        head(torch.randn(16, IN), torch.randint(0, V, (16,))).sum().backward()
        optimizer.step()
        head.after_optimizer_step(optimizer)
        optimizer.zero_grad()
        assert_topk_is_exact(head, single, 1)
        assert_topk_is_exact(head, batch, 3)
    head.load_state_dict(Softmax(IN, V).state_dict())
    assert_topk_is_exact(head, single, 3)
    with torch.no_grad():
        head.decoder.weight.mul_(-1.0)
    assert_topk_is_exact(head, batch, 1)
    head.tie_to(torch.nn.Embedding(V, IN))
    assert_topk_is_exact(head, batch, 3)
    head.double()
    assert_topk_is_exact(head, batch.double(), 3)
    head.train()
    assert head._inference_cache is None
    with torch.inference_mode():  # weights without version counters: nothing cached, same answer
        fresh = Softmax(IN, V).eval()
        assert_topk_is_exact(fresh, batch, 3)
        assert fresh._inference_cache is None


def test_unknown_head_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as info:
        head_class("softmaxx")
    message = str(info.value)
    assert "'softmaxx'" in message and "softmax" in message and "\n" not in message


def test_head_resolves_by_short_name_class_name_and_class_path():
    assert head_class("softmax") is Softmax
    assert head_class("Softmax") is Softmax
    assert head_class("heads.softmax.Softmax") is Softmax


@pytest.mark.parametrize("kwargs, key", [({"dropout": 1.0}, "dropout"), ({"embedding_dim": 0}, "embedding_dim")])
def test_softmax_bad_hyperparameters(kwargs, key):
    with pytest.raises(ValueError, match=key):
        Softmax(IN, V, **kwargs)


def test_unigram_bias_init_gives_the_unigram_when_the_context_is_silent(head):
    """With zero class embeddings, a head whose biases start at the unigram predicts exactly it."""
    counts = torch.arange(V, 0, -1, dtype=torch.double) ** 1.5
    log_unigram = torch.log(counts / counts.sum())
    if not head.init_unigram_bias(log_unigram):
        assert getattr(getattr(head, "decoder", None), "bias", None) is None  # nothing to set
        return
    head.eval()
    hidden = torch.randn(4, IN, dtype=torch.double)
    if hasattr(head, "first_code"):  # Hybrid-LightRNN: a word is a code pair, each code head starts at its own unigram
        with torch.no_grad():
            head.first_head.decoder.weight.zero_()
            head.column_head.decoder.weight.zero_()
        words = head.log_prob(hidden)  # (4, V): P_1(first code) * P_2(column) once the context is silent
        first = torch.zeros(head.first_head.num_classes, dtype=torch.double).index_add_(0, head.first_code, log_unigram.exp())
        per_code = torch.zeros(4, first.numel(), dtype=torch.double).index_add_(1, head.first_code, words.exp()).log()
        torch.testing.assert_close(per_code, first.log().expand(4, -1))  # every first code's mass is the unigram's
        return
    with torch.no_grad():
        head.decoder.weight.zero_()
    expected = log_unigram.expand(4, V)
    torch.testing.assert_close(head.log_prob(hidden), expected)
    nll = head(hidden, torch.arange(4))
    torch.testing.assert_close(nll, -log_unigram[:4])
    with pytest.raises(ValueError, match=r"shape \(50,\)"):
        head.init_unigram_bias(log_unigram[:10])


def test_structure_round_trips_through_the_contract(head):
    """``structure()`` / ``load_structure()`` are on every head: a head loads its own structure
    (``{}`` where its constructor fixes the shape) and refuses a structure it cannot hold."""
    structure = head.structure()
    assert isinstance(structure, dict)
    make(head.short_name).load_structure(structure)
    if not structure:
        with pytest.raises(ValueError, match=rf"head structure but {type(head).__name__} cannot load one"):
            head.load_structure({"num_experts": 4})


@pytest.mark.parametrize("name", ["moc", "mos", "sigsoftmax"])
def test_mixture_heads_share_the_mixture_base(name):
    from heads.mixture import MixtureHead

    head = make(name)
    assert isinstance(head, MixtureHead)
    assert [key for key, _ in head.named_children()] == [k for k in ("prior", "latent", "decoder") if getattr(head, k) is not None]


@pytest.mark.parametrize("check, args, message", [
    ("check_positive_int", (0, "num_components", "MoS"), "MoS needs num_components to be an integer >= 1, got 0 (set head.init_args.num_components)"),
    ("check_positive_int", (True, "rows", "X"), "X needs rows to be an integer >= 1, got True (set head.init_args.rows)"),
    ("check_power_of_two", (6, "num_gates", "Mixtape"), "Mixtape needs num_gates to be a power of two >= 2, got 6 (set head.init_args.num_gates)"),
    ("check_dropout", (1.0, "dropout", "MoC"), "MoC needs dropout in [0, 1), got 1.0 (set head.init_args.dropout)"),
    ("check_fraction", (0.0, "preview_fraction", "SVDSoftmax"), "SVDSoftmax needs preview_fraction in (0, 1], got 0.0 (set head.init_args.preview_fraction)"),
    ("check_nonnegative", (-1.0, "gate_noise", "Mixtape"), "Mixtape needs gate_noise >= 0, got -1.0 (set head.init_args.gate_noise)"),
    ("check_positive_or_none", (0.0, "weight_norm_scale", "Mixtape"), "Mixtape needs weight_norm_scale > 0 or null, got 0.0 (set head.init_args.weight_norm_scale)"),
])
def test_validators_name_the_value_the_rule_and_the_fix(check, args, message):
    import heads.validation

    with pytest.raises(ValueError) as info:
        getattr(heads.validation, check)(*args)
    assert str(info.value) == message


def test_registry_builds_heads_by_name_with_their_size_argument():
    from heads import Mixtape, MixtureOfSoftmaxes
    from heads.registry import head_factory, short_name, size_argument

    assert size_argument("mos") == "num_components" and size_argument("mixtape") == "num_gates"
    assert size_argument("softmax") is None
    assert create_head("mos", IN, V, size=3).num_components == 3
    assert create_head("mixtape", IN, V, size=8, gate_dim=4).num_gates == 8
    with pytest.raises(ValueError, match="Softmax takes no size K"):
        create_head("softmax", IN, V, size=3)
    factory = head_factory("mos", num_components=2)
    head = factory(IN, V)
    assert isinstance(head, MixtureOfSoftmaxes) and head.num_components == 2 and head.num_classes == V
    with pytest.raises(ValueError, match="unknown head 'mox'"):
        head_factory("mox")  # checked when the factory is made, not when it is called
    assert short_name("Mixtape") == short_name("heads.mixtape.Mixtape") == short_name(Mixtape) == "mixtape"
    assert short_name("mos") == "mos" and short_name("NotAHead") is None
