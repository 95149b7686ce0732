"""Acceptance metrics: turn step traces into the numbers a study reports.

Definitions (SPECDEC.md section 1; every number says which one it is):

* **drafted tokens** - draft nodes proposed (root excluded), summed over steps;
* **accepted tokens** - draft tokens on the accepted paths, summed over steps;
* **acceptance rate** = accepted / drafted (small for trees by design: always read it
  next to the acceptance length);
* **acceptance length** = accepted draft tokens per step (per target call);
* **tau** = acceptance length + 1, tokens committed per target call (EAGLE's "average
  acceptance length", Spec-Bench's "#MAT");
* **alpha_d** (per-depth acceptance) = P(a token is accepted at depth d | the accepted
  path reached depth d - 1 and the tree had a candidate there);
* **expected acceptance length** - the mean over steps of the exact expectation that
  :mod:`specviz.verify` computes from the step's target forward; next to the realised
  acceptance length it shows whether a run was lucky.

:func:`summarize` groups :class:`~specviz.decode.GenerationResult` objects by
(drafter, verifier) and returns one frozen :class:`AcceptanceStats` per group;
:func:`to_records` / :func:`to_frame` flatten them for pandas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Iterable, Sequence

import torch

from specviz.decode.engine import GenerationResult, StepTrace

__all__ = ["AcceptanceStats", "per_depth_acceptance", "summarize_steps", "summarize", "to_records", "to_frame"]


@dataclass(frozen=True)
class AcceptanceStats:
    """Acceptance numbers of one strategy (drafter + verifier) over some steps.

    Attributes:
        strategy: the drafter's name.
        verifier: the verification rule.
        n_sequences: generated sequences aggregated (0 when built from bare steps).
        n_steps: speculative steps (target calls after the prompt).
        new_tokens: tokens generated (after truncation at end-of-sequence / budget).
        drafted_tokens: draft nodes proposed, root excluded.
        accepted_tokens: draft tokens accepted.
        acceptance_rate: accepted / drafted (NaN when nothing was drafted).
        acceptance_length: accepted draft tokens per step (realised).
        tau: acceptance_length + 1, tokens committed per target call.
        expected_accept_length: mean exact expected accepted tokens per step.
        alpha: per-depth acceptance alpha_d for d = 1, 2, ...
        alpha_trials: steps behind each alpha_d (the path reached depth d - 1 and the
            tree had a candidate at depth d).
        draft_time_s: total drafter wall time.
        verify_time_s: total verification wall time.
        wall_time_s: total wall time of the sequences (each result's own clock).
    """

    strategy: str
    verifier: str
    n_sequences: int
    n_steps: int
    new_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    acceptance_length: float
    tau: float
    expected_accept_length: float
    alpha: tuple[float, ...]
    alpha_trials: tuple[int, ...]
    draft_time_s: float
    verify_time_s: float
    wall_time_s: float

    @property
    def tokens_per_second(self) -> float:
        """new_tokens / wall_time_s (meaningful for sequences timed one at a time)."""
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else math.nan


def per_depth_acceptance(steps: Iterable[StepTrace]) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """Per-depth acceptance alpha_d and the number of trials behind each.

    A step is a trial at depth d when its accepted path reached depth d - 1 and the node
    it reached there has at least one child; it is a success when the path goes on to
    depth d.

    Returns:
        ``(alpha, trials)``, both indexed by d - 1, up to the deepest depth with a trial.
    """
    trials: list[int] = []
    wins: list[int] = []
    for step in steps:
        n_children = torch.bincount(step.tree.parents[1:], minlength=step.tree.n_nodes).tolist()
        path = (0,) + step.acceptance.accepted_nodes
        for d in range(1, len(path) + 1):
            if n_children[path[d - 1]] == 0:
                break
            if len(trials) < d:
                trials.append(0)
                wins.append(0)
            trials[d - 1] += 1
            wins[d - 1] += 1 if d < len(path) else 0
    return tuple(w / t for w, t in zip(wins, trials)), tuple(trials)


def summarize_steps(steps: Sequence[StepTrace], *, strategy: str | None = None, verifier: str | None = None,
                    n_sequences: int = 0, new_tokens: int | None = None,
                    wall_time_s: float = 0.0) -> AcceptanceStats:
    """Aggregate bare steps into :class:`AcceptanceStats`.

    Args:
        steps: the steps (of one strategy).
        strategy, verifier: labels (default: taken from the first step).
        n_sequences, new_tokens, wall_time_s: sequence-level numbers when known
            (``new_tokens`` defaults to the committed tokens of the steps).
    """
    steps = list(steps)
    n = len(steps)
    drafted = sum(s.tree.budget for s in steps)
    accepted = sum(s.acceptance.accept_length for s in steps)
    alpha, trials = per_depth_acceptance(steps)
    length = accepted / n if n else math.nan
    return AcceptanceStats(
        strategy=strategy if strategy is not None else (steps[0].drafter if steps else ""),
        verifier=verifier if verifier is not None else (steps[0].acceptance.rule if steps else ""),
        n_sequences=n_sequences, n_steps=n,
        new_tokens=new_tokens if new_tokens is not None else accepted + n,
        drafted_tokens=drafted, accepted_tokens=accepted,
        acceptance_rate=accepted / drafted if drafted else math.nan,
        acceptance_length=length, tau=length + 1.0,
        expected_accept_length=sum(s.expected_accept_length for s in steps) / n if n else math.nan,
        alpha=alpha, alpha_trials=trials,
        draft_time_s=sum(s.draft_time_s for s in steps),
        verify_time_s=sum(s.verify_time_s for s in steps),
        wall_time_s=wall_time_s,
    )


def summarize(results: Iterable[GenerationResult]) -> tuple[AcceptanceStats, ...]:
    """One :class:`AcceptanceStats` per (drafter, verifier), in order of first appearance."""
    groups: dict[tuple[str, str], list[GenerationResult]] = {}
    for r in results:
        if not isinstance(r, GenerationResult):
            raise TypeError(f"summarize takes GenerationResult objects, got {type(r).__name__}")
        groups.setdefault((r.drafter, r.verifier), []).append(r)
    return tuple(
        summarize_steps([s for r in rs for s in r.steps], strategy=drafter, verifier=verifier,
                        n_sequences=len(rs), new_tokens=sum(r.n_new_tokens for r in rs),
                        wall_time_s=sum(r.wall_time_s for r in rs))
        for (drafter, verifier), rs in groups.items())


def to_records(stats: Iterable[AcceptanceStats]) -> list[dict]:
    """Flat dicts, one per strategy, with ``alpha_1, alpha_2, ...`` columns (for pandas)."""
    stats = list(stats)
    depth = max((len(s.alpha) for s in stats), default=0)
    records = []
    for s in stats:
        row = {f.name: getattr(s, f.name) for f in fields(s) if f.name not in ("alpha", "alpha_trials")}
        row["tokens_per_second"] = s.tokens_per_second
        for d in range(depth):
            row[f"alpha_{d + 1}"] = s.alpha[d] if d < len(s.alpha) else math.nan
        records.append(row)
    return records


def to_frame(stats: Iterable[AcceptanceStats]):
    """A ``pandas.DataFrame`` of :func:`to_records`, one row per strategy."""
    import pandas as pd

    return pd.DataFrame.from_records(to_records(stats))
