import numpy as np


def sum_of_squares(x):
    """Σ x² over every element (the squared global gradient norm)."""
    return float(np.sum(np.asarray(x, dtype=np.float64) ** 2))
