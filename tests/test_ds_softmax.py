"""DS-Softmax head: contract, Eq. 1-6 against a dense reference, compact pruning, mitosis,
structure round trip, sparse top-k, bad input."""

from __future__ import annotations

import pytest
import torch

from heads import create_head
from heads.ds import DSSoftmax, SparseExperts

D, V, K = 6, 11, 3


def reference_log_probs(head: DSSoftmax, hidden: torch.Tensor) -> torch.Tensor:
    """Eq. 1-2 on the dense (K, V, d) weights with pruned rows at zero (Eq. 4)."""
    gates = torch.softmax(hidden @ head.gate_weight.T, dim=-1)  # (N, K)
    gate, expert = gates.max(-1)
    if head.gate_scale == "experts":
        gate = gate * head.num_experts
    weight = head.dense_expert_weight()[expert]  # (N, V, d)
    logits = gate[:, None] * torch.einsum("nvd,nd->nv", weight, hidden)
    if head.class_bias is not None:
        logits = logits + head.class_bias  # a pruned class (zero weights) scores its bias
    return torch.log_softmax(logits, dim=-1)


def dense_head(class_bias: bool = False, gate_scale: str = "none") -> DSSoftmax:
    head = DSSoftmax(D, V, num_experts=K, init_std=0.5, class_bias=class_bias, gate_scale=gate_scale)
    if class_bias:
        torch.nn.init.normal_(head.class_bias, 0.0, 2.0)
    return head


def pruned_head(seed: int = 0, class_bias: bool = False, gate_scale: str = "none") -> DSSoftmax:
    torch.manual_seed(seed)
    head = dense_head(class_bias, gate_scale)
    with torch.no_grad():
        head.expert_weight[::3] *= 1e-4  # a third of the rows fall under the threshold
    assert head.prune(1e-2)
    return head


def test_registered_and_satisfies_the_sparse_experts_protocol():
    head = create_head("ds_softmax", D, V, num_experts=2)
    assert isinstance(head, DSSoftmax) and isinstance(head, SparseExperts)


@pytest.mark.parametrize("gate_scale", ["none", "experts"])
@pytest.mark.parametrize("class_bias", [False, True])
@pytest.mark.parametrize("pruned", [False, True])
def test_forward_and_log_prob_match_dense_reference(pruned, class_bias, gate_scale):
    head = pruned_head(class_bias=class_bias, gate_scale=gate_scale) if pruned else dense_head(class_bias, gate_scale)
    hidden, target = torch.randn(40, D), torch.randint(0, V, (40,))
    target[:3] = -100
    reference = reference_log_probs(head, hidden)
    expected = -reference.gather(1, target.clamp_min(0)[:, None]).squeeze(1).masked_fill(target < 0, 0)
    nll = head(hidden, target)
    assert torch.allclose(nll, expected, atol=1e-5), f"max diff {(nll - expected).abs().max()}"
    log_probs = head.log_prob(hidden.view(4, 10, D))
    assert log_probs.shape == (4, 10, V)
    assert torch.allclose(log_probs.view(40, V), reference, atol=1e-5)
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(4, 10), atol=1e-5)


@pytest.mark.parametrize("class_bias", [False, True])
def test_pruned_classes_can_be_left_out_of_the_training_softmax(class_bias):
    """pruned_in_softmax=False: the chosen expert's kept classes only (as topk normalises); a
    target the expert pruned is scored under Eq. 4 (every pruned class at its bias in the
    normaliser), so routing a context to an expert that keeps few classes does not pay."""
    head = pruned_head(class_bias=class_bias)
    head.pruned_in_softmax = False
    hidden = torch.randn(60, D)
    gates = torch.softmax(hidden @ head.gate_weight.T, dim=-1)
    gate, expert = gates.max(-1)
    logits = gate[:, None] * torch.einsum("nvd,nd->nv", head.dense_expert_weight()[expert], hidden)
    base = head.class_bias.detach() if class_bias else torch.zeros(V)
    logits = logits + base
    kept = head.kept_mask()[expert]  # (N, V)
    reference = torch.log_softmax(logits.masked_fill(~kept, float("-inf")), dim=-1)
    assert torch.allclose(head.log_prob(hidden), reference, atol=1e-5)
    target = torch.randint(0, V, (60,))
    found = kept.gather(1, target[:, None]).squeeze(1)
    assert found.any() and (~found).any(), "the fixture has kept and pruned targets"
    kept_only = -reference.gather(1, target[:, None]).squeeze(1)
    eq4 = -reference_log_probs(head, hidden).gather(1, target[:, None]).squeeze(1)
    expected = torch.where(found, kept_only, eq4)
    assert torch.allclose(head(hidden, target), expected, atol=1e-5)
    values, indices = head.topk(hidden, 1)
    assert torch.allclose(values[:, 0], reference.max(-1).values, atol=1e-5)


