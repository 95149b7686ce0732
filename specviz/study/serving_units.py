"""The serving notebook's units of work: batches of prompts decoded together, timed.

* :func:`batch_units` - one timed batch (:func:`~specviz.bench.serving.timed_batch_run`)
  per (repeat, batch size, method), plain decoding first in each round and the strategies in
  an order rotated from round to round; each unit's row holds the batch's counts, times,
  step shapes and memory, and whether every row equals its own one-prompt greedy reference;
* :func:`batch_run_from_row` - a stored row back as a :class:`~specviz.bench.serving.BatchRun`;
* :func:`batch_prompts` - the prompts of a ``B``-row batch (the first ``B`` of the list,
  cycled when the batch is larger).

The forward cost over rows x tokens comes from :func:`~specviz.study.units.cost_units`
with ``rows``.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Mapping, Sequence

from specviz.data.prompts import Prompt
from specviz.decode.records import GenerationResult
from specviz.study.units import model_tag
from specviz.study.work import ModelSpec, Unit, models_for
from specviz.validate import check_int, check_ints

__all__ = ["batch_prompts", "batch_units", "batch_run_from_row"]


def batch_prompts(prompts: Sequence[Prompt], batch: int) -> list[Prompt]:
    """The prompts of a ``batch``-row batch: the first ``batch`` of ``prompts``, cycled."""
    check_int("batch", batch)
    if not prompts:
        raise ValueError("batch_prompts needs at least one prompt")
    return [prompts[i % len(prompts)] for i in range(batch)]


def _batch_row(models: ModelSpec, prompts: Sequence[Prompt], references: Sequence[Sequence[int]], method: str,
               make: Callable | None, batch: int, repeat: int, max_new_tokens: int) -> dict[str, Any]:
    from specviz.bench.serving import drafter_bytes, timed_batch_run
    from specviz.data.machine import machine_label
    from specviz.decode.engine import encode_prompt
    from specviz.decode.prompts import stop_rules

    pair = models_for(models)
    target = pair.target
    ids = [encode_prompt(target.tokenizer, p.text) for p in prompts]
    # untimed warm-up on one row (first calls of kernels, the draft's buffers)
    timed_batch_run(target, None if make is None else make(pair), ids[:1], max_new_tokens=2)
    drafter = None if make is None else make(pair)
    run = timed_batch_run(target, drafter, ids, max_new_tokens=max_new_tokens, method=method)
    stops = stop_rules(target, max_new_tokens, True)
    expected = [stops.commit(list(ref), len(p), 0)[0] for ref, p in zip(references, ids)]
    return {"method": method, "batch": batch, "repeat": repeat, "question_ids": [p.question_id for p in prompts],
            "wall_s": run.wall_s, "tokens_per_s": run.tokens_per_s, "tau": run.tau, "taus": list(run.taus),
            "new_tokens": list(run.new_tokens), "steps": list(run.steps), "draft_s": run.draft_s,
            "forward_s": run.forward_s, "other_s": run.other_s, "shape": [list(s) for s in run.shape],
            "step_draft_s": list(run.step_draft_s), "accepted": [list(a) for a in run.accepted],
            "drafted": [list(d) for d in run.drafted], "output_ids": [list(o) for o in run.output_ids],
            "matches_plain": [list(o) == e for o, e in zip(run.output_ids, expected)],
            "prompt_tokens": [len(i) for i in ids], "peak_bytes": run.peak_bytes, "memory": run.memory,
            "drafter_bytes": 0 if drafter is None else drafter_bytes(drafter, target), "machine": machine_label()}


def batch_units(models: ModelSpec, prompts: Sequence[Prompt], references: Mapping[int, GenerationResult],
                methods: Sequence[tuple[str, Callable | None]], *, batches: Sequence[int], repeats: int,
                max_new_tokens: int, threads: int | None) -> list[Unit]:
    """One timed batch per (repeat, batch size, method), in that order, plain decoding
    (``make`` None) first in each round and the other methods rotated by one from round to
    round; unit ``batch/<method>/b<B>/r<repeat>/<target>/T<tokens>/<prompts hash>[+draft...]/threads<n>``.

    Args:
        prompts: the prompt list batches are cut from (:func:`batch_prompts`).
        references: each prompt's greedy continuation decoded alone (``reference_units``),
            by question id: every row is checked against it.
        methods: ``(label, make)`` pairs as for :func:`~specviz.study.units.timed_units`.
        batches: batch sizes; repeats: rounds of every (batch size, method).
    """
    batches = check_ints("batches", batches)
    check_int("repeats", repeats)
    missing = sorted({p.question_id for p in prompts} - set(references))
    if missing:
        raise ValueError(f"no reference for question ids {missing}")
    plain = [m for m in methods if m[1] is None]
    others = [m for m in methods if m[1] is not None]
    units = []
    for repeat in range(repeats):
        shift = repeat % len(others) if others else 0
        for batch in batches:
            chosen = batch_prompts(prompts, batch)
            digest = hashlib.sha256(" ".join(p.text for p in chosen).encode()).hexdigest()[:16]
            for label, make in plain + others[shift:] + others[:shift]:
                tag = "" if make is None else models.draft_tag
                units.append(Unit(
                    f"batch/{label}/b{batch}/r{repeat}/{model_tag(models)}/T{max_new_tokens}/{digest}{tag}"
                    f"/threads{threads or 'default'}", _batch_row,
                    {"prompts": chosen, "references": [list(references[p.question_id].output_ids) for p in chosen],
                     "method": label, "make": make, "batch": batch, "repeat": repeat,
                     "max_new_tokens": max_new_tokens}))
    return units


def batch_run_from_row(row: Mapping[str, Any]):
    """A :func:`batch_units` row as the :class:`~specviz.bench.serving.BatchRun` it recorded."""
    from specviz.bench.serving import BatchRun

    return BatchRun(row["method"], int(row["batch"]), float(row["wall_s"]), tuple(row["new_tokens"]),
                    tuple(row["steps"]), float(row["draft_s"]), float(row["forward_s"]),
                    tuple(tuple(s) for s in row["shape"]), tuple(row["step_draft_s"]),
                    tuple(tuple(a) for a in row["accepted"]), tuple(tuple(d) for d in row["drafted"]),
                    tuple(tuple(o) for o in row["output_ids"]), int(row["peak_bytes"]), row["memory"])
