"""Uncertainty of acceptance numbers: bootstrap intervals over prompts, and small cells.

Steps of one prompt are not independent (a prompt that copies its input accepts long
runs at every step), so the unit of resampling is the prompt, not the step: each
bootstrap replicate draws the group's prompts with replacement and recomputes the
pooled ratio (tau = 1 + accepted / steps, acceptance rate = accepted / drafted) from the
drawn prompts' sums. The percentile interval of the replicates is reported next to the
point estimate of :func:`specviz.metrics.acceptance_summary`.

A cell with few prompts or few steps is marked ``small``: its interval is wide (or, with
a single prompt, undefined) and figures should not let it set a colour scale
(:func:`robust_range`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

from specviz.metrics.acceptance import acceptance_summary, step_groups
from specviz.validate import check_int

__all__ = ["bootstrap_ratio", "bootstrap_summary", "robust_range", "interval_text"]


def bootstrap_ratio(numerators: Sequence[float], denominators: Sequence[float], *, n_resamples: int = 2000,
                    confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of ``sum(numerators) / sum(denominators)`` over clusters drawn
    with replacement (one entry per cluster, e.g. per prompt).

    Returns ``(low, high)``; NaN for fewer than two clusters (no spread to resample).
    """
    num = np.asarray(numerators, dtype=float)
    den = np.asarray(denominators, dtype=float)
    if num.shape != den.shape or num.ndim != 1:
        raise ValueError(f"numerators and denominators must be equal-length 1-d sequences, got {num.shape} and {den.shape}")
    check_int("n_resamples", n_resamples)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    n = len(num)
    if n < 2:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n, size=(n_resamples, n))  # (R, n) cluster indices
    weights = np.zeros((n_resamples, n))
    np.add.at(weights, (np.arange(n_resamples)[:, None], draws), 1.0)  # (R, n) times each cluster is drawn
    top, bottom = weights @ num, weights @ den
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = top / bottom
    ratios = ratios[np.isfinite(ratios)]
    if not len(ratios):
        return math.nan, math.nan
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return float(low), float(high)


def bootstrap_summary(steps: pd.DataFrame, by: Sequence[str], *, cluster: str = "question_id",
                      n_resamples: int = 2000, confidence: float = 0.95, seed: int = 0,
                      min_prompts: int = 3, min_steps: int = 30) -> pd.DataFrame:
    """:func:`~specviz.metrics.acceptance_summary` plus bootstrap intervals over prompts.

    Adds ``tau_low``, ``tau_high``, ``acceptance_rate_low``, ``acceptance_rate_high``
    (the ``confidence`` percentile interval over ``cluster`` resamples; NaN with one
    prompt) and ``small`` (fewer than ``min_prompts`` prompts or ``min_steps`` steps).
    Every group gets its own reproducible stream (``seed`` and the group's index).
    """
    by = list(by)
    if cluster not in steps.columns:
        raise ValueError(f"step table lacks the cluster column {cluster!r} (the prompt id the bootstrap resamples)")
    check_int("min_prompts", min_prompts)
    check_int("min_steps", min_steps, minimum=0)
    summary = acceptance_summary(steps, by)
    per_prompt = steps.groupby(by + [cluster], sort=False).agg(
        steps=("step", "size"), accepted=("accepted", "sum"), drafted=("drafted", "sum")).reset_index()
    groups = dict(step_groups(per_prompt, by))
    columns = {name: [] for name in ("tau_low", "tau_high", "acceptance_rate_low", "acceptance_rate_high")}
    for i, row in enumerate(summary[by].itertuples(index=False, name=None)):
        part = groups[tuple(row)]
        lo, hi = bootstrap_ratio(part["accepted"], part["steps"], n_resamples=n_resamples, confidence=confidence,
                                 seed=seed + i)
        columns["tau_low"].append(lo + 1.0)
        columns["tau_high"].append(hi + 1.0)
        lo, hi = bootstrap_ratio(part["accepted"], part["drafted"], n_resamples=n_resamples, confidence=confidence,
                                 seed=seed + i)
        columns["acceptance_rate_low"].append(lo)
        columns["acceptance_rate_high"].append(hi)
    for name, values in columns.items():
        summary[name] = pd.Series(values, index=summary.index, dtype=float)
    summary["small"] = (summary["sequences"] < min_prompts) | (summary["steps"] < min_steps)
    return summary


def robust_range(values: pd.Series, small: pd.Series | None = None) -> tuple[float, float]:
    """Colour-scale bounds from the cells that are not ``small`` (all cells if every one
    is small), so a cell resting on a few steps cannot stretch the scale."""
    values = pd.Series(values, dtype=float)
    kept = values if small is None or bool(pd.Series(small).all()) else values[~pd.Series(small, index=values.index)]
    kept = kept[np.isfinite(kept)]
    if not len(kept):
        return 0.0, 1.0
    return float(kept.min()), float(kept.max())


def interval_text(estimate: float, low: float = math.nan, high: float = math.nan, small: bool = False,
                  digits: int = 2) -> str:
    """An estimate with its interval as tables print it, ``4.36 [2.67, 12.00]``, starred
    (``*``) when the cell is small; the interval is left out when it is NaN."""
    text = f"{estimate:.{digits}f}" + ("" if pd.isna(low) else f" [{low:.{digits}f}, {high:.{digits}f}]")
    return text + ("*" if small else "")