def test_class_bias_starts_at_the_unigram_and_survives_mitosis_and_pruning():
    log_unigram = torch.log_softmax(torch.randn(V), 0)
    assert not DSSoftmax(D, V).init_unigram_bias(log_unigram)  # the paper's head has no bias
    head = DSSoftmax(D, V, num_experts=2, class_bias=True)
    assert head.init_unigram_bias(log_unigram) and torch.equal(head.class_bias, log_unigram)
    # weights near zero: the head's distribution is the unigram
    assert torch.allclose(head.log_prob(torch.zeros(3, D)), log_unigram.expand(3, V), atol=1e-5)
    with pytest.raises(ValueError, match=r"shape \(11,\), got \(5,\)"):
        head.init_unigram_bias(torch.zeros(5))
    bias = head.class_bias
    head.split_experts()
    head.prune(1e-1)
    assert head.class_bias is bias  # one bias for all experts: structure changes leave it alone


def test_every_gate_row_gets_gradient_although_one_expert_is_chosen():
    head = DSSoftmax(D, V, num_experts=4)
    hidden = torch.randn(1, D)  # a single context: exactly one expert is chosen
    head(hidden, torch.tensor([2])).sum().backward()
    assert (head.gate_weight.grad.abs().sum(1) > 0).all(), "Eq. 2 keeps the gate inside the softmax"
    chosen = int(head.route(hidden)[0])
    rows = head.expert_offsets.tolist()
    touched = head.expert_weight.grad.abs().sum(1) > 0
    assert touched[rows[chosen] : rows[chosen + 1]].all() and touched.sum() == V


@pytest.mark.parametrize("gate_scale", ["none", "experts"])
@pytest.mark.parametrize("class_bias", [False, True])
@pytest.mark.parametrize("n", [1, 37])
@pytest.mark.parametrize("k", [1, 3])
def test_sparse_topk_equals_dense_topk_restricted_to_the_chosen_experts_kept_classes(n, k, class_bias, gate_scale):
    head = pruned_head(1, class_bias, gate_scale).eval()
    assert_topk_matches_restricted_dense(head, torch.randn(n, D), k)


def test_topk_with_autograd_on_builds_no_graph():
    """``topk`` enters ``no_grad`` itself when the caller has autograd on (and skips it otherwise)."""
    head = pruned_head(1, True, "none").eval()
    for n in (1, 5):
        values, _ = head.topk(torch.randn(n, D, requires_grad=True), 2)
        assert values.shape == (n, 2) and not values.requires_grad


