"""Where a decoding run's time goes: phases of the engine and kinds of kernel, from torch's profiler.

:func:`profile_method` runs one method of the benchmark (:func:`specviz.bench.e2e.run_method`)
once untimed, once timed without the profiler and once under ``torch.profiler``, and splits the
profiled run's wall time two ways:

* by **phase** of the engine (:data:`specviz.decode.phases.PHASES`: prefill, draft, tree,
  forward, verify, update, cache), the ranges :func:`specviz.decode.speculative_generate`
  and :func:`specviz.decode.plain_generate` open around each part of a step; time outside
  every range (the loop itself) is ``other``. transformers' own methods (``plain``,
  ``hf-*``) open none, so their whole run is ``other``;
* within each phase, by **kind** of work (:data:`KINDS`): integer matrix products (the
  quantized weight modes' kernels), float matrix products, attention, every other operator
  (norms, rotary embeddings, activation quantization, copies, argmax...), and ``python``:
  time inside the phase but in no operator, i.e. the interpreter running transformers'
  module code, the drafters and the engine (and TorchScript's, running the decoder layers'
  programs).

Every figure is in milliseconds per generated token, so runs of different lengths and
methods compare directly. The profiler adds a few microseconds per operator; the table
carries both the profiled and the unprofiled wall time, and the shares are of the profiled
one.
"""

from __future__ import annotations

import gc
import os
import sys
from contextlib import contextmanager
from typing import Sequence

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from specviz.decode.phases import PHASE_PREFIX, PHASES

__all__ = ["KINDS", "PROFILE_COLUMNS", "op_kind", "split_events", "check_profilable", "profile_method",
           "profile_methods", "aggregate_profile"]

#: kinds of work a phase's time is split into
KINDS: tuple[str, ...] = ("int_products", "float_products", "attention", "other_ops", "python")

#: columns of :func:`profile_method`'s table
PROFILE_COLUMNS: tuple[str, ...] = (
    "method", "phase", "calls", "ms_per_token", "share", *KINDS, "tokens", "steps", "wall_s", "profiled_wall_s",
    "dtype", "threads",
)

_INT_PRODUCTS = ("quantized::", "_int_mm", "specviz::w8a8_token_linear", "specviz::w4a8_token_linear")
_FLOAT_PRODUCTS = ("aten::linear", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
                   "aten::addmv", "aten::mv", "aten::dot")


#: compiled operators that hold several kinds of work and record each under its own name
#: (a fused draft layer: its products, its attention); their children take their own kinds,
#: their own time counts as other operators
_CONTAINER_OPS = ("specviz::w4a8_decoder_layer",)


def op_kind(name: str) -> str:
    """The kind (:data:`KINDS`, not ``python``) of the profiler operator named ``name``."""
    if any(key in name for key in _INT_PRODUCTS):
        return "int_products"
    if "attention" in name:
        return "attention"
    if name in _FLOAT_PRODUCTS:
        return "float_products"
    return "other_ops"


def _phase_name(name: str) -> str | None:
    """The phase a profiler event named ``name`` opens, or None (an operator, including
    specviz's own compiled ``specviz::`` operators, or any other range)."""
    if name.startswith(PHASE_PREFIX) and name[len(PHASE_PREFIX):] in PHASES:
        return name[len(PHASE_PREFIX):]
    return None


def _is_operator(name: str) -> bool:
    """Whether a profiler event is an operator (``namespace::name``), not a TorchScript
    program's method call (``forward``), whose own time is its interpreter's."""
    return "::" in name


