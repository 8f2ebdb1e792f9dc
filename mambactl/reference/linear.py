

def linear(x, w, b=None):
    """x [M, K], w [N, K], b [N] -> y [M, N] = x wᵀ + b."""
    y = x @ w.T
    return y if b is None else y + b


def linear_backward(x, w, dy):
    """-> (dx [M, K] = dy w, dw [N, K] = dyᵀ x, db [N] = Σ_m dy)."""
    return dy @ w, dy.T @ x, dy.sum(axis=0)
