"""Other tools' speculative-decoding results, read into specviz's tables (and written back out).

Two kinds of results come from elsewhere:

* **per-step records** - Spec-Bench answer files (jsonl) keep, for every question, turn and
  step, how many tokens the step committed. :func:`read_specbench_answers` turns them into a
  *step table* with the columns of :func:`~specviz.metrics.records_table`, so
  :func:`~specviz.metrics.acceptance_summary` and the figures read them like a specviz run;
  :func:`write_specbench_answers` writes a specviz step table the other way, for Spec-Bench's
  own tooling.
* **counters** - serving engines print running totals or per-interval averages in their
  logs: vLLM (``SpecDecoding metrics:`` in V1, ``Speculative metrics:`` in the older engine),
  SGLang (``Decode batch ... accept len:``) and llama.cpp's ``llama-speculative`` /
  ``llama-speculative-simple`` (``n_predict = ..., n_drafted = ..., n_accept = ...``).
  :func:`parse_vllm_log`, :func:`parse_sglang_log` and :func:`parse_llama_cpp_log` read them
  into :class:`ExternalCounters`; :func:`counters_table` lays any number of them (and
  :func:`counters_from_steps` of specviz or Spec-Bench step tables) side by side with the
  column names of specviz's summaries.

:func:`read_external` detects which of these a file (or a string) holds.

Conventions (those of :mod:`specviz.metrics.acceptance`): **accepted** counts draft tokens on
the accepted path, **tau** is tokens committed per target call *including* the bonus token
(Spec-Bench's #MAT, vLLM's and EAGLE's "mean acceptance length"), accepted per step =
tau - 1, and the **per-position acceptance** ``p_accept_k`` is the share of steps whose k-th
draft token was accepted, P(accepted >= k) (vLLM's "per-position acceptance rate"). A number a
tool does not print and that cannot be derived from what it prints is NaN, never a guess; the
parsers say where a number rests on rounded prints or on averaging logged intervals.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pandas as pd

from specviz.metrics.acceptance import check_step_table, per_position_acceptance, step_groups

__all__ = [
    "EXTERNAL_TOOLS",
    "POSITION_PREFIX",
    "ExternalCounters",
    "read_specbench_answers",
    "write_specbench_answers",
    "parse_vllm_log",
    "parse_sglang_log",
    "parse_llama_cpp_log",
    "llama_cpp_runs",
    "counters_from_steps",
    "counters_table",
    "detect_format",
    "read_external",
]

#: the formats :func:`read_external` reads
EXTERNAL_TOOLS = ("spec-bench", "vllm", "sglang", "llama.cpp")

#: prefix of the per-position acceptance columns of :func:`counters_table` (``p_accept_1``, ...)
POSITION_PREFIX = "p_accept_"

# the step-table columns of specviz.decode.StepRecord, in its order
_RECORD_COLUMNS = ["step", "position", "drafted", "depth", "accepted", "extendable", "committed"]


# -- reading input --------------------------------------------------------------------------------

def _load(source: str | os.PathLike, name: str | None) -> tuple[str, str]:
    """``(text, name)`` of a path or of literal text."""
    if isinstance(source, os.PathLike):
        path = Path(source)
        return path.read_text(encoding="utf-8", errors="replace"), name or str(path)
    if not isinstance(source, str):
        raise TypeError(f"expected a path or the text itself, got {type(source).__name__}")
    if "\n" not in source and len(source) < 4096:
        path = Path(source).expanduser()
        if path.is_file():
            return path.read_text(encoding="utf-8", errors="replace"), name or str(path)
        if path.suffix in (".jsonl", ".json", ".log", ".txt", ".out", ".err"):
            raise FileNotFoundError(f"no such file: {source}")
    return source, name or "<text>"


def _nan(x: float | None) -> float:
    return math.nan if x is None else float(x)


# -- the common record of counters ----------------------------------------------------------------

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


def _complete(c: ExternalCounters) -> ExternalCounters:
    """Fill every number that follows exactly from the others (and is not known yet):
    emitted = accepted + steps, tau = 1 + accepted / steps, acceptance rate = accepted / drafted."""
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


# -- Spec-Bench answer files ----------------------------------------------------------------------

def _split_turns(lengths: list[int], new_tokens: list[Any] | None) -> list[int] | None:
    """The turn of every step, when the turns' ``new_tokens`` add up to the step lengths."""
    if not lengths:
        return []
    if not new_tokens:
        return None
    try:
        bounds = [int(n) for n in new_tokens]
    except (TypeError, ValueError):
        return None
    turns, t, used = [], 0, 0
    for n in lengths:
        while t < len(bounds) and used == bounds[t]:
            t, used = t + 1, 0
        if t >= len(bounds) or used + n > bounds[t]:
            return None
        turns.append(t)
        used += n
    if used != (bounds[t] if t < len(bounds) else 0) or any(b != 0 for b in bounds[t + 1:]):
        return None
    return turns