def split_events(events) -> tuple[dict[tuple[str, str], float], dict[str, int]]:
    """Microseconds of a profile by (phase, kind), and the ranges opened per phase.

    ``events`` is ``torch.profiler.profile(...).events()``. An operator belongs to the
    innermost phase range around it (``other`` outside every range) and takes the kind of
    its outermost operator inside that range, so that ``aten::mm`` under ``aten::linear``
    counts as a float product and every operator under an attention call as attention.
    A TorchScript program's call (the decoder layers' halves run as programs on a CPU) is
    not an operator: the operators it runs take their own kinds, and its own time, its
    interpreter's, counts as ``python`` like a range's own time (in no operator). A fused
    draft layer (``specviz::w4a8_decoder_layer``) is an operator whose own time counts as
    other operators while the products and attention it records inside it take their
    kinds. Self times are summed, so nothing is counted twice.
    """
    times: dict[tuple[str, str], float] = {}
    calls: dict[str, int] = {}
    for ev in events:
        own = _phase_name(ev.name)
        if own is not None:
            calls[own] = calls.get(own, 0) + 1
            key = (own, "python")
        else:
            outer, parent, ph = (ev if _is_operator(ev.name) else None), ev.cpu_parent, None
            while parent is not None and (ph := _phase_name(parent.name)) is None:
                if _is_operator(parent.name) and parent.name not in _CONTAINER_OPS:
                    outer = parent
                parent = parent.cpu_parent
            kind = "python" if outer is None else "other_ops" if outer.name in _CONTAINER_OPS else op_kind(outer.name)
            key = (ph or "other", kind)
        times[key] = times.get(key, 0.0) + float(ev.self_cpu_time_total)
    return times, calls


