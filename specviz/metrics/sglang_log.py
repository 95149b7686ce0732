"""SGLang's decode-batch log lines (``Decode batch ... accept len: X``), read into
:class:`~specviz.metrics.counters.ExternalCounters`."""

from __future__ import annotations

import os
import re
from pathlib import Path

from specviz.metrics.counters import ExternalCounters
from specviz.metrics.sources import LOG_NUMBER, read_source

__all__ = ["parse_sglang_log"]

_SGLANG = re.compile(r"Decode batch\b.*?\baccept len:\s*" + LOG_NUMBER)


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

    Args, returns and errors as :func:`~specviz.metrics.vllm_log.parse_vllm_log`.
    """
    text, name = read_source(source, name)
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
