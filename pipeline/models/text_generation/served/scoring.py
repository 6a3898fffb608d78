"""Log-probabilities for scoring: float64 log-softmax and the top-k ids of one row."""
import numpy as np


def log_softmax(rows):
    """float64 log-softmax over the last axis of ``rows`` [..., vocab]."""
    x = np.asarray(rows, np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - (top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True)))


def top_logprobs(row, k):
    """The ``k`` most likely [id, logprob] pairs of one log-softmax row, most likely first."""
    if k <= 0:
        return []
    ids = np.argpartition(-row, k - 1)[:k]
    ids = ids[np.argsort(-row[ids], kind="stable")]
    return [[int(i), float(row[i])] for i in ids]

