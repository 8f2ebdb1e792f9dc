"""Every float64 reference op's backward against central finite differences (rel. error < 1e-6)."""

import numpy as np
import pytest
from gradcheck import check_grad

from mambactl.reference import activations as act
from mambactl.reference.conv1d import conv1d, conv1d_backward, conv1d_silu, conv1d_silu_backward
from mambactl.reference.cross_entropy import cross_entropy, cross_entropy_backward
from mambactl.reference.embedding import embedding, embedding_backward
from mambactl.reference.linear import linear, linear_backward
from mambactl.reference.rmsnorm import add_rmsnorm, rmsnorm, rmsnorm_backward
from mambactl.reference.slice import column_slice, column_slice_backward

TOL = 1e-6


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_linear(rng):
    x, w, b, dy = rng.normal(size=(5, 4)), rng.normal(size=(3, 4)), rng.normal(size=3), rng.normal(size=(5, 3))
    f = lambda: np.sum(linear(x, w, b) * dy)
    dx, dw, db = linear_backward(x, w, dy)
    assert max(check_grad(f, x, dx), check_grad(f, w, dw), check_grad(f, b, db)) < TOL


def test_rmsnorm(rng):
    x, w, dy = rng.normal(size=(4, 6)), rng.normal(size=6), rng.normal(size=(4, 6))
    x[0] *= 3e-3  # mean(x²) ≈ eps: the eps term matters
    f = lambda: np.sum(rmsnorm(x, w, 1e-5) * dy)
    dx, dw = rmsnorm_backward(x, w, dy, 1e-5)
    # x[0] varies on a scale of sqrt(eps): a smaller step keeps the O(step²) truncation error down
    assert max(check_grad(f, x, dx, eps=1e-7), check_grad(f, w, dw)) < TOL


def test_add_rmsnorm(rng):
    """h = x + r feeds the norm and another consumer (loss Σ y·dy + Σ h·dh): both inputs get dx + dh."""
    x, r, w = rng.normal(size=(4, 6)), rng.normal(size=(4, 6)), rng.normal(size=6)
    dy, dh = rng.normal(size=(4, 6)), rng.normal(size=(4, 6))
    f = lambda: float(np.sum(add_rmsnorm(x, r, w)[1] * dy) + np.sum(add_rmsnorm(x, r, w)[0] * dh))
    h, _ = add_rmsnorm(x, r, w)
    dx, dw = rmsnorm_backward(h, w, dy, add_to=dh)
    assert max(check_grad(f, x, dx), check_grad(f, r, dx), check_grad(f, w, dw)) < TOL


@pytest.mark.parametrize("name", ["sigmoid", "silu", "softplus", "exp"])
def test_activation(rng, name):
    x = np.array([-30.0, -3.0, -0.5, 0.0, 0.7, 4.0, 19.5, 19.99, 20.01, 20.5, 35.0])
    dy = rng.normal(size=x.shape)
    fwd, bwd = getattr(act, name), getattr(act, name + "_backward")
    assert check_grad(lambda: np.sum(fwd(x) * dy), x, bwd(x, dy)) < TOL


def test_softplus_threshold():
    """PyTorch semantics: identity above 20, log1p(exp(x)) at and below."""
    x = np.array([-5.0, 0.0, 20.0, 20.5])
    assert np.allclose(act.softplus(x), [np.log1p(np.exp(-5.0)), np.log(2.0), np.log1p(np.exp(20.0)), 20.5], rtol=0)


def test_mul(rng):
    a, b, dy = rng.normal(size=(3, 4)), rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    da, db = act.mul_backward(a, b, dy)
    f = lambda: np.sum(act.mul(a, b) * dy)
    assert max(check_grad(f, a, da), check_grad(f, b, db)) < TOL


@pytest.mark.parametrize("K", [1, 3, 4])
def test_conv1d(rng, K):
    x, w, b, dy = rng.normal(size=(2, 5, 3)), rng.normal(size=(3, 1, K)), rng.normal(size=3), rng.normal(size=(2, 5, 3))
    f = lambda: np.sum(conv1d(x, w, b) * dy)
    dx, dw, db = conv1d_backward(x, w, dy)
    assert max(check_grad(f, x, dx), check_grad(f, w, dw), check_grad(f, b, db)) < TOL


@pytest.mark.parametrize("two_grads", [False, True])
@pytest.mark.parametrize("K", [1, 4])
def test_conv1d_silu(rng, K, two_grads):
    """act = SiLU(conv1d(x)), used once (loss Σ act·dact) or twice (Σ act·(dact + dact2))."""
    x, w, b = rng.normal(size=(2, 5, 3)), rng.normal(size=(3, 1, K)), rng.normal(size=3)
    dact, dact2 = rng.normal(size=(2, 5, 3)), rng.normal(size=(2, 5, 3)) if two_grads else None
    f = lambda: np.sum(conv1d_silu(x, w, b) * (dact if dact2 is None else dact + dact2))
    dx, dw, db = conv1d_silu_backward(x, w, b, dact, dact2)
    assert max(check_grad(f, x, dx), check_grad(f, w, dw), check_grad(f, b, db)) < TOL


def test_conv1d_taps_are_pytorch_order():
    """y_t = Σ_k w[k] x[t - K + 1 + k]: the last tap multiplies the current input."""
    x = np.zeros((1, 4, 1))
    x[0, 1, 0] = 1.0
    y = conv1d(x, np.array([[[1.0, 2.0, 3.0]]]))
    assert y[0, :, 0].tolist() == [0.0, 3.0, 2.0, 1.0]


def test_column_slice(rng):
    x, dy = rng.normal(size=(4, 7)), rng.normal(size=(4, 3))
    dx = column_slice_backward(dy, 2, 7)
    assert check_grad(lambda: np.sum(column_slice(x, 2, 3) * dy), x, dx) < TOL


def test_cross_entropy(rng):
    logits = rng.normal(size=(6, 5)) * 3
    targets = np.array([0, 4, -100, 2, -100, 1])
    dl = cross_entropy_backward(logits, targets)
    assert check_grad(lambda: cross_entropy(logits, targets), logits, dl) < TOL
    assert np.all(dl[targets == -100] == 0)
    keep = targets != -100
    p = np.exp(logits[keep]) / np.exp(logits[keep]).sum(1, keepdims=True)
    assert np.isclose(cross_entropy(logits, targets), -np.mean(np.log(p[np.arange(4), targets[keep]])), rtol=1e-14)


def test_embedding(rng):
    table, ids, dy = rng.normal(size=(6, 3)), np.array([1, 4, 1, 0, 1]), rng.normal(size=(5, 3))
    d_table = embedding_backward(ids, dy, 6)
    assert check_grad(lambda: np.sum(embedding(ids, table) * dy), table, d_table) < TOL
