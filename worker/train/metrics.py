"""Metrics of a click model on a held-out split: ROC AUC and log loss, the figures recommendation jobs report."""

from __future__ import annotations

import numpy as np


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC of `scores` for the 0/1 `labels`: the chance that a random positive scores above a random negative
    (ties count half), by the rank-sum formula; 0.5 where the labels are all one class. Equals scikit-learn's
    roc_auc_score, without needing it."""
    positive = np.asarray(labels).reshape(-1) != 0
    values = np.asarray(scores, dtype=np.float64).reshape(-1)
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return 0.5
    order = np.argsort(values, kind="stable")
    _, first, counts = np.unique(values[order], return_index=True, return_counts=True)
    ranks = np.empty(len(values))
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)  # tied scores share their average (1-based) rank
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