def assert_topk_matches_restricted_dense(head: DSSoftmax, hidden: torch.Tensor, k: int) -> None:
    """``head.topk`` equals the dense Eq. 2 top-k over the chosen expert's kept classes."""
    with torch.no_grad():
        values, indices = head.topk(hidden, k)
        gates = torch.softmax(hidden @ head.gate_weight.T, -1)
        gate, expert = gates.max(-1)
        if head.gate_scale == "experts":
            gate = gate * head.num_experts
        dense = gate[:, None] * torch.einsum("nvd,nd->nv", head.dense_expert_weight()[expert], hidden)
        if head.class_bias is not None:
            dense = dense + head.class_bias
        kept = head.kept_mask()[expert]  # (n, V)
        restricted = torch.log_softmax(dense.masked_fill(~kept, float("-inf")), -1)
        ref_values, ref_indices = restricted.topk(k, -1)
    assert torch.equal(indices, ref_indices)
    assert torch.allclose(values, ref_values, atol=1e-5), f"max diff {(values - ref_values).abs().max()}"


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("class_bias", [False, True])
def test_topk_inference_cache_follows_every_weight_change(class_bias, fused):
    """The batch path's transposed copy of the rows and bias must never serve stale weights:
    optimizer steps (fused ones bump no version counter), load_state_dict, in-place edits,
    pruning, training mode."""
    head = pruned_head(2, class_bias).eval()
    hidden, single = torch.randn(29, D), torch.randn(1, D)
    assert_topk_matches_restricted_dense(head, hidden, 3)
    assert head._inference_cache is not None, "the batch path caches the transposed rows in eval mode"
    optimizer = torch.optim.Adam(head.parameters(), lr=0.5, fused=fused)
    for _ in range(2):  # in-place updates of rows, gate and bias between calls, as a task runs them
        head(torch.randn(16, D), torch.randint(0, V, (16,))).sum().backward()
        optimizer.step()
        head.after_optimizer_step(optimizer)
        optimizer.zero_grad()
        assert_topk_matches_restricted_dense(head, hidden, 3)
        assert_topk_matches_restricted_dense(head, single, 3)
    other = pruned_head(2, class_bias)
    head.load_state_dict(other.state_dict())
    assert_topk_matches_restricted_dense(head, hidden, 3)
    with torch.no_grad():
        head.expert_weight.mul_(-1.0)
    assert_topk_matches_restricted_dense(head, hidden, 3)
    if class_bias:  # the bias alone
        with torch.no_grad():
            head.class_bias.add_(5 * torch.randn(V))
        assert_topk_matches_restricted_dense(head, hidden, 3)
        assert_topk_matches_restricted_dense(head, single, 3)
    head.prune(0.3)
    assert_topk_matches_restricted_dense(head, hidden, 3)
    head.train()
    assert head._inference_cache is None
    assert_topk_matches_restricted_dense(head, hidden, 3)
    assert head._inference_cache is None, "nothing is cached in training mode"
    with torch.inference_mode():  # weights without version counters: nothing cached, same answer
        fresh = pruned_head(2, class_bias).eval()
        assert_topk_matches_restricted_dense(fresh, hidden, 3)
        assert fresh._inference_cache is None


def test_topk_pads_when_the_expert_keeps_fewer_classes_than_k():
    head = DSSoftmax(D, V, num_experts=1, keep_last_copy=False)
    with torch.no_grad():
        head.expert_weight[2:] = 0
    head.prune(1e-3)
    for n in (1, 2):  # the single-context path and the batch path
        values, indices = head.topk(torch.randn(n, D), 4)
        assert values.shape == indices.shape == (n, 4)
        assert indices[:, 2:].eq(-1).all() and values[:, 2:].eq(float("-inf")).all()
        assert set(indices[:, :2].flatten().tolist()) <= {0, 1}


