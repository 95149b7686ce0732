"""Acceptance metrics: turn step records into the numbers a study reports.

Definitions (every number says which one it is):

* **drafted tokens** - draft nodes proposed (root excluded), summed over steps;
* **accepted tokens** - draft tokens on the accepted paths, summed over steps;
* **acceptance rate** = accepted / drafted (small for trees by design: always read it
  next to tau);
* **tau** = tokens committed per target call including the bonus token: Spec-Bench's
  "#MAT", the "mean acceptance length" of EAGLE and vLLM;
* **accepted per step** = tau - 1, accepted draft tokens per step (per target call);
* **alpha_d** (per-depth acceptance) = P(a token is accepted at depth d | the accepted
  path reached depth d - 1 and the tree had a candidate there);
* **expected accepted** - the mean over steps of the exact expected accepted draft
  tokens that :mod:`specviz.verify` computes from the step's target forward; next to
  the realised accepted per step it shows whether a run was lucky.

One implementation serves both views of a run: :func:`acceptance_numbers` and
:func:`per_depth_counts` compute the definitions from the counts of
:class:`~specviz.decode.StepRecord` objects, whether they come from live traces
(:func:`summarize_steps`, :func:`summarize`, one frozen :class:`AcceptanceStats` per
(drafter, verifier)) or from tables of replayed steps (:func:`records_table`,
:func:`acceptance_summary`, :func:`per_depth_table`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Iterable, Sequence

import pandas as pd

from specviz.decode.records import GenerationResult, StepRecord, StepTrace, records_from_steps

__all__ = [
    "acceptance_numbers",
    "per_depth_counts",
    "AcceptanceStats",
    "per_depth_acceptance",
    "summarize_steps",
    "summarize",
    "to_records",
    "to_frame",
    "label_rows",
    "records_table",
    "acceptance_summary",
    "per_depth_table",
    "check_step_table",
    "step_groups",
    "tau_distribution",
    "per_position_acceptance",
    "budget_fill",
]


# -- the definitions ------------------------------------------------------------------------------

def acceptance_numbers(drafted: int, accepted: int, steps: int) -> tuple[float, float, float]:
    """``(acceptance_rate, accepted_per_step, tau)`` of ``steps`` steps that drafted
    ``drafted`` and accepted ``accepted`` draft tokens (NaN where a count is 0)."""
    rate = accepted / drafted if drafted else math.nan
    length = accepted / steps if steps else math.nan
    return rate, length, length + 1.0


def per_depth_counts(accepted: Iterable[int], extendable: Iterable[bool]) -> tuple[list[int], list[int]]:
    """Trials and successes of the per-depth acceptance, indexed by depth - 1.

    A step that accepted ``a`` draft tokens is a success at depths ``1..a`` and, when
    ``extendable`` (the last accepted node had children), a failure at depth ``a + 1``;
    a path that ends at a leaf offers no trial below it.
    """
    trials: list[int] = []
    wins: list[int] = []
    for a, more in zip(accepted, extendable):
        deepest = a + 1 if more else a
        while len(trials) < deepest:
            trials.append(0)
            wins.append(0)
        for d in range(a):
            trials[d] += 1
            wins[d] += 1
        if more:
            trials[a] += 1
    return trials, wins


# -- per-trace view -------------------------------------------------------------------------------

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
        accepted_per_step: accepted draft tokens per step (realised).
        tau: accepted_per_step + 1, tokens committed per target call.
        expected_accepted: mean exact expected accepted tokens per step.
        alpha: per-depth acceptance alpha_d for d = 1, 2, ...
        alpha_trials: steps behind each alpha_d (the path reached depth d - 1 and the
            tree had a candidate at depth d).
        draft_time_s: total drafter wall time.
        verify_time_s: total verification wall time.
        wall_s: total wall time of the sequences (each result's own clock).
    """

    strategy: str
    verifier: str
    n_sequences: int
    n_steps: int
    new_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    accepted_per_step: float
    tau: float
    expected_accepted: float
    alpha: tuple[float, ...]
    alpha_trials: tuple[int, ...]
    draft_time_s: float
    verify_time_s: float
    wall_s: float

    @property
    def tokens_per_second(self) -> float:
        """new_tokens / wall_s (meaningful for sequences timed one at a time)."""
        return self.new_tokens / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def tokens_per_step(self) -> float:
        """new_tokens / n_steps: tau as the output realises it (lower than :attr:`tau`
        when an end-of-sequence token cut a step's tokens)."""
        return self.new_tokens / self.n_steps if self.n_steps else math.nan


def per_depth_acceptance(steps: Iterable[StepTrace]) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """Per-depth acceptance alpha_d and the number of trials behind each
    (:func:`per_depth_counts` of the steps' records).

    Returns:
        ``(alpha, trials)``, both indexed by d - 1, up to the deepest depth with a trial.
    """
    return _alpha(records_from_steps(list(steps)))


