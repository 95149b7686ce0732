"""llama.cpp's ``llama-speculative`` / ``llama-speculative-simple`` end-of-run output
(``n_predict = ..., n_drafted = ..., n_accept = ...``), read into
:class:`~specviz.metrics.counters.ExternalCounters`."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Mapping

from specviz.metrics.counters import ExternalCounters, complete_counters
from specviz.metrics.sources import read_source

__all__ = ["llama_cpp_runs", "parse_llama_cpp_log"]

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
    """The counters of one run summary of :func:`llama_cpp_runs` (or of their sums)."""
    given = ["emitted", "drafted", "accepted"] + (["num_speculative_tokens"] if "n_draft" in run else [])
    return complete_counters(ExternalCounters(
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

    Args, returns and errors as :func:`~specviz.metrics.vllm_log.parse_vllm_log`.
    """
    text, name = read_source(source, name)
    label = label if label is not None else Path(name).name
    runs = llama_cpp_runs(text, name=name)
    if per_interval:
        return [_llama_counters(r, label) for r in runs]
    total = {k: sum(r[k] for r in runs) for k in _LLAMA_COUNTS}
    drafts = {r["n_draft"] for r in runs if "n_draft" in r}
    if len(drafts) == 1 and all("n_draft" in r for r in runs):
        total["n_draft"] = drafts.pop()
    return [_llama_counters(total, label, intervals=len(runs))]
