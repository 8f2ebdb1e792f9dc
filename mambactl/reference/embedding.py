import numpy as np


def embedding(ids, table):
    """ids [T] ints, table [V, D] -> [T, D]."""
    return table[ids]


def embedding_backward(ids, dy, vocab_size):
    """Scatter-add: d_table[v] = Σ_{t: ids[t] = v} dy[t]. -> [V, D]."""
    d_table = np.zeros((vocab_size, dy.shape[1]), dtype=dy.dtype)
    np.add.at(d_table, ids, dy)
    return d_table