def read_specbench_answers(source: str | os.PathLike, *, name: str | None = None) -> pd.DataFrame:
    """Read a Spec-Bench answer file into a step table.

    Spec-Bench's ``evaluation/inference_*.py`` write one JSON object per question, with
    ``question_id``, ``category``, ``model_id`` and ``choices``; each choice holds the turns'
    texts, ``new_tokens`` and ``wall_time`` per turn, and ``accept_lengths``: the tokens every
    decoding step appended to the output, *including* the bonus token (a plain-decoding
    baseline writes 1 per token), for all turns one after another. So for every step
    ``accepted = accept_length - 1`` and ``committed = accept_length``.

    Returns:
        One row per step: ``model_id``, ``question_id``, ``category`` (missing where the file has
        none), ``choice``, ``turn``, then the columns of :class:`~specviz.decode.StepRecord`:
        ``step`` and ``position`` count within the turn; ``drafted`` and ``depth`` are NaN and
        ``extendable`` is ``pd.NA``, since Spec-Bench does not record how many tokens a step
        drafted (acceptance rates and per-depth acceptance cannot be computed from these files;
        tau and P(accepted >= k) can). The turns are told apart by their ``new_tokens``; where
        those do not add up to the step lengths, ``turn`` is ``pd.NA`` and the steps of the
        choice are counted as one sequence (with a warning).

    Raises:
        ValueError: a line is not JSON or lacks what Spec-Bench writes (names the file, the
            line and what was expected).
    """
    text, name = _load(source, name)
    rows: list[dict] = []
    seen = False
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        seen = True
        where = f"{name}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: expected one JSON object per line (a Spec-Bench answer), "
                             f"but it is not JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or "question_id" not in obj or not isinstance(obj.get("choices"), list):
            raise ValueError(f"{where}: expected a Spec-Bench answer with 'question_id' and a 'choices' list")
        for c, choice in enumerate(obj["choices"]):
            if not isinstance(choice, dict) or not isinstance(choice.get("accept_lengths"), list):
                raise ValueError(f"{where}: choice {c} has no 'accept_lengths' list (tokens per step)")
            lengths = choice["accept_lengths"]
            bad = [x for x in lengths if isinstance(x, bool) or not isinstance(x, (int, float))
                   or x != int(x) or x < 1]
            if bad:
                raise ValueError(f"{where}: choice {c}: accept_lengths must be whole numbers >= 1 (tokens per "
                                 f"step including the bonus token), got {bad[0]!r}")
            lengths = [int(x) for x in lengths]
            new_tokens = choice.get("new_tokens")
            turns = _split_turns(lengths, new_tokens if isinstance(new_tokens, list) else None)
            if turns is None:
                n_turns = len(new_tokens) if isinstance(new_tokens, list) else 0
                if n_turns <= 1:
                    turns = [0] * len(lengths)
                else:
                    warnings.warn(f"{where}: choice {c}: the turns' new_tokens {new_tokens} do not add up to the "
                                  f"step lengths; its steps are kept as one sequence with turn = NA", stacklevel=2)
            index = choice.get("index", c)
            index = index if isinstance(index, int) and not isinstance(index, bool) else c
            step_in_turn, position, previous = 0, 0, None
            for i, n in enumerate(lengths):
                turn = turns[i] if turns is not None else pd.NA
                if turns is not None and turn != previous:
                    step_in_turn, position, previous = 0, 0, turn
                rows.append({"model_id": obj.get("model_id"), "question_id": obj["question_id"],
                             "category": obj.get("category"), "choice": index, "turn": turn,
                             "step": step_in_turn, "position": position, "drafted": math.nan, "depth": math.nan,
                             "accepted": n - 1, "extendable": pd.NA, "committed": n})
                step_in_turn += 1
                position += n
    if not seen:
        raise ValueError(f"{name}: empty; expected Spec-Bench answers, one JSON object per line")
    columns = ["model_id", "question_id", "category", "choice", "turn"] + _RECORD_COLUMNS
    table = pd.DataFrame(rows, columns=columns)
    for col in ("choice", "step", "position", "accepted", "committed"):
        table[col] = table[col].astype("int64")
    for col in ("drafted", "depth"):
        table[col] = table[col].astype(float)
    table["turn"] = table["turn"].astype("Int64")
    table.attrs["source"] = "spec-bench"
    return table


