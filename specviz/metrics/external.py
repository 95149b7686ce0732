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
  SGLang (``Decode batch ... accept len:``), llama.cpp's ``llama-speculative`` /
  ``llama-speculative-simple`` (``n_predict = ..., n_drafted = ..., n_accept = ...``) and
  ``llama-server`` (``draft acceptance = ...`` per task, ``statistics <draft>: ...``), and vLLM
  exports Prometheus counters (``vllm:spec_decode_num_drafts_total``, per position too).
  :func:`parse_vllm_log`, :func:`parse_sglang_log`, :func:`parse_llama_cpp_log`,
  :func:`parse_llama_server_log` and :func:`parse_vllm_metrics` read them into
  :class:`ExternalCounters`; :func:`counters_table` lays any number of them (and
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

Each format has its own module, and every name is importable from here too:
:mod:`~specviz.metrics.specbench` (Spec-Bench answer files), :mod:`~specviz.metrics.vllm_log`,
:mod:`~specviz.metrics.sglang_log`, :mod:`~specviz.metrics.llama_cpp_log` and
:mod:`~specviz.metrics.llama_server_log` (the logs), :mod:`~specviz.metrics.vllm_metrics` (the scrape),
:mod:`~specviz.metrics.counters` (the common record and table) and
:mod:`~specviz.metrics.sources` (a path or the text itself).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pandas as pd

from specviz.metrics.counters import POSITION_PREFIX, ExternalCounters, counters_from_steps, counters_table
from specviz.metrics.llama_cpp_log import llama_cpp_runs, parse_llama_cpp_log
from specviz.metrics.llama_server_log import LLAMA_SERVER_STATISTICS, LLAMA_SERVER_TASK, parse_llama_server_log
from specviz.metrics.sglang_log import parse_sglang_log
from specviz.metrics.sources import read_source
from specviz.metrics.specbench import read_specbench_answers, write_specbench_answers
from specviz.metrics.vllm_log import VLLM_V0_MARK, VLLM_V1_MARK, parse_vllm_log
from specviz.metrics.vllm_metrics import VLLM_METRICS_MARK, parse_vllm_metrics

__all__ = [
    "EXTERNAL_TOOLS",
    "POSITION_PREFIX",
    "ExternalCounters",
    "read_specbench_answers",
    "write_specbench_answers",
    "parse_vllm_log",
    "parse_sglang_log",
    "parse_llama_cpp_log",
    "parse_llama_server_log",
    "parse_vllm_metrics",
    "llama_cpp_runs",
    "counters_from_steps",
    "counters_table",
    "detect_format",
    "read_external",
]

#: the formats :func:`read_external` reads
EXTERNAL_TOOLS = ("spec-bench", "vllm", "vllm-metrics", "sglang", "llama.cpp", "llama-server")


# -- detection ------------------------------------------------------------------------------------

def detect_format(text: str) -> str | None:
    """Which of :data:`EXTERNAL_TOOLS` ``text`` looks like (None when none)."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if first.startswith("{"):
        return "spec-bench"
    if VLLM_V1_MARK in text or VLLM_V0_MARK in text:
        return "vllm"
    if re.search(r"^\s*" + re.escape(VLLM_METRICS_MARK), text, re.MULTILINE):
        return "vllm-metrics"
    if re.search(r"Decode batch\b.*\baccept len:", text):
        return "sglang"
    if re.search(r"^[^=]*?\bn_drafted\s*=\s*-?\d+\s*$", text, re.MULTILINE):
        return "llama.cpp"
    if LLAMA_SERVER_TASK.search(text) or any(
            (m := LLAMA_SERVER_STATISTICS.search(line)) and "#gen drafts" in m.group(2) for line in text.splitlines()):
        return "llama-server"
    return None


_PARSERS = {"vllm": parse_vllm_log, "vllm-metrics": parse_vllm_metrics, "sglang": parse_sglang_log,
            "llama.cpp": parse_llama_cpp_log, "llama-server": parse_llama_server_log}


def read_external(source: str | os.PathLike, *, tool: str | None = None, label: str | None = None) -> pd.DataFrame:
    """Read another tool's results from a file (or its text), detecting the format.

    Args:
        source: a path, or the file's text.
        tool: one of :data:`EXTERNAL_TOOLS` to skip detection.
        label: the counters' label (logs only; default: the file name).

    Returns:
        For a Spec-Bench answer file, the step table of :func:`read_specbench_answers`; for a
        vLLM, SGLang, llama.cpp or llama-server log or a vLLM scrape, the one-row
        :func:`counters_table` of the run. Either
        way ``attrs["source"]`` names the tool.

    Raises:
        ValueError: an unknown ``tool``, a format that is none of these, or malformed content
            (names the file, the line and what was expected).
    """
    if tool is not None and tool not in EXTERNAL_TOOLS:
        raise ValueError(f"unknown tool {tool!r}; expected one of {', '.join(EXTERNAL_TOOLS)}")
    text, name = read_source(source, None)
    fmt = tool or detect_format(text)
    if fmt is None:
        raise ValueError(f"{name}: unknown format; expected Spec-Bench answers (jsonl with 'choices' and "
                         "'accept_lengths'), vLLM 'SpecDecoding metrics:' / 'Speculative metrics:' lines, SGLang "
                         "'Decode batch ... accept len:' lines, llama.cpp's 'n_drafted = N' run summary, "
                         "llama-server's 'draft acceptance = X (N accepted / M generated)' lines or vLLM's "
                         "Prometheus 'vllm:spec_decode_num_...' counters")
    if fmt == "spec-bench":
        return read_specbench_answers(text, name=name)
    counters = _PARSERS[fmt](text, label=label if label is not None else Path(name).name, name=name)
    table = counters_table(counters)
    table.attrs["source"] = counters[0].source
    return table
