"""linear_nll: the same NLL and gradients as autograd through F.linear + F.cross_entropy."""

import pytest
import torch
import torch.nn.functional as F

from heads.fused_nll import chunk_rows, fusable, linear_nll


def reference(h, w, b, t, ignore):
    return F.cross_entropy(F.linear(h, w, b), t, ignore_index=ignore, reduction="none")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 64, None])
def test_matches_cross_entropy_values_and_gradients(bias, rows):
    torch.manual_seed(0)
    N, d, V = 50, 6, 37
    h = torch.randn(N, d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, d, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, dtype=torch.float64, requires_grad=True) if bias else None
    t = torch.randint(0, V, (N,))
    t[::4] = -100
    upstream = torch.rand(N, dtype=torch.float64)  # a non-uniform per-token weighting, not just a mean
    params = [p for p in (h, w, b) if p is not None]
    ours = linear_nll(h, w, b, t, -100, rows)
    expected = reference(h, w, b, t, -100)
    torch.testing.assert_close(ours, expected)
    assert (ours[::4] == 0).all()
    got = torch.autograd.grad((ours * upstream).sum(), params)
    want = torch.autograd.grad((expected * upstream).sum(), params)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


def test_gradcheck_float64_and_retained_graph():
    torch.manual_seed(1)
    h = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 3, -100, 10, 5, 5, 1, -100, 2])
    assert torch.autograd.gradcheck(lambda h, w, b: linear_nll(h, w, b, t, -100, 4), (h, w, b))
    nll = linear_nll(h, w, b, t, -100, 4).sum()
    first = torch.autograd.grad(nll, (h, w, b), retain_graph=True)
    second = torch.autograd.grad(nll, (h, w, b))  # the saved buffers were not consumed
    for a, c in zip(first, second):
        torch.testing.assert_close(a, c)


def test_huge_logits_stay_finite_and_only_needed_gradients():
    h = torch.full((5, 3), 1e4, requires_grad=True)
    w = torch.randn(8, 3)  # a frozen decoder: no weight gradient is asked for
    t = torch.tensor([0, 1, 2, 3, -100])
    nll = linear_nll(h, w, None, t, -100)
    assert torch.isfinite(nll).all()
    nll.sum().backward()
    assert torch.isfinite(h.grad).all() and w.grad is None


def test_all_rows_ignored_and_empty_batch():
    w = torch.randn(8, 3, requires_grad=True)
    b = torch.zeros(8, requires_grad=True)
    h = torch.randn(4, 3, requires_grad=True)
    nll = linear_nll(h, w, b, torch.full((4,), -100), -100)
    nll.sum().backward()
    assert (nll == 0).all() and (w.grad == 0).all() and (h.grad == 0).all()
    empty = linear_nll(torch.randn(0, 3, requires_grad=True), w, b, torch.zeros(0, dtype=torch.long), -100)
    empty.sum().backward()
    assert empty.shape == (0,)


def test_fusable_and_chunk_rows():
    w = torch.randn(8, 3)
    assert fusable(torch.randn(2, 3), w)
    assert not fusable(torch.randn(2, 3, dtype=torch.float64), w)
    assert not fusable(torch.randn(2, 3).half(), w.half())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fusable(torch.randn(2, 3), w)
    assert chunk_rows(10_000) * 10_000 * 4 <= 8 * 2**20 and chunk_rows(10**9) == 16


@pytest.mark.parametrize("rows", [3, None])
def test_prefix_logits_match_cross_entropy_over_the_concatenation(rows):
    torch.manual_seed(2)
    N, d, S, V = 20, 5, 4, 13
    prefix = torch.randn(N, S, dtype=torch.float64, requires_grad=True)
    h = torch.randn(N, d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V - S, d, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V - S, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (N,))
    t[0], t[1], t[2] = 0, S - 1, -100  # targets on both sides of the split and one ignored
    upstream = torch.rand(N, dtype=torch.float64)
    ours = linear_nll(h, w, b, t, -100, rows, prefix=prefix)
    expected = F.cross_entropy(torch.cat([prefix, F.linear(h, w, b)], 1), t, ignore_index=-100, reduction="none")
    torch.testing.assert_close(ours, expected)
    got = torch.autograd.grad((ours * upstream).sum(), (prefix, h, w, b))
    want = torch.autograd.grad((expected * upstream).sum(), (prefix, h, w, b))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)
