"""vLLM's Prometheus counters of speculative decoding (a scrape of its ``/metrics`` endpoint),
read into :class:`~specviz.metrics.counters.ExternalCounters`.

A scrape holds, per engine and model, counts since the server started::

    vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 87.0
    vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 259.0
    vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 167.0
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 70.0

Every number follows exactly: steps are the drafts, and the k-th position's rate is its accepted
count over the drafts, P(accepted >= k). The difference of two scrapes is the run between them
(subtract the earlier scrape's counters, or scrape a server that served only the run).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path

from specviz.metrics.counters import ExternalCounters, complete_counters
from specviz.metrics.sources import read_source

__all__ = ["VLLM_METRICS_MARK", "parse_vllm_metrics"]

#: what every speculative-decoding counter of a vLLM scrape starts with
VLLM_METRICS_MARK = "vllm:spec_decode_num_"
_SAMPLE = re.compile(r"^(vllm:spec_decode_num_[a-z_]+?)(_total)?(?:\{([^}]*)\})?\s+(\S+)(?:\s+\d+)?\s*$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_COUNTS = {"vllm:spec_decode_num_drafts": "steps", "vllm:spec_decode_num_draft_tokens": "drafted",
           "vllm:spec_decode_num_accepted_tokens": "accepted"}
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _counters(series: dict, label: str) -> ExternalCounters:
    """The counters of one series' (or the summed series') counts."""
    steps = series["steps"]
    positions = series["positions"]
    per_position = tuple(positions.get(k, 0.0) / steps for k in range(max(positions) + 1)) \
        if positions and steps else ()
    return complete_counters(ExternalCounters(
        "vllm-metrics", label, steps=steps, drafted=series["drafted"], accepted=series["accepted"],
        per_position=per_position, num_speculative_tokens=len(per_position) or math.nan,
        given=("steps", "drafted", "accepted")))


def parse_vllm_metrics(source: str | os.PathLike, *, label: str | None = None, per_interval: bool = False,
                       name: str | None = None) -> list[ExternalCounters]:
    """Read the speculative-decoding counters of a vLLM Prometheus scrape (module docstring).

    Series that differ in labels other than ``position`` (engines, models) are added up;
    ``per_interval=True`` gives one counters object per series instead, labelled with its labels.

    Args, returns and errors as :func:`~specviz.metrics.vllm_log.parse_vllm_log`.
    """
    text, name = read_source(source, name)
    label = label if label is not None else Path(name).name
    series: dict[tuple, dict] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        m = _SAMPLE.match(line.strip())
        if m is None or m.group(1).endswith("_created"):
            continue
        metric, labels = m.group(1), dict(_LABEL.findall(m.group(3) or ""))
        if metric not in _COUNTS and metric != _PER_POSITION:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            raise ValueError(f"{name}, line {lineno}: {metric} should have a number, got {m.group(4)!r}") from None
        position = labels.pop("position", None)
        key = tuple(sorted(labels.items()))
        entry = series.setdefault(key, {"positions": {}})
        if metric == _PER_POSITION:
            if position is None or not position.isdigit():
                raise ValueError(f"{name}, line {lineno}: {metric} without a position=\"k\" label")
            entry["positions"][int(position)] = value
        else:
            entry[_COUNTS[metric]] = value
    if not series:
        raise ValueError(f"{name}: expected vLLM's Prometheus counters ('{VLLM_METRICS_MARK}drafts_total ...'), "
                         "found none")
    for key, entry in series.items():
        lacking = [m + "_total" for m, field in _COUNTS.items() if field not in entry]
        if lacking:
            where = ", ".join(f'{k}="{v}"' for k, v in key) or "no labels"
            raise ValueError(f"{name}: the vLLM series {{{where}}} lacks {', '.join(lacking)}")
    if per_interval:
        return [_counters(entry, ", ".join(f"{k}={v}" for k, v in key) or label) for key, entry in series.items()]
    total = {field: sum(e[field] for e in series.values()) for field in _COUNTS.values()}
    positions: dict[int, float] = {}
    for e in series.values():
        for k, v in e["positions"].items():
            positions[k] = positions.get(k, 0.0) + v
    counters = _counters({**total, "positions": positions}, label)
    return [dataclasses.replace(counters, intervals=len(series))]