def write_specbench_answers(steps: pd.DataFrame, path: str | os.PathLike, *, model_id: str = "specviz",
                            category: str | None = None, wall_time: Mapping[Any, Sequence[float]] | None = None,
                            texts: Mapping[Any, Sequence[str]] | None = None) -> Path:
    """Write a step table as a Spec-Bench answer file (jsonl), one line per question.

    Rows are grouped by ``question_id`` (lines sorted by it, as Spec-Bench's answer files are),
    by ``choice`` and ``turn`` when the table has those columns, and ordered by ``step``. Each
    step is written in Spec-Bench's convention, ``accept_length = accepted + 1`` (tokens the step
    appended, bonus included, before any cut at an end-of-sequence token); a turn's
    ``new_tokens`` is the sum of its accept lengths and ``decoding_steps`` its number of steps,
    so Spec-Bench's ``speed.py`` reports the same #MAT (tau) as
    :func:`~specviz.metrics.acceptance_summary`.

    Args:
        steps: a step table (:func:`~specviz.metrics.records_table`), with a ``question_id``
            column and the columns ``step`` and ``accepted``.
        path: the file to write (its directory is created).
        model_id: written as every line's ``model_id``.
        category: every line's ``category`` when the table has no ``category`` column (the key
            is left out when both are missing; Spec-Bench's per-category report needs it).
        wall_time: seconds per turn, by question id; turns without one get NaN (which
            Python's ``json`` reads back).
        texts: output texts per turn, by question id; "" otherwise.

    Returns:
        The path written.
    """
    missing = [c for c in ("question_id", "step", "accepted") if c not in steps.columns]
    if missing:
        raise ValueError(f"step table lacks columns {missing}; build it with records_table(..., question_id=...)")
    if steps.empty:
        raise ValueError("step table is empty; nothing to write")
    if steps["accepted"].isna().any() or (steps["accepted"] < 0).any():
        raise ValueError("column 'accepted' must hold counts >= 0 in every row")
    inner = [c for c in ("choice", "turn") if c in steps.columns]
    try:
        qids = sorted(steps["question_id"].unique())
    except TypeError:
        qids = list(steps["question_id"].unique())
    lines = []
    for qid in qids:
        rows = steps[steps["question_id"] == qid]
        if "category" in steps.columns:
            cat = rows["category"].iloc[0]
            cat = None if pd.api.types.is_scalar(cat) and pd.isna(cat) else cat
        else:
            cat = category
        groups = [((), rows)] if not inner else list(rows.groupby(inner, sort=True, dropna=False))
        by_choice: dict[Any, list[pd.DataFrame]] = {}
        for key, group in groups:
            key = key if isinstance(key, tuple) else (key,)
            choice = key[0] if "choice" in inner else 0
            by_choice.setdefault(choice, []).append(group.sort_values("step", kind="stable"))
        choices = []
        for index, (choice, turns) in enumerate(by_choice.items()):
            accept_lengths, new_tokens, decoding_steps = [], [], []
            for t in turns:
                lengths = [int(a) + 1 for a in t["accepted"]]
                accept_lengths += lengths
                new_tokens.append(sum(lengths))
                decoding_steps.append(len(lengths))
            n = len(turns)
            times = list(wall_time.get(qid, [])) if wall_time is not None else []
            outs = list(texts.get(qid, [])) if texts is not None else []
            choices.append({"index": int(choice) if "choice" in inner else index,
                            "turns": [outs[i] if i < len(outs) else "" for i in range(n)],
                            "decoding_steps": decoding_steps, "new_tokens": new_tokens,
                            "wall_time": [float(times[i]) if i < len(times) else math.nan for i in range(n)],
                            "accept_lengths": accept_lengths})
        qid_out = qid.item() if hasattr(qid, "item") else qid
        answer = {"question_id": qid_out}
        if cat is not None:
            answer["category"] = cat
        answer.update({"answer_id": f"{model_id}-{qid_out}", "model_id": model_id, "choices": choices,
                       "tstamp": time.time()})
        lines.append(json.dumps(answer))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