def _alpha(records: Sequence[StepRecord]) -> tuple[tuple[float, ...], tuple[int, ...]]:
    trials, wins = per_depth_counts([r.accepted for r in records], [r.extendable for r in records])
    return tuple(w / t for w, t in zip(wins, trials)), tuple(trials)


def summarize_steps(steps: Sequence[StepTrace], *, strategy: str | None = None, verifier: str | None = None,
                    n_sequences: int = 0, new_tokens: int | None = None, wall_s: float = 0.0) -> AcceptanceStats:
    """Aggregate bare steps into :class:`AcceptanceStats`.

    Args:
        steps: the steps (of one strategy).
        strategy, verifier: labels (default: taken from the first step).
        n_sequences, new_tokens, wall_s: sequence-level numbers when known
            (``new_tokens`` defaults to the committed tokens of the steps).
    """
    steps = list(steps)
    records = records_from_steps(steps)
    n = len(records)
    drafted = sum(r.drafted for r in records)
    accepted = sum(r.accepted for r in records)
    rate, length, tau = acceptance_numbers(drafted, accepted, n)
    alpha, trials = _alpha(records)
    return AcceptanceStats(
        strategy=strategy if strategy is not None else (steps[0].drafter if steps else ""),
        verifier=verifier if verifier is not None else (steps[0].acceptance.rule if steps else ""),
        n_sequences=n_sequences, n_steps=n,
        new_tokens=new_tokens if new_tokens is not None else sum(r.committed for r in records),
        drafted_tokens=drafted, accepted_tokens=accepted,
        acceptance_rate=rate, accepted_per_step=length, tau=tau,
        expected_accepted=sum(s.expected_accepted for s in steps) / n if n else math.nan,
        alpha=alpha, alpha_trials=trials,
        draft_time_s=sum(s.draft_time_s for s in steps),
        verify_time_s=sum(s.verify_time_s for s in steps),
        wall_s=wall_s,
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
                        wall_s=sum(r.wall_s for r in rs))
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


def to_frame(stats: Iterable[AcceptanceStats]) -> pd.DataFrame:
    """A ``pandas.DataFrame`` of :func:`to_records`, one row per strategy."""
    return pd.DataFrame.from_records(to_records(stats))


# -- tables of step records -----------------------------------------------------------------------

def label_rows(items: Iterable, **labels) -> list[dict]:
    """Dataclass items as row dicts with constant ``labels`` first (for tidy tables)."""
    return [{**labels, **asdict(item)} for item in items]


def records_table(records: Sequence[StepRecord], **labels) -> pd.DataFrame:
    """Records as a tidy table, one row per step, with ``labels`` as constant columns
    (e.g. ``strategy="chain", budget=8, question_id=3``)."""
    columns = list(labels) + [f.name for f in fields(StepRecord)]
    return pd.DataFrame(label_rows(records, **labels), columns=columns)


def check_step_table(steps: pd.DataFrame, by: Sequence[str], needed: Sequence[str]) -> list[str]:
    """``by`` as a list, after checking that the step table has ``by`` and ``needed``
    (a ``ValueError`` names the missing columns)."""
    by = list(by)
    missing = [c for c in by + list(needed) if c not in steps.columns]
    if missing:
        raise ValueError(f"step table lacks columns {missing}; build it with records_table")
    return by


def step_groups(steps: pd.DataFrame, by: Sequence[str]):
    """``(key, rows)`` per group of step rows in order of appearance, ``key`` always a
    tuple of the ``by`` values; without ``by``, the whole table as one group ``()``."""
    if not by:
        yield (), steps
        return
    for key, group in steps.groupby(list(by), sort=False):
        yield (key if isinstance(key, tuple) else (key,)), group


