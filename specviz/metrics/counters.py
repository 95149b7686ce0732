"""The common record of speculative-decoding counters, whichever tool printed them.

:class:`ExternalCounters` holds one run's (or one logged interval's) counts and ratios, NaN
where the tool printed nothing they follow from; :func:`complete_counters` derives what
follows exactly from the printed numbers. :func:`counters_from_steps` turns step tables
(specviz's or Spec-Bench's) into the same record, and :func:`counters_table` lays any number
of them side by side with the column names of specviz's summaries. The conventions are those
of :mod:`specviz.metrics.external`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Iterable, Sequence

import pandas as pd

from specviz.metrics.acceptance import check_step_table, per_position_acceptance, step_groups

__all__ = ["POSITION_PREFIX", "ExternalCounters", "complete_counters", "recovered_steps", "combine_intervals",
           "counters_from_steps", "counters_table"]

#: prefix of the per-position acceptance columns of :func:`counters_table` (``p_accept_1``, ...)
POSITION_PREFIX = "p_accept_"


@dataclass(frozen=True)
class ExternalCounters:
    """Speculative-decoding counters of one run (or one logged interval) of some tool.

    Every count is a float so that a number the tool did not print, and that cannot be derived
    exactly from what it printed, is NaN rather than a guess.

    Attributes:
        source: the tool (``"vllm"``, ``"vllm-v0"``, ``"sglang"``, ``"llama.cpp"``,
            ``"spec-bench"``, ``"specviz"``).
        label: a name for the run (a file name by default).
        steps: target verification steps, one per sequence and step (vLLM's "drafts").
        drafted: draft tokens verified.
        accepted: draft tokens accepted on the accepted path.
        emitted: tokens committed, accepted + one bonus (or correction) token per step.
        tau: tokens committed per step including the bonus token.
        acceptance_rate: accepted / drafted.
        per_position: P(accepted >= k) for k = 1, 2, ... (empty when unknown).
        num_speculative_tokens: the draft length the tool was configured with, when printed.
        intervals: log records (interval lines, runs) these numbers aggregate.
        given: the attributes the tool printed directly (or, over several log records, sums
            of printed counts); every other finite attribute is derived from them.
    """

    source: str
    label: str
    steps: float = math.nan
    drafted: float = math.nan
    accepted: float = math.nan
    emitted: float = math.nan
    tau: float = math.nan
    acceptance_rate: float = math.nan
    per_position: tuple[float, ...] = ()
    num_speculative_tokens: float = math.nan
    intervals: int = 1
    given: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """Hold every number as a float and check that ``given`` names attributes."""
        for name in ("steps", "drafted", "accepted", "emitted", "tau", "acceptance_rate", "num_speculative_tokens"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "per_position", tuple(float(p) for p in self.per_position))
        object.__setattr__(self, "given", tuple(self.given))
        unknown = set(self.given) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"given names unknown attributes {sorted(unknown)}")

    @property
    def accepted_per_step(self) -> float:
        """tau - 1, accepted draft tokens per step."""
        return self.tau - 1.0

    @property
    def derived(self) -> tuple[str, ...]:
        """The attributes that hold a number derived from the printed ones."""
        out = []
        for f in fields(self):
            if f.name in ("source", "label", "intervals", "given") or f.name in self.given:
                continue
            value = getattr(self, f.name)
            known = bool(value) if isinstance(value, tuple) else not math.isnan(value)
            if known:
                out.append(f.name)
        return tuple(out)


def complete_counters(c: ExternalCounters) -> ExternalCounters:
    """``c`` with every number that follows exactly from the others filled in (where it is
    not known yet): emitted = accepted + steps, tau = 1 + accepted / steps, acceptance rate = accepted / drafted."""
    v = {f.name: getattr(c, f.name) for f in fields(c)}

    def fill(name: str, value: float) -> None:
        if math.isnan(v[name]) and math.isfinite(value):
            v[name] = value

    for _ in range(2):
        s, d, a, e = v["steps"], v["drafted"], v["accepted"], v["emitted"]
        fill("emitted", a + s)
        fill("accepted", e - s)
        fill("steps", e - a)
        if v["steps"] > 0:
            fill("tau", 1.0 + v["accepted"] / v["steps"])
        if d > 0:
            fill("acceptance_rate", v["accepted"] / d)
    return ExternalCounters(**v)


def recovered_steps(c: ExternalCounters) -> float:
    """``c.steps`` where known, else the steps recovered from its printed (rounded) ratios:
    accepted over the sum of the per-position rates (as P(accepted >= k) they add up to tau - 1),
    else over tau - 1; NaN when neither is printed."""
    if not math.isnan(c.steps):
        return c.steps
    if c.accepted == 0:
        return 0.0 if c.drafted == 0 else math.nan
    ratio = sum(c.per_position) if c.per_position else c.tau - 1.0
    return c.accepted / ratio if ratio > 0 else math.nan


def combine_intervals(parts: Sequence[ExternalCounters], source: str, label: str) -> ExternalCounters:
    """One run's counters from those of its logged intervals (or tasks): accepted and drafted
    counts summed; tau and the per-position rates weighted by each part's steps
    (:func:`recovered_steps`), so NaN where a part's steps cannot be recovered. ``steps`` is
    their sum only where every part printed its own."""
    if len(parts) == 1:
        return parts[0]
    accepted = sum(p.accepted for p in parts)
    drafted = sum(p.drafted for p in parts)
    weights = [recovered_steps(p) for p in parts]
    steps = sum(weights)
    exact = all("steps" in p.given for p in parts)
    depths = {len(p.per_position) for p in parts}
    per_position: tuple[float, ...] = ()
    if not math.isnan(steps) and steps > 0 and len(depths) == 1 and 0 not in depths:
        per_position = tuple(sum(p.per_position[i] * w for p, w in zip(parts, weights)) / steps
                             for i in range(depths.pop()))
    return ExternalCounters(
        source, label, steps=steps if exact else math.nan, drafted=drafted, accepted=accepted,
        emitted=accepted + steps if exact else math.nan, tau=1.0 + accepted / steps if steps > 0 else math.nan,
        per_position=per_position, acceptance_rate=accepted / drafted if drafted else math.nan,
        num_speculative_tokens=len(per_position) or math.nan, intervals=len(parts),
        given=("steps", "accepted", "drafted") if exact else ("accepted", "drafted"))


def counters_from_steps(steps: pd.DataFrame, *, by: Sequence[str] = (), source: str | None = None,
                        label: str | None = None) -> list[ExternalCounters]:
    """Counters of step tables (specviz's :func:`~specviz.metrics.records_table` or
    :func:`~specviz.metrics.specbench.read_specbench_answers`), one per group of ``by``, to sit
    next to other tools' counters.

    ``steps`` = rows, ``accepted`` and ``emitted`` (``committed``) are sums, ``drafted`` is the
    sum of ``drafted`` (NaN when a row's is unknown, as in Spec-Bench files); the per-position
    acceptance is :func:`~specviz.metrics.per_position_acceptance`, P(accepted >= k) over all
    steps, extended with zeros up to the deepest tree when depths are known (as vLLM reports
    every position it drafted).

    Args:
        steps: the step table.
        by: grouping columns (none: one counters object for the whole table).
        source: the counters' source (default: the table's ``attrs["source"]``, else "specviz").
        label: the label (default: the group's ``column=value`` pairs, else ``source``).
    """
    by = check_step_table(steps, by, ["accepted", "committed"])
    source = source or steps.attrs.get("source", "specviz")
    out = []
    for key, group in step_groups(steps, by):
        name = label or (", ".join(f"{c}={v}" for c, v in zip(by, key)) if by else source)
        accepted = group["accepted"].to_numpy()
        n = len(group)
        drafted = float(group["drafted"].sum()) if "drafted" in group and group["drafted"].notna().all() \
            else math.nan
        rates = per_position_acceptance(group, [])["rate"].tolist()
        depth = group["depth"] if "depth" in group else pd.Series(dtype=float)
        if len(depth) and depth.notna().all():  # positions no step reached were drafted and never accepted
            rates += [0.0] * (int(depth.max()) - len(rates))
        per_position = tuple(rates)
        given = ("steps", "accepted", "emitted") + (("drafted",) if not math.isnan(drafted) else ())
        out.append(complete_counters(ExternalCounters(
            source, name, steps=float(n), drafted=drafted, accepted=float(accepted.sum()),
            emitted=float(group["committed"].sum()), per_position=per_position, given=given)))
    return out


def counters_table(counters: Iterable[ExternalCounters]) -> pd.DataFrame:
    """Counters side by side, one row each, with the column names of specviz's summaries
    (:func:`~specviz.metrics.acceptance_summary`): ``source``, ``label``, ``steps``,
    ``new_tokens`` (emitted), ``drafted_tokens``, ``accepted_tokens``, ``acceptance_rate``,
    ``accepted_per_step``, ``tau``, ``num_speculative_tokens``, ``intervals``, ``given``
    (comma-separated attribute names) and ``p_accept_1, p_accept_2, ...`` (NaN beyond a row's
    positions)."""
    counters = list(counters)
    bad = [type(c).__name__ for c in counters if not isinstance(c, ExternalCounters)]
    if bad:
        raise TypeError(f"counters_table takes ExternalCounters objects, got {bad[0]}")
    depth = max((len(c.per_position) for c in counters), default=0)
    rows = []
    for c in counters:
        row = {"source": c.source, "label": c.label, "steps": c.steps, "new_tokens": c.emitted,
               "drafted_tokens": c.drafted, "accepted_tokens": c.accepted, "acceptance_rate": c.acceptance_rate,
               "accepted_per_step": c.accepted_per_step, "tau": c.tau,
               "num_speculative_tokens": c.num_speculative_tokens, "intervals": c.intervals,
               "given": ",".join(c.given)}
        for k in range(depth):
            row[f"{POSITION_PREFIX}{k + 1}"] = c.per_position[k] if k < len(c.per_position) else math.nan
        rows.append(row)
    columns = ["source", "label", "steps", "new_tokens", "drafted_tokens", "accepted_tokens", "acceptance_rate",
               "accepted_per_step", "tau", "num_speculative_tokens", "intervals", "given"] + \
        [f"{POSITION_PREFIX}{k + 1}" for k in range(depth)]
    return pd.DataFrame(rows, columns=columns)