# -- vLLM -----------------------------------------------------------------------------------------

_NUM = r"(nan|-?\d+(?:\.\d+)?)"
_V1_MARK = "SpecDecoding metrics:"
_V0_MARK = "Speculative metrics:"
_V1 = {
    "tau": re.compile(r"Mean acceptance length:\s*" + _NUM),
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


def _v1_line(body: str, where: str) -> dict:
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
    given = ["accepted", "drafted"] + (["tau"] if not math.isnan(rec["tau"]) else [])
    if rec["per_position"]:
        given += ["per_position", "num_speculative_tokens"]
    return _complete(ExternalCounters(
        "vllm", label, drafted=rec["drafted"], accepted=rec["accepted"], tau=rec["tau"],
        per_position=rec["per_position"], num_speculative_tokens=len(rec["per_position"]) or math.nan,
        given=tuple(given)))


def _v1_drafts(rec: dict) -> float:
    """An interval's number of drafts, recovered from its printed (rounded) ratios: accepted
    over the sum of the per-position rates (3 decimals each), else over tau - 1 (2 decimals)."""
    if rec["accepted"] == 0:
        return 0.0 if rec["drafted"] == 0 else math.nan
    ratio = sum(rec["per_position"]) if rec["per_position"] else rec["tau"] - 1.0
    return rec["accepted"] / ratio if ratio > 0 else math.nan


def _v1_total(recs: list[dict], label: str) -> ExternalCounters:
    if len(recs) == 1:
        return _v1_counters(recs[0], label)
    accepted = sum(r["accepted"] for r in recs)
    drafted = sum(r["drafted"] for r in recs)
    weights = [_v1_drafts(r) for r in recs]
    drafts = sum(weights)
    tau = 1.0 + accepted / drafts if drafts > 0 else math.nan
    k = {len(r["per_position"]) for r in recs}
    per_position: tuple[float, ...] = ()
    if not math.isnan(drafts) and drafts > 0 and len(k) == 1 and 0 not in k:
        per_position = tuple(sum(r["per_position"][i] * w for r, w in zip(recs, weights)) / drafts
                             for i in range(k.pop()))
    return ExternalCounters(
        "vllm", label, drafted=drafted, accepted=accepted, tau=tau, per_position=per_position,
        acceptance_rate=accepted / drafted if drafted else math.nan,
        num_speculative_tokens=len(per_position) or math.nan, intervals=len(recs),
        given=("accepted", "drafted"))


def _v0_line(body: str, where: str) -> dict:
    found = {k: p.search(body) for k, p in _V0.items()}
    for key, what in (("accepted", "'Number of accepted tokens'"), ("drafted", "'Number of draft tokens'"),
                      ("emitted", "'Number of emitted tokens'")):
        if found[key] is None:
            raise ValueError(f"{where}: a vLLM 'Speculative metrics:' line without {what}")
    return {"verifier_accepted": int(found["accepted"].group(1)), "drafted": int(found["drafted"].group(1)),
            "emitted": int(found["emitted"].group(1)), "k": int(found["k"].group(1)) if found["k"] else None}


def _v0_counters(drafted: int, emitted: int, k: int | None, label: str, intervals: int) -> ExternalCounters:
    steps = drafted / k if k else math.nan
    return _complete(ExternalCounters(
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
    text, name = _load(source, name)
    label = label if label is not None else Path(name).name
    v1: list[dict] = []
    v0: list[dict] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        where = f"{name}, line {lineno}"
        if _V1_MARK in line:
            v1.append(_v1_line(line.split(_V1_MARK, 1)[1], where))
        elif _V0_MARK in line:
            v0.append(_v0_line(line.split(_V0_MARK, 1)[1], where))
    if v1 and v0:
        raise ValueError(f"{name}: mixes V1 'SpecDecoding metrics:' and older 'Speculative metrics:' lines; "
                         "expected the log of one vLLM engine")
    if v1:
        if per_interval:
            return [_v1_counters(r, label) for r in v1]
        return [_v1_total(v1, label)]
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


# -- SGLang ---------------------------------------------------------------------------------------

_SGLANG = re.compile(r"Decode batch\b.*?\baccept len:\s*" + _NUM)


def parse_sglang_log(source: str | os.PathLike, *, label: str | None = None, per_interval: bool = False,
                     name: str | None = None) -> list[ExternalCounters]:
    """Read SGLang's decode-batch log lines, ``Decode batch, #running-req: 1, ..., accept len:
    3.12, ...``.

    SGLang's scheduler prints one such line every ``decode_log_interval`` decode batches; its
    ``accept len`` is (accepted draft tokens + one bonus token per request and step) / (requests
    x steps) over those batches, i.e. tau of the interval, and the counts behind it are reset
    after printing and never printed. So ``tau`` is the only number: per interval it is given;
    for the run it is the plain mean over the intervals (SGLang prints nothing to weight them
    by; exact for one request at a time, approximate for varying batches). Intervals that
    verified nothing (``accept len: 0.00``) are skipped. The ``accept rate`` that newer
    releases print is not used: its definition has changed between releases (some divide
    committed tokens by the verified tokens including the root), so ``acceptance_rate`` stays NaN.

    Args, returns and errors as :func:`parse_vllm_log`.
    """
    text, name = _load(source, name)
    label = label if label is not None else Path(name).name
    taus = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if "Decode batch" not in line or "accept len" not in line:
            continue
        m = _SGLANG.search(line)
        if m is None:
            raise ValueError(f"{name}, line {lineno}: an SGLang 'Decode batch' line whose 'accept len:' has no number")
        value = float(m.group(1))
        if value > 0:
            taus.append(value)
    if not taus:
        raise ValueError(f"{name}: expected SGLang 'Decode batch ... accept len: X' lines of a speculative run, "
                         "found none")
    if per_interval:
        return [ExternalCounters("sglang", label, tau=t, given=("tau",)) for t in taus]
    return [ExternalCounters("sglang", label, tau=sum(taus) / len(taus), intervals=len(taus))]


# -- llama.cpp ------------------------------------------------------------------------------------

_LLAMA_KEYS = {
    "n_draft": re.compile(r"^[^=]*?\bn_draft\s*=\s*(-?\d+)\s*$"),
    "n_predict": re.compile(r"^[^=]*?\bn_predict\s*=\s*(-?\d+)\s*$"),
    "n_drafted": re.compile(r"^[^=]*?\bn_drafted\s*=\s*(-?\d+)\s*$"),
    "n_accept": re.compile(r"^[^=]*?\bn_accept\s*=\s*(-?\d+)\s*$"),
    "accept_pct": re.compile(r"^[^=]*?\baccept\s*=\s*(-?nan|-?inf|-?\d+(?:\.\d+)?)%\s*$"),
    "encode_s": re.compile(r"\bencoded\s+\d+\s+tokens in\s+([\d.]+)\s+seconds"),
    "decode_s": re.compile(r"\bdecoded\s+\d+\s+tokens in\s+([\d.]+)\s+seconds"),
}
_LLAMA_COUNTS = ("n_predict", "n_drafted", "n_accept")


def llama_cpp_runs(text: str, *, name: str = "<text>") -> list[dict[str, float]]:
    """The end-of-run numbers of every ``llama-speculative`` / ``llama-speculative-simple`` run
    in ``text``, in order: dicts with ``n_predict``, ``n_drafted``, ``n_accept`` and, when
    printed, ``n_draft``, ``accept_pct``, ``encode_s`` and ``decode_s`` (the times of the
    ``encoded ... tokens in X seconds`` / ``decoded ...`` lines).

    A number that appears again starts the next run; a run lacking any of ``n_predict``,
    ``n_drafted``, ``n_accept`` is an error.

    Raises:
        ValueError: no run summary, or an incomplete one (names the input and the line).
    """
    runs: list[dict[str, float]] = []
    current: dict[str, float] = {}
    started = 0

    def close() -> None:
        if any(k in current for k in _LLAMA_COUNTS):
            lacking = [k for k in _LLAMA_COUNTS if k not in current]
            if lacking:
                raise ValueError(f"{name}, line {started}: llama.cpp run summary lacks {', '.join(lacking)}; expected "
                                 "'n_predict = N', 'n_drafted = N' and 'n_accept = N' lines")
            runs.append(dict(current))

    for lineno, line in enumerate(text.splitlines(), start=1):
        for key, pattern in _LLAMA_KEYS.items():
            m = pattern.search(line)
            if m is None:
                continue
            if key in current:
                close()
                current = {}
            if not current:
                started = lineno
            current[key] = float(m.group(1))
            break
    close()
    if not runs:
        raise ValueError(f"{name}: expected llama.cpp's end-of-run summary ('n_predict = N', 'n_drafted = N', "
                         "'n_accept = N'), found none")
    return runs


def _llama_counters(run: Mapping[str, float], label: str, intervals: int = 1) -> ExternalCounters:
    given = ["emitted", "drafted", "accepted"] + (["num_speculative_tokens"] if "n_draft" in run else [])
    return _complete(ExternalCounters(
        "llama.cpp", label, emitted=run["n_predict"], drafted=run["n_drafted"], accepted=run["n_accept"],
        num_speculative_tokens=run.get("n_draft", math.nan), intervals=intervals, given=tuple(given)))


def parse_llama_cpp_log(source: str | os.PathLike, *, label: str | None = None, per_interval: bool = False,
                        name: str | None = None) -> list[ExternalCounters]:
    """Read the end-of-run output of llama.cpp's ``llama-speculative-simple`` or
    ``llama-speculative`` (``n_draft = 8``, ``n_predict = 129``, ``n_drafted = 272``,
    ``n_accept = 95``, ``accept = 34.926%``; :func:`llama_cpp_runs`).

    ``n_predict`` counts every token generated (accepted draft tokens plus the target's own
    token of each step), so ``steps = n_predict - n_accept`` target calls and
    ``tau = n_predict / steps``; ``acceptance_rate = n_accept / n_drafted`` is the printed
    ``accept`` (``llama-speculative`` with several parallel drafts counts drafting rounds, not
    tokens, in ``n_drafted``). No per-position numbers are printed. Several runs in one text
    are added up (``per_interval=True``: one counters object per run).

    Args, returns and errors as :func:`parse_vllm_log`.
    """
    text, name = _load(source, name)
    label = label if label is not None else Path(name).name
    runs = llama_cpp_runs(text, name=name)
    if per_interval:
        return [_llama_counters(r, label) for r in runs]
    total = {k: sum(r[k] for r in runs) for k in _LLAMA_COUNTS}
    drafts = {r["n_draft"] for r in runs if "n_draft" in r}
    if len(drafts) == 1 and all("n_draft" in r for r in runs):
        total["n_draft"] = drafts.pop()
    return [_llama_counters(total, label, intervals=len(runs))]


# -- step tables as counters, and the common table ------------------------------------------------

def counters_from_steps(steps: pd.DataFrame, *, by: Sequence[str] = (), source: str | None = None,
                        label: str | None = None) -> list[ExternalCounters]:
    """Counters of step tables (specviz's :func:`~specviz.metrics.records_table` or
    :func:`read_specbench_answers`), one per group of ``by``, to sit next to other tools' counters.

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
        out.append(_complete(ExternalCounters(
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


# -- detection ------------------------------------------------------------------------------------

def detect_format(text: str) -> str | None:
    """Which of :data:`EXTERNAL_TOOLS` ``text`` looks like (None when none)."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if first.startswith("{"):
        return "spec-bench"
    if _V1_MARK in text or _V0_MARK in text:
        return "vllm"
    if re.search(r"Decode batch\b.*\baccept len:", text):
        return "sglang"
    if re.search(r"^[^=]*?\bn_drafted\s*=\s*-?\d+\s*$", text, re.MULTILINE):
        return "llama.cpp"
    return None


_PARSERS = {"vllm": parse_vllm_log, "sglang": parse_sglang_log, "llama.cpp": parse_llama_cpp_log}


def read_external(source: str | os.PathLike, *, tool: str | None = None, label: str | None = None) -> pd.DataFrame:
    """Read another tool's results from a file (or its text), detecting the format.

    Args:
        source: a path, or the file's text.
        tool: one of :data:`EXTERNAL_TOOLS` to skip detection.
        label: the counters' label (logs only; default: the file name).

    Returns:
        For a Spec-Bench answer file, the step table of :func:`read_specbench_answers`; for a
        vLLM, SGLang or llama.cpp log, the one-row :func:`counters_table` of the run. Either
        way ``attrs["source"]`` names the tool.

    Raises:
        ValueError: an unknown ``tool``, a format that is none of these, or malformed content
            (names the file, the line and what was expected).
    """
    if tool is not None and tool not in EXTERNAL_TOOLS:
        raise ValueError(f"unknown tool {tool!r}; expected one of {', '.join(EXTERNAL_TOOLS)}")
    text, name = _load(source, None)
    fmt = tool or detect_format(text)
    if fmt is None:
        raise ValueError(f"{name}: unknown format; expected Spec-Bench answers (jsonl with 'choices' and "
                         "'accept_lengths'), vLLM 'SpecDecoding metrics:' / 'Speculative metrics:' lines, SGLang "
                         "'Decode batch ... accept len:' lines or llama.cpp's 'n_drafted = N' run summary")
    if fmt == "spec-bench":
        return read_specbench_answers(text, name=name)
    counters = _PARSERS[fmt](text, label=label if label is not None else Path(name).name, name=name)
    table = counters_table(counters)
    table.attrs["source"] = counters[0].source
    return table