@contextmanager
def _quiet_stderr():
    """File descriptor 2 sent to the null device for the duration (what C++ code prints there
    bypasses ``sys.stderr``)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 to silence
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(null)
        os.close(saved)


def check_profilable(spec) -> None:
    """Raise ValueError for a method torch's profiler cannot see (llama.cpp's, which run in
    their own process)."""
    from specviz.bench.e2e import LLAMA_METHODS

    if spec.family in LLAMA_METHODS:
        raise ValueError(f"{spec.name} runs in llama.cpp's own process, which torch's profiler cannot see; "
                         "profile a specviz or transformers method")


def _checked_tokens(max_new_tokens: int) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    return max_new_tokens


def profile_method(spec, pair, ids: Sequence[int], *, max_new_tokens: int = 64, drafter=None, verifier: str = "",
                   seed: int = 0, warmup: bool = True) -> pd.DataFrame:
    """Profile one greedy generation of ``spec`` on the prompt ids ``ids``.

    The method runs three times: once to warm up (caches, kernels' packing; skipped with
    ``warmup=False``), once timed without the profiler (``wall_s``) and once under it
    (``profiled_wall_s``); the phases come from the last run.

    Args:
        spec: the method (:func:`specviz.bench.e2e.parse_method`), a specviz strategy,
            ``specviz-plain`` or one of transformers' methods; not llama.cpp's.
        pair: the :class:`~specviz.models.ModelPair`.
        ids: prompt token ids (already chat-templated).
        max_new_tokens: token budget.
        drafter, verifier: as for :func:`specviz.bench.e2e.run_method`.
        seed: seeds the run.
        warmup: run once untimed first.

    Returns:
        One row per phase that took time (:data:`PROFILE_COLUMNS`): ``calls`` (ranges the
        engine opened), ``ms_per_token`` and each kind's milliseconds per generated token,
        ``share`` of the profiled wall time; ``tokens``, ``steps`` (target calls that commit
        tokens), ``wall_s`` and ``profiled_wall_s`` repeat on every row.

    Raises:
        ValueError: a llama.cpp method (its time is spent in another process), a bad budget.
    """
    from specviz.bench.e2e import run_method

    check_profilable(spec)
    max_new_tokens = _checked_tokens(max_new_tokens)
    ids = list(ids)

    def once():
        return run_method(spec, pair, ids, max_new_tokens=max_new_tokens, seed=seed, drafter=drafter,
                          verifier=verifier)

    if warmup:
        once()
    gc.collect()
    unprofiled = once()
    gc.collect()
    prof = profile(activities=[ProfilerActivity.CPU])
    with _quiet_stderr():  # the profiler's backend announces its start and stop on the process's stderr
        prof.start()
    try:
        gen = once()
    finally:
        with _quiet_stderr():
            prof.stop()
    profiled = gen.wall_s
    times, calls = split_events(prof.events())
    tokens = max(gen.n_tokens, 1)
    wall_us = profiled * 1e6
    phases = list(PHASES) + ["other"]
    rows = []
    for ph in phases:
        kinds = {k: times.get((ph, k), 0.0) for k in KINDS}
        if ph == "other":
            # what no range covers: the wall time left after the ranges, less its operators
            ranged = sum(v for (p, _), v in times.items() if p != "other")
            ops = sum(v for k, v in kinds.items() if k != "python")
            kinds["python"] = max(wall_us - ranged - ops, 0.0)
        total = sum(kinds.values())
        if total <= 0.0:
            continue
        rows.append({
            "method": spec.name, "phase": ph, "calls": calls.get(ph, 0), "ms_per_token": total / 1e3 / tokens,
            "share": total / wall_us, **{k: v / 1e3 / tokens for k, v in kinds.items()}, "tokens": gen.n_tokens,
            "steps": gen.steps, "wall_s": unprofiled.wall_s, "profiled_wall_s": profiled,
            "dtype": pair.target.weight_mode if pair.draft.weight_mode == pair.target.weight_mode
            else f"{pair.target.weight_mode}, draft {pair.draft.weight_mode}",
            "threads": torch.get_num_threads(),
        })
    return pd.DataFrame(rows, columns=list(PROFILE_COLUMNS))


def profile_methods(methods: Sequence[str], pair, ids: Sequence[int], *, max_new_tokens: int = 64,
                    seed: int = 0, on_method=None) -> pd.DataFrame:
    """:func:`profile_method` for each name of ``methods`` (the benchmark's grammar), one
    table; ``on_method(table)`` is called with each method's rows as they finish.

    Raises:
        ValueError: an unknown method name (the message lists the grammar's close matches)
            or a llama.cpp method.
    """
    from specviz.bench.e2e import parse_method
    from specviz.draft.registry import build_drafter

    specs = [parse_method(m) for m in methods]
    for spec in specs:  # all refused before any runs
        check_profilable(spec)
    tables = []
    for spec in specs:
        drafter = build_drafter(spec, pair) if spec.is_strategy else None
        verifier = spec.verifier(0.0)
        table = profile_method(spec, pair, ids, max_new_tokens=max_new_tokens, drafter=drafter, verifier=verifier,
                               seed=seed)
        if on_method is not None:
            on_method(table)
        tables.append(table)
    return pd.concat(tables, ignore_index=True)


def aggregate_profile(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (method, phase), the figures of several profiled runs (e.g. one per prompt, told
    apart by ``question_id``) pooled: milliseconds per generated token over all their tokens,
    ``share`` of their summed profiled wall time. Methods keep their order of appearance,
    phases the engine's order.

    Raises:
        ValueError: ``rows`` lacks columns of :data:`PROFILE_COLUMNS`.
    """
    missing = [c for c in PROFILE_COLUMNS if c not in rows.columns]
    if missing:
        raise ValueError(f"not a profile table (missing columns {missing})")
    run = ["method", "question_id"] if "question_id" in rows.columns else ["method"]
    runs = rows.drop_duplicates(run)
    tokens = runs.groupby("method", sort=False)["tokens"].sum()
    wall_ms = (runs.set_index("method")["profiled_wall_s"] * 1e3).groupby(level=0, sort=False).sum()
    cols = ["ms_per_token", *KINDS]
    totals = rows[["method", "phase"]].join(rows[cols].mul(rows["tokens"], axis=0))  # ms
    out = totals.groupby(["method", "phase"], sort=False).sum().reset_index()
    out[cols] = out[cols].div(out["method"].map(tokens), axis=0)
    out.insert(3, "share", out["ms_per_token"] * out["method"].map(tokens) / out["method"].map(wall_ms))
    order = {p: i for i, p in enumerate([*PHASES, "other"])}
    methods = {m: i for i, m in enumerate(dict.fromkeys(rows["method"]))}
    out = out.sort_values(by=["method", "phase"], key=lambda c: c.map(methods if c.name == "method" else order))
    return out.reset_index(drop=True)