def acceptance_summary(steps: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """Acceptance numbers per group of step rows (:func:`records_table`).

    Columns: ``by`` + ``sequences`` (distinct ``question_id``), ``steps``, ``new_tokens``,
    ``drafted_tokens``, ``accepted_tokens``, ``acceptance_rate``, ``accepted_per_step``,
    ``tau`` (:func:`acceptance_numbers`) and ``mean_depth`` (of the verified trees).
    """
    by = check_step_table(steps, by, ["accepted", "drafted", "committed", "depth"])
    agg = steps.groupby(by, sort=False).agg(
        sequences=("question_id", "nunique") if "question_id" in steps.columns else ("step", "size"),
        steps=("step", "size"), new_tokens=("committed", "sum"), drafted_tokens=("drafted", "sum"),
        accepted_tokens=("accepted", "sum"), mean_depth=("depth", "mean")).reset_index()
    numbers = [acceptance_numbers(int(d), int(a), int(n))
               for d, a, n in zip(agg["drafted_tokens"], agg["accepted_tokens"], agg["steps"])]
    for i, name in enumerate(("acceptance_rate", "accepted_per_step", "tau")):
        agg[name] = pd.Series([x[i] for x in numbers], index=agg.index, dtype=float)
    return agg[by + ["sequences", "steps", "new_tokens", "drafted_tokens", "accepted_tokens", "acceptance_rate",
                     "accepted_per_step", "tau", "mean_depth"]]


def per_depth_table(steps: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """Per-depth acceptance alpha_d per group of step rows (:func:`per_depth_counts`).

    Columns: ``by`` + ``depth``, ``trials``, ``accepted``, ``alpha``.
    """
    by = list(by)
    rows = []
    for key, group in step_groups(steps, by):
        trials, wins = per_depth_counts(group["accepted"].tolist(), group["extendable"].tolist())
        rows += [(*key, d + 1, t, w) for d, (t, w) in enumerate(zip(trials, wins))]
    table = pd.DataFrame(rows, columns=by + ["depth", "trials", "accepted"])
    table["alpha"] = table["accepted"] / table["trials"]
    return table.sort_values(by + ["depth"], kind="stable").reset_index(drop=True)


def tau_distribution(steps: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """Distribution of tokens per step (accepted + 1, the per-step tau) per group of step rows.

    Columns: ``by`` + ``tokens`` (1, 2, ... up to the group's longest step; counts of 0
    kept, so histograms show their gaps), ``steps`` (steps with that many tokens),
    ``share`` (of the group's steps) and ``total_steps``.
    """
    by = check_step_table(steps, by, ["accepted"])
    rows = []
    for key, group in step_groups(steps, by):
        counts = (group["accepted"].astype(int) + 1).value_counts()
        total = int(len(group))
        for tokens in range(1, int(counts.index.max()) + 1):
            n = int(counts.get(tokens, 0))
            rows.append((*key, tokens, n, n / total, total))
    return pd.DataFrame(rows, columns=by + ["tokens", "steps", "share", "total_steps"])


def per_position_acceptance(steps: pd.DataFrame, by: Sequence[str], max_position: int | None = None) -> pd.DataFrame:
    """Per-position acceptance per group of step rows, as vLLM and llama.cpp report it.

    ``rate`` at draft position ``k`` = share of steps whose ``k``-th draft token was
    accepted (steps accepting ``k`` or more). Unlike ``alpha_d`` (:func:`per_depth_table`)
    it is not conditioned on reaching depth ``k - 1``: the product of the alphas up to
    ``k`` for trees that always offer a candidate.

    Columns: ``by`` + ``draft_position`` (1 ..), ``steps`` (of the group), ``accepted``
    (steps that accepted a token there), ``rate``.
    """
    by = check_step_table(steps, by, ["accepted"])
    rows = []
    for key, group in step_groups(steps, by):
        accepted = group["accepted"].astype(int)
        deepest = int(accepted.max()) if len(accepted) else 0
        if max_position is not None:
            deepest = min(deepest, max_position)
        for k in range(1, deepest + 1):
            hits = int((accepted >= k).sum())
            rows.append((*key, k, int(len(group)), hits, hits / len(group)))
    return pd.DataFrame(rows, columns=by + ["draft_position", "steps", "accepted", "rate"])


def budget_fill(steps: pd.DataFrame, by: Sequence[str], max_new_tokens: int | None = None) -> pd.DataFrame:
    """How much of its budget a drafter really drafted, per group of step rows with a ``budget`` column.

    ``fill`` = drafted tokens / (steps x budget), over the steps whose room allowed the
    whole budget (``position + budget < max_new_tokens``: near the end of a generation
    every replay trims its tree to the tokens left, which says nothing about the
    drafter). A fill below 1 means the drafter could not fill its budget: a dynamic
    tree's frontier is narrower than the budget, an n-gram draft found no match.

    Columns: ``by`` + ``eligible_steps``, ``mean_drafted`` (per eligible step), ``fill``
    (NaN when no step had the room).
    """
    by = check_step_table(steps, by, ["drafted", "budget", "position"])
    eligible = (steps["position"] + steps["budget"] < max_new_tokens) if max_new_tokens is not None \
        else pd.Series(True, index=steps.index)
    rows = []
    for key, group in step_groups(steps, by):
        part = group[eligible[group.index]]
        n = len(part)
        mean = float(part["drafted"].mean()) if n else math.nan
        budget = float(group["budget"].iloc[0])
        rows.append((*key, n, mean, mean / budget if n else math.nan))
    return pd.DataFrame(rows, columns=by + ["eligible_steps", "mean_drafted", "fill"])
