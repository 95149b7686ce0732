"""vLLM's speculative-decoding log lines, read into :class:`~specviz.metrics.counters.ExternalCounters`.

The V1 engine prints ``SpecDecoding metrics:`` lines (counts per logging interval), the older
engine ``Speculative metrics:`` lines (running totals since it started);
:func:`parse_vllm_log` reads either (its docstring says what each number rests on).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from specviz.metrics.counters import ExternalCounters, combine_intervals, complete_counters
from specviz.metrics.sources import LOG_NUMBER, read_source

__all__ = ["VLLM_V1_MARK", "VLLM_V0_MARK", "parse_vllm_log"]

#: what starts the V1 engine's metrics lines
VLLM_V1_MARK = "SpecDecoding metrics:"
#: what starts the older engine's metrics lines
VLLM_V0_MARK = "Speculative metrics:"
_V1 = {
    "tau": re.compile(r"Mean acceptance length:\s*" + LOG_NUMBER),
    "accepted": re.compile(r"(?:^|,)\s*Accepted:\s*(\d+)\s*tokens\b"),
    "drafted": re.compile(r"(?:^|,)\s*Drafted:\s*(\d+)\s*tokens\b"),
    "per_position": re.compile(r"Per-position acceptance rate:\s*((?:nan|\d+(?:\.\d+)?)"
                               r"(?:\s*,\s*(?:nan|\d+(?:\.\d+)?))*)"),
}
_V0 = {
    "k": re.compile(r"Number of speculative tokens:\s*(\d+)"),
    "accepted": re.compile(r"Number of accepted tokens:\s*(\d+)"),
    "drafted": re.compile(r"Number of draft tokens(?: tokens)?:\s*(\d+)"),
    "emitted": re.compile(r"Number of emitted tokens(?: tokens)?:\s*(\d+)"),
}


def _nan(x: float | None) -> float:
    """NaN for None, else ``x`` as a float."""
    return math.nan if x is None else float(x)


def _v1_line(body: str, where: str) -> dict:
    """The numbers of one V1 ``SpecDecoding metrics:`` line (``body``: what follows the mark)."""
    found = {k: p.search(body) for k, p in _V1.items()}
    for key, what in (("accepted", "'Accepted: N tokens'"), ("drafted", "'Drafted: N tokens'")):
        if found[key] is None:
            raise ValueError(f"{where}: a vLLM 'SpecDecoding metrics:' line without {what}")
    rec = {"accepted": int(found["accepted"].group(1)), "drafted": int(found["drafted"].group(1)),
           "tau": float(found["tau"].group(1)) if found["tau"] else math.nan, "per_position": ()}
    if found["per_position"]:
        rec["per_position"] = tuple(float(x) for x in found["per_position"].group(1).split(","))
    return rec


def _v1_counters(rec: dict, label: str) -> ExternalCounters:
    """The counters of one V1 interval (:func:`_v1_line`)."""
    given = ["accepted", "drafted"] + (["tau"] if not math.isnan(rec["tau"]) else [])
    if rec["per_position"]:
        given += ["per_position", "num_speculative_tokens"]
    return complete_counters(ExternalCounters(
        "vllm", label, drafted=rec["drafted"], accepted=rec["accepted"], tau=rec["tau"],
        per_position=rec["per_position"], num_speculative_tokens=len(rec["per_position"]) or math.nan,
        given=tuple(given)))


def _v0_line(body: str, where: str) -> dict:
    """The running totals of one older-engine ``Speculative metrics:`` line."""
    found = {k: p.search(body) for k, p in _V0.items()}
    for key, what in (("accepted", "'Number of accepted tokens'"), ("drafted", "'Number of draft tokens'"),
                      ("emitted", "'Number of emitted tokens'")):
        if found[key] is None:
            raise ValueError(f"{where}: a vLLM 'Speculative metrics:' line without {what}")
    return {"verifier_accepted": int(found["accepted"].group(1)), "drafted": int(found["drafted"].group(1)),
            "emitted": int(found["emitted"].group(1)), "k": int(found["k"].group(1)) if found["k"] else None}


def _v0_counters(drafted: int, emitted: int, k: int | None, label: str, intervals: int) -> ExternalCounters:
    """The counters of ``drafted`` and ``emitted`` tokens of the older engine, ``k`` per step."""
    steps = drafted / k if k else math.nan
    return complete_counters(ExternalCounters(
        "vllm-v0", label, steps=steps, drafted=drafted, emitted=emitted, num_speculative_tokens=_nan(k),
        intervals=intervals, given=("drafted", "emitted") + (("num_speculative_tokens",) if k else ())))


def parse_vllm_log(source: str | os.PathLike, *, label: str | None = None, per_interval: bool = False,
                   name: str | None = None) -> list[ExternalCounters]:
    """Read vLLM's speculative-decoding log lines.

    * V1 engine, ``SpecDecoding metrics: Mean acceptance length: 2.83, ..., Accepted: 732
      tokens, Drafted: 1200 tokens, Per-position acceptance rate: 0.800, 0.605, 0.425, ...``
      (older V1 releases print fewer of these fields). Each line covers one logging interval
      and vLLM resets its counts after printing, so the run's totals are the **sums** over the
      lines. Accepted and drafted counts add up exactly; vLLM prints no number of drafts
      (steps), so ``steps`` and ``emitted`` stay NaN, and tau and the per-position rates over
      several lines are weighted by each line's drafts as recovered from its printed, rounded
      ratios (accepted / sum of per-position rates, else accepted / (tau - 1)); tau is NaN when
      a line's drafts cannot be recovered. ``num_speculative_tokens`` is the number of
      per-position rates.
    * the older engine, ``Speculative metrics: Draft acceptance rate: 0.530, System efficiency:
      0.580, Number of speculative tokens: 4, Number of accepted tokens: 1590, Number of draft
      tokens: 3000, Number of emitted tokens: 2175.`` Its counts are **running totals** since
      the engine started, so the last line holds the run (a count that falls marks a restart,
      and the totals of the restarts are added). Every step drafts ``k`` tokens, so
      ``steps = drafted / k``, ``tau = emitted / steps`` and ``accepted = emitted - steps``
      (one bonus or correction token per step; releases that disabled the bonus token emit one
      fewer on fully accepted steps). Its printed "accepted tokens" and "draft acceptance
      rate" count every draft token the verifier accepted even after an earlier rejection, so
      they are not used: ``acceptance_rate`` here is accepted-path tokens / drafted, as in specviz.

    Args:
        source: a log file or its text.
        label: the counters' label (default: the file name).
        per_interval: one :class:`ExternalCounters` per logged interval instead of one for the run.
        name: the name errors use for the input (default: the file name).

    Returns:
        A list of :class:`ExternalCounters` (one element unless ``per_interval``).

    Raises:
        ValueError: no such lines, or a line lacks the counts (names the file and the line).
    """
    text, name = read_source(source, name)
    label = label if label is not None else Path(name).name
    v1: list[dict] = []
    v0: list[dict] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        where = f"{name}, line {lineno}"
        if VLLM_V1_MARK in line:
            v1.append(_v1_line(line.split(VLLM_V1_MARK, 1)[1], where))
        elif VLLM_V0_MARK in line:
            v0.append(_v0_line(line.split(VLLM_V0_MARK, 1)[1], where))
    if v1 and v0:
        raise ValueError(f"{name}: mixes V1 'SpecDecoding metrics:' and older 'Speculative metrics:' lines; "
                         "expected the log of one vLLM engine")
    if v1:
        if per_interval:
            return [_v1_counters(r, label) for r in v1]
        return [combine_intervals([_v1_counters(r, label) for r in v1], "vllm", label)]
    if not v0:
        raise ValueError(f"{name}: expected vLLM 'SpecDecoding metrics:' or 'Speculative metrics:' lines, found none")
    # running totals: split at restarts, then per-interval differences
    segments: list[list[dict]] = [[]]
    for r in v0:
        prev = segments[-1][-1] if segments[-1] else None
        if prev and any(r[key] < prev[key] for key in ("drafted", "emitted", "verifier_accepted")):
            segments.append([])
        segments[-1].append(r)
    if per_interval:
        out = []
        for seg in segments:
            before = {"drafted": 0, "emitted": 0}
            for r in seg:
                out.append(_v0_counters(r["drafted"] - before["drafted"], r["emitted"] - before["emitted"],
                                        r["k"], label, 1))
                before = r
        return out
    ks = {seg[-1]["k"] for seg in segments}
    k = ks.pop() if len(ks) == 1 else None
    return [_v0_counters(sum(seg[-1]["drafted"] for seg in segments), sum(seg[-1]["emitted"] for seg in segments),
                         k, label, len(v0))]
