"""SVD-softmax (Shim et al. 2017): exactness when the preview is the whole decomposition or every
class is recomputed, equivalence with a plain transcription of Algorithm 1, the single-context
latency path, registry construction and bad arguments."""

from __future__ import annotations

import pytest
import torch

from heads import Mixtape, Softmax, SVDSoftmax, create_head

D, V = 12, 80


def trained_like_softmax(bias: bool = True, embedding_dim: int | None = None, seed: int = 0) -> Softmax:
    """A float64 softmax whose weights have a decaying spectrum, like trained decoders."""
    torch.manual_seed(seed)
    head = Softmax(D, V, embedding_dim=embedding_dim, bias=bias).double()
    width = head.decoder.in_features
    with torch.no_grad():
        scales = torch.logspace(0, -2, width, dtype=torch.double)
        head.decoder.weight.copy_(torch.randn(V, width, dtype=torch.double) * scales)
        if bias:
            head.decoder.bias.normal_(0, 0.5)
    return head.eval()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("embedding_dim", [None, 6])
def test_preview_of_full_width_returns_exactly_the_softmax_top1(bias, embedding_dim):
    softmax = trained_like_softmax(bias, embedding_dim)
    svd = SVDSoftmax.from_softmax(softmax, preview_fraction=1.0, num_candidates=4)
    assert svd.preview_width == svd.rank == softmax.decoder.in_features + int(bias)
    hidden = torch.randn(50, D, dtype=torch.double)
    expected = softmax.logits(hidden).argmax(-1)
    assert torch.equal(svd.topk(hidden, 1)[1].squeeze(1), expected)
    singles = torch.stack([svd.topk(h.unsqueeze(0), 1)[1].squeeze() for h in hidden])
    assert torch.equal(singles, expected)
    torch.testing.assert_close(svd.log_prob(hidden), softmax.log_prob(hidden))


def test_recomputing_every_class_is_exact_whatever_the_preview():
    softmax = trained_like_softmax()
    svd = SVDSoftmax.from_softmax(softmax, preview_fraction=0.05, num_candidates=V)
    assert svd.preview_width == 1
    hidden = torch.randn(20, D, dtype=torch.double)
    torch.testing.assert_close(svd.log_prob(hidden), softmax.log_prob(hidden))


def test_matches_a_plain_transcription_of_algorithm_1():
    softmax = trained_like_softmax()
    preview_fraction, N = 0.25, 7
    svd = SVDSoftmax.from_softmax(softmax, preview_fraction=preview_fraction, num_candidates=N)
    hidden = torch.randn(9, D, dtype=torch.double)
    # Reference: SVD of [W | b], B = U S, h~ = V^T [h; 1], preview with the first W' columns.
    augmented = torch.cat([softmax.decoder.weight, softmax.decoder.bias[:, None]], 1).detach()
    U, S, Vt = torch.linalg.svd(augmented, full_matrices=False)
    width = -(-int(preview_fraction * 100) * (D + 1) // 100)
    B, h = U * S, torch.cat([hidden, torch.ones(9, 1, dtype=torch.double)], 1) @ Vt.T
    preview = h[:, :width] @ B[:, :width].T
    expected = preview.clone()
    full = softmax.logits(hidden).detach()
    for i in range(9):
        top = preview[i].topk(N).indices
        expected[i, top] = full[i, top]
    got = svd.approximate_logits(hidden)
    assert svd.preview_width == width
    assert torch.allclose(got, expected, atol=1e-10), f"max diff {(got - expected).abs().max():.3g}"


def test_single_context_path_equals_the_batch_path():
    svd = SVDSoftmax.from_softmax(trained_like_softmax(), preview_fraction=0.1, num_candidates=10)
    hidden = torch.randn(15, D, dtype=torch.double)
    values, indices = svd.topk(hidden, 3)
    for i in range(15):
        v, j = svd.topk(hidden[i : i + 1], 3)
        assert torch.equal(j[0], indices[i])
        torch.testing.assert_close(v[0], values[i])


def test_a_small_preview_is_an_approximation():
    """With 1 of 13 dimensions and 2 candidates the distribution is not the softmax's (so the
    exactness tests above test something)."""
    softmax = trained_like_softmax()
    svd = SVDSoftmax.from_softmax(softmax, preview_fraction=0.05, num_candidates=2)
    hidden = torch.randn(40, D, dtype=torch.double)
    assert not torch.allclose(svd.log_prob(hidden), softmax.log_prob(hidden), atol=1e-3)


def test_registry_builds_it_with_defaults_and_from_softmax_keeps_the_dtype():
    head = create_head("svd_softmax", in_features=16, num_classes=50)
    assert isinstance(head, SVDSoftmax) and head.num_candidates == 3 and head.preview_width == 2
    assert SVDSoftmax.from_softmax(Softmax(4, 10)).scaled_left.dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"preview_fraction": 0.0}, r"preview_fraction in \(0, 1\], got 0.0"),
        ({"preview_fraction": 1.5}, r"preview_fraction in \(0, 1\], got 1.5"),
        ({"num_candidates": 0}, "num_candidates to be an integer >= 1, got 0"),
        ({"num_candidates": 51}, "num_candidates <= num_classes=50, got 51"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SVDSoftmax(16, 50, **kwargs)


def test_from_softmax_refuses_other_heads():
    with pytest.raises(ValueError, match="needs a heads.Softmax, got Mixtape"):
        SVDSoftmax.from_softmax(Mixtape(16, 50, gate_dim=4))
