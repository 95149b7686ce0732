"""Spec-Bench answer files (jsonl): read into specviz step tables, and written from them.

Spec-Bench's ``evaluation/inference_*.py`` keep, for every question, turn and decoding step,
how many tokens the step committed (``accept_lengths``). :func:`read_specbench_answers` turns
them into a step table with the columns of :func:`~specviz.metrics.records_table`;
:func:`write_specbench_answers` writes a specviz step table the other way, for Spec-Bench's
own tooling.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd

from specviz.metrics.sources import read_source

__all__ = ["read_specbench_answers", "write_specbench_answers"]

# the step-table columns of specviz.decode.StepRecord, in its order
_RECORD_COLUMNS = ["step", "position", "drafted", "depth", "accepted", "extendable", "committed"]


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
    text, name = read_source(source, name)
    rows: list[dict] = []
    seen = False
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        seen = True
        where = f"{name}, line {lineno}"
        obj = _answer(line, where)
        for c, choice in enumerate(obj["choices"]):
            rows += _choice_rows(obj, c, choice, where)
    if not seen:
        raise ValueError(f"{name}: empty; expected Spec-Bench answers, one JSON object per line")
    return _step_table(rows)


def _answer(line: str, where: str) -> dict:
    """One line of an answer file as its JSON object, checked to hold what Spec-Bench writes."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: expected one JSON object per line (a Spec-Bench answer), "
                         f"but it is not JSON ({exc.msg})") from None
    if not isinstance(obj, dict) or "question_id" not in obj or not isinstance(obj.get("choices"), list):
        raise ValueError(f"{where}: expected a Spec-Bench answer with 'question_id' and a 'choices' list")
    return obj


def _choice_rows(obj: dict, c: int, choice: Any, where: str) -> list[dict]:
    """The step rows of choice ``c`` of answer ``obj`` (:func:`read_specbench_answers`)."""
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
        else:  # stacklevel 3: the warning points at read_specbench_answers' caller
            warnings.warn(f"{where}: choice {c}: the turns' new_tokens {new_tokens} do not add up to the "
                          f"step lengths; its steps are kept as one sequence with turn = NA", stacklevel=3)
    index = choice.get("index", c)
    index = index if isinstance(index, int) and not isinstance(index, bool) else c
    rows = []
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
    return rows


def _step_table(rows: list[dict]) -> pd.DataFrame:
    """The step table of :func:`read_specbench_answers`' rows, with its column types."""
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
        times = list(wall_time.get(qid, [])) if wall_time is not None else []
        outs = list(texts.get(qid, [])) if texts is not None else []
        choices = _choices(rows, inner, times, outs)
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


def _choices(rows: pd.DataFrame, inner: list[str], times: list, outs: list) -> list[dict]:
    """The ``choices`` of one question's answer: its step rows grouped by the ``inner``
    columns (``choice``, ``turn``) that the table has, with the turns' wall times and texts."""
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
        choices.append({"index": int(choice) if "choice" in inner else index,
                        "turns": [outs[i] if i < len(outs) else "" for i in range(n)],
                        "decoding_steps": decoding_steps, "new_tokens": new_tokens,
                        "wall_time": [float(times[i]) if i < len(times) else math.nan for i in range(n)],
                        "accept_lengths": accept_lengths})
    return choices
