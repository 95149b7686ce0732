"""Calibration of a draft: does its confidence in a node match how often the target accepts it?

Dynamic trees (EAGLE-2) and adaptive chains spend their budget where the draft is
confident, which only pays if the draft's probabilities mean what they say. Under greedy
verification a draft node whose parent lies on the accepted path is accepted iff it
holds the target's token, so teacher-forced top-``k`` candidates
(:func:`specviz.decode.draft_candidates`) give one (confidence, accepted) outcome per
reachable candidate: :func:`candidate_outcomes` lays them out,
:func:`calibration_bins` draws the reliability diagram's bins and
:func:`expected_calibration_error` summarises it (ECE: the share-weighted mean gap
between confidence and acceptance over the bins).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from specviz.validate import check_int

__all__ = ["candidate_outcomes", "calibration_bins", "expected_calibration_error"]


def candidate_outcomes(probs: torch.Tensor, ranks: torch.Tensor, **labels) -> pd.DataFrame:
    """One row per (position, candidate rank): the draft's confidence and whether the
    target accepts that candidate when its parent is reached.

    Args:
        probs: ``(T, k)`` top-``k`` draft probabilities per position.
        ranks: ``(T,)`` rank of the target's token (``>= k``: none of the candidates).
        labels: constant columns put first (e.g. ``pair=...``, ``question_id=...``).

    Returns:
        Columns ``labels`` + ``position``, ``rank`` (1-based), ``confidence``, ``accepted``.
    """
    probs = torch.as_tensor(probs, dtype=torch.float32)
    ranks = torch.as_tensor(ranks).long()
    if probs.dim() != 2 or ranks.shape != probs.shape[:1]:
        raise ValueError(f"need probs (T, k) and ranks (T,), got {tuple(probs.shape)} and {tuple(ranks.shape)}")
    t, k = probs.shape
    hit = ranks[:, None] == torch.arange(k)[None, :]  # (T, k)
    frame = pd.DataFrame({
        "position": np.repeat(np.arange(t), k), "rank": np.tile(np.arange(1, k + 1), t),
        "confidence": probs.reshape(-1).numpy().astype(float), "accepted": hit.reshape(-1).numpy()})
    for i, (name, value) in enumerate(labels.items()):
        frame.insert(i, name, value)
    return frame


def calibration_bins(outcomes: pd.DataFrame, by: Sequence[str] = (), *, bins: int = 10) -> pd.DataFrame:
    """Reliability-diagram bins of ``outcomes`` (:func:`candidate_outcomes`) per group.

    Confidence is cut into ``bins`` equal-width bins on [0, 1]. Columns: ``by`` +
    ``bin``, ``low``, ``high``, ``count``, ``confidence`` (mean in the bin), ``acceptance``
    (share accepted), ``share`` (of the group's outcomes). Empty bins are left out.
    """
    by = list(by)
    check_int("bins", bins)
    missing = [c for c in by + ["confidence", "accepted"] if c not in outcomes.columns]
    if missing:
        raise ValueError(f"outcome table lacks columns {missing}; build it with candidate_outcomes")
    edges = np.linspace(0.0, 1.0, bins + 1)
    index = np.clip(np.digitize(outcomes["confidence"].to_numpy(float), edges[1:-1], right=False), 0, bins - 1)
    frame = outcomes.assign(bin=index, accepted=outcomes["accepted"].astype(float))
    table = frame.groupby(by + ["bin"], sort=True).agg(
        count=("accepted", "size"), confidence=("confidence", "mean"), acceptance=("accepted", "mean")).reset_index()
    table.insert(len(by) + 1, "low", edges[table["bin"].to_numpy()])
    table.insert(len(by) + 2, "high", edges[table["bin"].to_numpy() + 1])
    totals = table.groupby(by)["count"].transform("sum") if by else table["count"].sum()
    table["share"] = table["count"] / totals
    return table


def expected_calibration_error(table: pd.DataFrame, by: Sequence[str] = ()) -> pd.DataFrame | float:
    """ECE of :func:`calibration_bins`: sum over bins of share x |acceptance - confidence|.

    Returns a float without ``by``, else a table with ``by`` + ``ece``, ``outcomes``.
    """
    by = list(by)
    gap = (table["acceptance"] - table["confidence"]).abs() * table["share"]
    if not by:
        return float(gap.sum()) if len(table) else math.nan
    out = table.assign(gap=gap).groupby(by, sort=False).agg(ece=("gap", "sum"), outcomes=("count", "sum"))
    return out.reset_index()