def test_pruning_is_compact_and_pruned_rows_stay_zero_after_optimizer_steps():
    head = pruned_head()
    mask = head.kept_mask().clone()
    assert head.expert_weight.shape[0] == int(mask.sum()) < K * V  # memory ∝ kept rows
    optimizer = torch.optim.Adam(head.parameters(), lr=0.1, weight_decay=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        (head(torch.randn(16, D), torch.randint(0, V, (16,))).sum() + sum(head.regularization().values())).backward()
        optimizer.step()
    assert torch.equal(head.kept_mask(), mask)
    assert head.dense_expert_weight()[~mask].abs().max() == 0


def test_a_classes_last_copy_is_never_pruned():
    head = DSSoftmax(D, V, num_experts=K, init_std=0.5)
    with torch.no_grad():
        head.expert_weight[head.class_index == 4] *= 1e-6  # class 4 is weak in every expert
        head.expert_weight[(head.class_index == 4).nonzero()[1]] *= 10  # its strongest copy
    head.prune(1e-2)
    mask = head.kept_mask()
    assert mask[:, 4].sum() == 1 and mask[1, 4], "the strongest copy of the class survives"
    assert mask.any(0).all()
    zeroed = DSSoftmax(D, V, num_experts=K)
    with torch.no_grad():
        zeroed.expert_weight.zero_()  # ties everywhere
    zeroed.prune(1e-2)
    kept = zeroed.kept_mask()
    # one copy per class and one row per expert (no expert is left empty), even when norms tie
    assert kept.any(0).all() and int(kept.sum()) == V + K - 1 and kept.any(1).all()
    lenient = DSSoftmax(D, V, num_experts=K, keep_last_copy=False)
    with torch.no_grad():
        lenient.expert_weight[lenient.class_index == 4] = 0
    lenient.prune(1e-2)
    assert not lenient.kept_mask()[:, 4].any()


@pytest.mark.parametrize("class_bias", [False, True])
def test_noiseless_mitosis_preserves_the_function_only_with_the_experts_gate_scale(class_bias):
    hidden = torch.randn(25, D)
    for gate_scale, preserved in (("experts", True), ("none", False)):
        head = pruned_head(2, class_bias, gate_scale)
        before = head.log_prob(hidden)
        head.split_experts(noise=0.0)
        after = head.log_prob(hidden)
        assert head.num_experts == 2 * K
        assert torch.allclose(before, after, atol=1e-5) == preserved, gate_scale


def test_mitosis_clones_copy_rows_masks_and_gates_and_report_source_rows():
    head = pruned_head()
    mask, weight, gate = head.kept_mask().clone(), head.expert_weight.detach().clone(), head.gate_weight.detach().clone()
    remaps = head.split_experts(noise=0.0)
    assert head.num_experts == 2 * K
    assert torch.equal(head.kept_mask(), torch.cat([mask, mask]))
    assert torch.equal(head.gate_weight.detach(), torch.cat([gate, gate]))
    (old_gate, new_gate, gate_rows), (old_w, new_w, rows) = remaps
    assert new_w is head.expert_weight and torch.equal(new_w.detach(), weight[rows])
    assert torch.equal(new_gate.detach(), gate[gate_rows])
    noisy = pruned_head()
    noisy.split_experts(noise=0.1, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(noisy.gate_weight[:K], noisy.gate_weight[K:]), "noise breaks the parent/clone tie"


def test_structure_round_trip_into_a_fresh_head_and_mismatch_is_one_line():
    head = pruned_head()
    head.split_experts(noise=0.05)
    fresh = DSSoftmax(D, V, num_experts=K)
    fresh.load_structure(head.structure())
    fresh.load_state_dict(head.state_dict())
    hidden, target = torch.randn(9, D), torch.randint(0, V, (9,))
    assert torch.equal(fresh(hidden, target), head(hidden, target))
    assert torch.equal(fresh.eval().topk(hidden, 2)[1], head.eval().topk(hidden, 2)[1])
    plain = DSSoftmax(D, V, num_experts=K)  # no metadata: the state dict carries the structure
    plain.load_state_dict(head.state_dict())
    assert torch.equal(plain(hidden, target), head(hidden, target))
    corrupt = dict(head.state_dict(), expert_offsets=head.expert_offsets[:-1])
    with pytest.raises(ValueError, match="must have one per expert plus one"):
        DSSoftmax(D, V, num_experts=K).load_state_dict(corrupt)
    wrong = DSSoftmax(D, V, num_experts=K)
    structure = head.structure()
    structure["rows_per_expert"] = [V] * structure["num_experts"]
    wrong.load_structure(structure)
    with pytest.raises(ValueError, match="does not match its weights") as err:
        wrong.load_state_dict(head.state_dict())
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="inconsistent"):
        wrong.load_structure({"num_experts": 2, "rows_per_expert": [3], "num_classes": V, "in_features": D})
    with pytest.raises(ValueError, match="num_classes"):
        wrong.load_structure({**head.structure(), "num_classes": V + 1})
    head.pruned_in_softmax = False
    fresh = DSSoftmax(D, V, num_experts=K)
    fresh.load_structure(head.structure())
    assert fresh.pruned_in_softmax is False, "the kept-classes softmax travels with the checkpoint"


def swap_first_two(tensor: torch.Tensor) -> torch.Tensor:
    tensor[[0, 1]] = tensor[[1, 0]]
    return tensor


#: Edits of a pruned head's index buffers in its state dict (``edit(state)``), as a security review
#: made them in a checkpoint: the buffer the refusal names and the words of its rule.
DAMAGED_INDEX = {
    "class id past the vocabulary": (lambda s: s["class_index"].__setitem__(0, 10**6), "class_index",
                                     f"holds 1000000 at row 0, but every entry must be a class id in 0..{V - 1}"),
    "negative class id": (lambda s: s["class_index"].__setitem__(0, -3), "class_index",
                          f"holds -3 at row 0, but every entry must be a class id in 0..{V - 1}"),
    "classes of an expert out of order": (lambda s: swap_first_two(s["class_index"]), "class_index",
                                          "at row 1 inside expert 0, but each expert's classes must be ascending and distinct"),
    "float class ids": (lambda s: s.update(class_index=s["class_index"].float()), "class_index",
                        "is a float32 tensor, but index buffers hold integers"),
    "offset past the rows": (lambda s: s["expert_offsets"].__setitem__(1, 10**6), "expert_offsets",
                             "goes from 1000000 to"),
    "negative offset": (lambda s: s["expert_offsets"].__setitem__(1, -1), "expert_offsets",
                        "goes from 0 to -1 at expert 0, but it must increase"),
    "offsets not from 0": (lambda s: s["expert_offsets"].__setitem__(0, 1), "expert_offsets",
                           "starts at 1, but it must start at 0"),
    "offsets ending short": (lambda s: s["expert_offsets"].__setitem__(-1, s["expert_offsets"][-1] - 1), "expert_offsets",
                             "but it must end at the number of packed rows"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED_INDEX))
def test_a_state_dict_with_damaged_index_buffers_is_refused_naming_the_buffer_and_the_rule(damage):
    """An index buffer edited in a checkpoint used to be an IndexError or a negative-repeats
    RuntimeError inside forward / topk / kept_mask, or (a negative class id) a silently different
    model; loaded as a checkpoint is (structure first), it is one ValueError line naming the
    buffer, the value and the rule, and the head keeps the storage it had."""
    edit, buffer, rule = DAMAGED_INDEX[damage]
    head = pruned_head()
    state = {name: value.clone() for name, value in head.state_dict().items()}
    edit(state)
    fresh = DSSoftmax(D, V, num_experts=K)
    fresh.load_structure(head.structure())
    before = {name: value.clone() for name, value in fresh.state_dict().items()}
    with pytest.raises(ValueError, match="damaged or was edited") as err:
        fresh.load_state_dict(state)
    message = str(err.value)
    assert message.startswith(f"DSSoftmax buffer {buffer} ") and rule in message and "\n" not in message
    assert all(torch.equal(value, before[name]) for name, value in fresh.state_dict().items()), "nothing was copied"


def test_a_plain_state_dict_with_a_damaged_offset_is_refused_before_the_head_is_resized():
    """No metadata (the head is resized from the state dict's own offsets): the offsets are checked
    before they size anything (a negative count used to reach repeat_interleave)."""
    head = pruned_head()
    state = dict(head.state_dict(), expert_offsets=head.expert_offsets.clone().index_fill_(0, torch.tensor([1]), -1))
    plain = DSSoftmax(D, V, num_experts=K)
    with pytest.raises(ValueError, match="DSSoftmax buffer expert_offsets goes from 0 to -1 at expert 0"):
        plain.load_state_dict(state)
    assert plain.expert_weight.shape == (K * V, D), "the dense start is kept"


def test_offsets_that_disagree_with_the_loaded_structure_are_refused():
    """Valid offsets of other per-expert sizes than head_structure's: the weights would be cut
    into other experts than the checkpoint's metadata describes."""
    head = pruned_head()
    state = {name: value.clone() for name, value in head.state_dict().items()}
    state["expert_offsets"][1] += 1
    fresh = DSSoftmax(D, V, num_experts=K)
    fresh.load_structure(head.structure())
    with pytest.raises(ValueError, match="rows per expert, but the checkpoint's head_structure says"):
        fresh.load_state_dict(state)


def test_regularizers_follow_eq3_eq6_and_balance_is_squared_cv():
    head = DSSoftmax(D, V, num_experts=K, group_lasso_weight=0.5, expert_lasso_weight=0.25, load_balance_weight=2.0)
    head(torch.randn(30, D), torch.randint(0, V, (30,)))
    reg = head.regularization()
    dense = head.dense_expert_weight()
    assert torch.allclose(reg["group_lasso"], 0.5 * dense.norm(dim=2).sum())
    assert torch.allclose(reg["expert_lasso"], 0.25 * dense.flatten(1).norm(dim=1).sum())
    importance = head.last_importance()
    cv2 = importance.var(unbiased=False) / importance.mean() ** 2
    assert torch.allclose(reg["load_balance"], 2.0 * cv2)
    # minimising the loss balances: a gradient step on the gate lowers the CV
    reg["load_balance"].backward()
    with torch.no_grad():
        head.gate_weight -= 1.0 * head.gate_weight.grad
    head(torch.randn(30, D), torch.randint(0, V, (30,)))
    assert head.regularization()["load_balance"] <= reg["load_balance"] + 1e-6 or cv2 < 1e-6
    assert head.eval().regularization().keys() == {"group_lasso", "expert_lasso"}


def test_routing_loss_is_the_gate_mass_on_experts_keeping_the_target_and_raises_coverage():
    torch.manual_seed(0)
    dense = DSSoftmax(D, V, num_experts=K, routing_loss_weight=1.0)
    dense(torch.randn(20, D), torch.randint(0, V, (20,)))
    assert float(dense.regularization()["routing"].detach()) == pytest.approx(0.0, abs=1e-6), "every expert keeps every class"
    head = pruned_head()
    head.routing_loss_weight = 2.0
    hidden, target = torch.randn(40, D), torch.randint(0, V, (40,))
    target[:3] = head.ignore_index
    head(hidden, target)
    valid = target != head.ignore_index
    gates = torch.softmax(hidden @ head.gate_weight.T, dim=-1)[valid]  # (n, K)
    keeps = head.kept_mask()[:, target[valid]].T.float()  # (n, K)
    expected = -(gates * keeps).sum(1).log().mean()
    reg = head.regularization()["routing"]
    assert torch.allclose(reg, 2.0 * expected, atol=1e-6)
    assert (keeps.sum(1) < K).any(), "the pruned head must leave some targets to some experts only"
    # a few gradient steps on the routing loss alone move the argmax onto experts keeping the target
    def coverage() -> float:
        with torch.no_grad():
            chosen = head.route(hidden[valid])[0]
        return float(head.kept_mask()[chosen, target[valid]].float().mean())
    before = coverage()
    optimizer = torch.optim.SGD([head.gate_weight], lr=0.5)
    for _ in range(50):
        optimizer.zero_grad()
        head(hidden, target)
        head.regularization()["routing"].backward()
        optimizer.step()
    assert coverage() > before
    assert "routing" not in head.eval().regularization(), "a training-only loss"
    # after a structure change the kept-classes lookup follows the new masks
    head.train()
    with torch.no_grad():
        head.expert_weight[1::2] *= 1e-4
    head.prune(1e-2)
    head(hidden, target)
    keeps = head.kept_mask()[:, target[valid]].T.float()
    gates = torch.softmax(hidden @ head.gate_weight.T, dim=-1)[valid]
    reachable = keeps.any(1)
    assert torch.allclose(head.regularization()["routing"], -2.0 * (gates * keeps).sum(1)[reachable].log().mean(), atol=1e-6)


def test_stats_report_speedup_from_routing_and_kept_fraction():
    head = pruned_head()
    head(torch.randn(50, D), torch.randint(0, V, (50,)))
    stats = head.stats()
    u = head.routing_counts().float() / 50
    f = head.rows_per_expert().float() / V
    assert stats["theoretical_speedup"] == pytest.approx(1 / float((u * f).sum()))
    assert stats["kept_fraction"] == pytest.approx(float(f.mean()))
    hidden, target = torch.randn(60, D), torch.randint(0, V, (60,))
    target[:5] = head.ignore_index
    head(hidden, target)
    valid = target != head.ignore_index
    with torch.no_grad():
        chosen = head.route(hidden)[0][valid]
    covered = head.kept_mask()[chosen, target[valid]].float().mean()
    assert float(head.stats()["coverage"]) == pytest.approx(float(covered)) and float(covered) < 1.0


@pytest.mark.parametrize(
    "kwargs, match",
    [({"num_experts": 0}, "num_experts"), ({"group_lasso_weight": -1.0}, "group_lasso_weight >= 0"),
     ({"expert_lasso_weight": -0.1}, "expert_lasso_weight"), ({"load_balance_weight": -2.0}, "load_balance_weight"),
     ({"routing_loss_weight": -1.0}, "routing_loss_weight >= 0"),
     ({"gate_scale": "K"}, r"gate_scale in \('none', 'experts', 'unit'\), got 'K'")],
)
def test_bad_arguments_are_one_line_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        DSSoftmax(D, V, **kwargs)
    assert "\n" not in str(err.value) and "set " in str(err.value)


def test_negative_threshold_is_refused():
    with pytest.raises(ValueError, match="threshold >= 0"):
        DSSoftmax(D, V).prune(-0.1)


def test_bench_ds_tiny_prints_speedup_next_to_flops_reduction(capsys):
    from app.main import main

    assert main(["bench", "ds", "--tiny"]) == 0
    out = capsys.readouterr().out
    assert "speed-up" in out and "FLOPs reduction" in out and "single context" in out and "batch of 16" in out


def test_bench_ds_structure_has_the_requested_redundancy_and_refuses_bad_values():
    from app.bench.ds import pruned_head

    head = pruned_head(8, 300, 6, redundancy=2.0, seed=0)
    mask = head.kept_mask()
    assert mask.any(0).all() and 1.6 < mask.sum() / 300 < 2.4
    with pytest.raises(ValueError, match="redundancy"):
        pruned_head(8, 300, 6, redundancy=0.5, seed=0)


def test_bench_ds_loads_a_checkpoints_head_with_its_options(tmp_path, capsys):
    """``bench ds --ckpt_path``: the head is rebuilt with the run's options (class bias, gate
    scale) and structure; a head with a class bias used to fail on an unexpected key."""
    from app.main import main

    head = pruned_head(3, class_bias=True, gate_scale="experts")
    path = tmp_path / "ds.ckpt"
    torch.save({"head_structure": head.structure(), "state_dict": {f"head.{k}": v for k, v in head.state_dict().items()},
                "hyper_parameters": {"head": {"class_path": "heads.DSSoftmax",
                                              "init_args": {"num_experts": 2, "class_bias": True, "gate_scale": "experts"}}}}, path)
    assert main(["bench", "ds", "--ckpt_path", str(path), "--samples", "4", "--batches", "1", "--batch_size", "5", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert f"d={D}, V={V}, K={K}" in out and "batch of 5" in out


def test_bench_ds_refuses_a_head_only_checkpoint_with_a_damaged_class_index_in_one_line(tmp_path):
    """A checkpoint holding only a head (rebuilt without a task): the head's refusal of a negative
    class id names the file; it used to be timed as a silently different head."""
    from tests.shell import one_error_line, run_cli

    head = pruned_head(3)
    state = {f"head.{k}": v.clone() for k, v in head.state_dict().items()}
    state["head.class_index"][0] = -3
    path = tmp_path / "ds.ckpt"
    torch.save({"head_structure": head.structure(), "state_dict": state,
                "hyper_parameters": {"head": {"class_path": "heads.DSSoftmax", "init_args": {"num_experts": 2}}}}, path)
    result = run_cli(["bench", "ds", "--ckpt_path", str(path), "--samples", "4", "--batches", "1", "--repeats", "1"], tmp_path)
    one_error_line(result, f"checkpoint {path}: DSSoftmax buffer class_index holds -3 at row 0")


def test_pruned_head_builder_keeps_exactly_the_given_classes_with_the_given_rows():
    """heads.ds.build.pruned_head: expert k scores exactly the classes keep[k], with the packed
    rows given (or each class's row copied), and answers like a head pruned down to that mask."""
    from heads.ds.build import pruned_head as build, random_kept_mask

    generator = torch.Generator().manual_seed(0)
    keep = random_kept_mask(K, V, 1.5, generator)
    gate, class_rows, bias = torch.randn(K, D), torch.randn(V, D), torch.randn(V)
    head = build(keep, gate, class_rows=class_rows, class_bias=bias, gate_scale="unit")
    assert torch.equal(head.kept_mask(), keep) and head.gate_scale == "unit"
    expected = torch.zeros(K, V, D)
    expected[keep] = class_rows.unsqueeze(0).expand(K, V, D)[keep]
    assert torch.equal(head.dense_expert_weight(), expected) and torch.equal(head.class_bias, bias)
    packed = build(keep, gate, rows=torch.randn(int(keep.sum()), D))
    assert torch.equal(packed.kept_mask(), keep) and packed.class_bias is None
    assert keep.any(0).all() and keep.any(1).all(), "every class and every expert keeps something"
    with pytest.raises(ValueError, match="exactly one of rows"):
        build(keep, gate)
