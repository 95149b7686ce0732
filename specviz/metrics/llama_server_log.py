"""llama.cpp's ``llama-server`` log, read into :class:`~specviz.metrics.counters.ExternalCounters`.

The server prints two kinds of speculative-decoding lines:

* for every finished task, after the slot's timings (``slot print_timing: id  0 | task 12 |``),
  ``draft acceptance = 0.64479 (  167 accepted /   259 generated), mean acceptance length =  2.92,
  acceptance rate per position = (0.805, 0.632, 0.483)`` (builds before mid-2026 print only
  ``draft acceptance rate = 0.64479 (  167 accepted /   259 generated)``);
* the running statistics of each speculative implementation since the server started,
  ``statistics draft-eagle3: ... #gen drafts = 87, #acc drafts = 70, #gen tokens = 259,
  #acc tokens = 167, ...``.

:func:`parse_llama_server_log` reads both (its docstring says what each number rests on).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path

from specviz.metrics.counters import ExternalCounters, combine_intervals, complete_counters
from specviz.metrics.sources import LOG_NUMBER, read_source

__all__ = ["LLAMA_SERVER_TASK", "LLAMA_SERVER_STATISTICS", "parse_llama_server_log"]

#: a task's line: its acceptance rate, accepted and generated (drafted) tokens
LLAMA_SERVER_TASK = re.compile(r"\bdraft acceptance(?: rate)?\s*=\s*" + LOG_NUMBER +
                               r"\s*\(\s*(\d+)\s+accepted\s*/\s*(\d+)\s+generated\s*\)")
#: an implementation's statistics line (the name after ``statistics``)
LLAMA_SERVER_STATISTICS = re.compile(r"\bstatistics\s+([^\s:]+):(.*)$")
_TAU = re.compile(r"\bmean acceptance length\s*=\s*" + LOG_NUMBER)
_PER_POSITION = re.compile(r"\bacceptance rate per position\s*=\s*\(([^)]*)\)")
_SLOT_TASK = re.compile(r"\bid\s+(\d+)\s*\|\s*task\s+(\d+)")
_STATISTICS = {"steps": "#gen drafts", "first_accepted": "#acc drafts", "drafted": "#gen tokens",
               "accepted": "#acc tokens"}


def _task(line: str, slot_task: tuple[str, str] | None, label: str, where: str) -> ExternalCounters:
    """The counters of one task's ``draft acceptance`` line."""
    m = LLAMA_SERVER_TASK.search(line)
    accepted, drafted = int(m.group(2)), int(m.group(3))
    if accepted > drafted:
        raise ValueError(f"{where}: a llama-server 'draft acceptance' line with more accepted ({accepted}) than "
                         f"generated ({drafted}) draft tokens")
    tau = _TAU.search(line)
    per_position: tuple[float, ...] = ()
    pp = _PER_POSITION.search(line)
    if pp:
        try:
            per_position = tuple(float(x) for x in pp.group(1).split(",") if x.strip())
        except ValueError:
            raise ValueError(f"{where}: llama-server's 'acceptance rate per position' should be numbers in "
                             f"parentheses, got ({pp.group(1)})") from None
    given = ["accepted", "drafted"] + (["tau"] if tau else []) + (["per_position"] if per_position else [])
    name = f"{label} slot {slot_task[0]} task {slot_task[1]}" if slot_task else label
    return complete_counters(ExternalCounters(
        "llama-server", name, accepted=accepted, drafted=drafted, tau=float(tau.group(1)) if tau else math.nan,
        per_position=per_position, num_speculative_tokens=len(per_position) or math.nan, given=tuple(given)))


def _statistics(name: str, body: str, label: str, where: str) -> ExternalCounters:
    """The counters of one implementation's ``statistics`` line."""
    found = {}
    for key, field in _STATISTICS.items():
        m = re.search(re.escape(field) + r"\s*=\s*(\d+)", body)
        if m is None:
            raise ValueError(f"{where}: a llama-server 'statistics {name}:' line without '{field} = N'")
        found[key] = int(m.group(1))
    steps = found["steps"]
    return complete_counters(ExternalCounters(
        "llama-server", f"{label} {name}", steps=steps, drafted=found["drafted"], accepted=found["accepted"],
        per_position=(found["first_accepted"] / steps,) if steps else (), given=("steps", "drafted", "accepted")))


def parse_llama_server_log(source: str | os.PathLike, *, label: str | None = None, per_interval: bool = False,
                           name: str | None = None) -> list[ExternalCounters]:
    """Read ``llama-server``'s speculative-decoding lines (module docstring).

    * **Tasks.** ``generated`` counts the draft tokens the target verified and ``accepted`` those
      on the accepted path; ``mean acceptance length`` is tau with the bonus token (2 decimals)
      and ``acceptance rate per position`` P(accepted >= k) (3 decimals; they add up to tau - 1).
      No number of steps is printed: over several tasks, tau and the per-position rates are
      weighted by each task's steps as recovered from its rounded ratios
      (:func:`~specviz.metrics.counters.combine_intervals`). A task is labelled with the slot and
      task of the last ``id N | task M`` seen on its line or before it.
    * **Statistics.** ``#gen drafts`` is the number of drafts (steps), ``#gen tokens`` and ``#acc
      tokens`` the drafted and accepted tokens and ``#acc drafts`` the drafts with at least one
      accepted token, so steps, tau and the first position's rate are exact. They are running
      totals since the server started: the last line of each implementation counts.

    The run's counters are those of its tasks, with the statistics' exact steps (and so tau)
    where the implementations' accepted and generated tokens equal the tasks' sums; without task
    lines, those of the statistics. ``per_interval=True`` gives one counters object per task and
    one per implementation's statistics.

    Args, returns and errors as :func:`~specviz.metrics.vllm_log.parse_vllm_log`.
    """
    text, name = read_source(source, name)
    label = label if label is not None else Path(name).name
    tasks: list[ExternalCounters] = []
    statistics: dict[str, ExternalCounters] = {}
    slot_task = None
    for lineno, line in enumerate(text.splitlines(), start=1):
        where = f"{name}, line {lineno}"
        ids = _SLOT_TASK.findall(line)
        slot_task = ids[-1] if ids else slot_task
        if LLAMA_SERVER_TASK.search(line):
            tasks.append(_task(line, slot_task, label, where))
        elif (m := LLAMA_SERVER_STATISTICS.search(line)) and "#gen" in m.group(2):
            statistics[m.group(1)] = _statistics(m.group(1), m.group(2), label, where)
    if not tasks and not statistics:
        raise ValueError(f"{name}: expected llama-server's 'draft acceptance = X (N accepted / M generated)' or "
                         "'statistics <name>: ... #gen drafts = N, ...' lines, found none")
    if per_interval:
        return tasks + list(statistics.values())
    stats = list(statistics.values())
    if not tasks:
        return [combine_intervals(stats, "llama-server", label)]
    run = combine_intervals(tasks, "llama-server", label)
    if len(tasks) == 1:
        run = dataclasses.replace(run, label=label)
    steps = sum(s.steps for s in stats)
    if stats and sum(s.accepted for s in stats) == run.accepted and sum(s.drafted for s in stats) == run.drafted:
        run = complete_counters(ExternalCounters(
            "llama-server", label, steps=steps, drafted=run.drafted, accepted=run.accepted,
            per_position=run.per_position, num_speculative_tokens=run.num_speculative_tokens,
            intervals=len(tasks), given=("steps", "accepted", "drafted")))
    return [run]
