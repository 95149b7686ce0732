"""Units of work of the study notebooks, each kept in a :class:`~specviz.study.store.ResultStore`.

A unit is run only when its id is not in the store yet, so an interrupted study run
resumes where it stopped. This module owns the unit ids; every id ends with the
greedy reference's key (:func:`~specviz.decode.reference_key`: target, dtype, token
budget and a hash of the prompt ids), so a unit never reads back a result computed for
another prompt or model.

* :func:`stored_draft_ranks` - teacher-forced draft ranks along a reference;
* :func:`replay_shape_units`, :func:`replay_dynamic_units`, :func:`replay_drafter_units` -
  greedy replays of static shapes, EAGLE-2 dynamic trees and any drafter, stored as
  labelled step rows (:func:`~specviz.metrics.label_rows` of
  :class:`~specviz.decode.StepRecord` objects);
* :func:`timed_unit` - one timed generation (:func:`~specviz.bench.cost.timed_run`).

Dimension legend: T = continuation tokens.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from specviz.bench.cost import timed_run
from specviz.decode.engine import encode_prompt
from specviz.decode.ranks import draft_ranks
from specviz.decode.records import GenerationResult, records_from_result
from specviz.decode.replay import reference_key, replay_acceptance, replay_dynamic, replay_shape
from specviz.draft.base import Drafter
from specviz.metrics.acceptance import label_rows
from specviz.models.loading import LoadedModel
from specviz.study.prompts import Prompt
from specviz.study.store import ResultStore
from specviz.tree.budgets import shape_key
from specviz.tree.shapes import TreeShape

__all__ = [
    "DYNAMIC_STRATEGY",
    "stored_draft_ranks",
    "replay_shape_units",
    "replay_dynamic_units",
    "replay_drafter_units",
    "timed_unit",
]

#: the strategy label of EAGLE-2 dynamic trees in step tables
DYNAMIC_STRATEGY = "dynamic (EAGLE-2)"


def _key(target: LoadedModel, reference: GenerationResult) -> str:
    return reference_key(target, reference.prompt_ids, reference.max_new_tokens)


def stored_draft_ranks(store: ResultStore, draft: LoadedModel, target: LoadedModel,
                       reference: GenerationResult) -> torch.Tensor:
    """``(T,)`` teacher-forced ranks of ``reference``'s tokens among ``draft``'s candidates
    (:func:`~specviz.decode.draft_ranks`), computed once per unit
    ``<draft>/<reference key>``."""
    unit = f"{draft.name}/{_key(target, reference)}"
    if unit not in store:
        store.add(unit, {"ranks": draft_ranks(draft, reference.prompt_ids, reference.output_ids).tolist()})
    return torch.tensor(store.rows_of(unit)[0]["ranks"])


def replay_shape_units(store: ResultStore, target: LoadedModel, reference: GenerationResult, ranks: torch.Tensor,
                       shapes: Mapping[str, TreeShape], *, pair: str, budget: int,
                       labels: Mapping[str, Any]) -> tuple[str, ...]:
    """Greedy replays of static shapes (:func:`~specviz.decode.replay_shape`), one unit
    ``<pair>/<family>/<shape key>/<reference key>`` per shape.

    Args:
        store: where the step rows are kept.
        target: the target model (end-of-sequence ids and context limit).
        reference: the target's greedy continuation.
        ranks: the draft's teacher-forced ranks along it (:func:`stored_draft_ranks`).
        shapes: shape per family name (the ``strategy`` column).
        pair: the draft/target pair's label (the ``pair`` column).
        budget: the draft budget of the shapes (the ``budget`` column).
        labels: further constant columns, e.g. ``question_id`` and ``category``.

    Returns:
        The unit ids, in the order of ``shapes``.
    """
    units = []
    for family, shape in shapes.items():
        unit = f"{pair}/{family}/{shape_key(shape)}/{_key(target, reference)}"
        if unit not in store:
            records = replay_shape(shape, ranks, reference, target=target)
            store.add(unit, label_rows(records, pair=pair, strategy=family, budget=budget, **labels))
        units.append(unit)
    return tuple(units)


def replay_dynamic_units(store: ResultStore, target: LoadedModel, draft: LoadedModel, reference: GenerationResult,
                         budgets: Sequence[int], *, topk: int, depth: int, pair: str,
                         labels: Mapping[str, Any]) -> tuple[str, ...]:
    """Greedy replays of EAGLE-2 dynamic trees (:func:`~specviz.decode.replay_dynamic`,
    every missing budget in one replay), one unit
    ``<pair>/dynamic-k<topk>-d<depth>/<budget>/<reference key>`` per budget; the step
    rows' ``strategy`` is :data:`DYNAMIC_STRATEGY`.

    Returns:
        The unit ids, in the order of ``budgets``.
    """
    key = _key(target, reference)
    units = {b: f"{pair}/dynamic-k{topk}-d{depth}/{b}/{key}" for b in budgets}
    missing = [b for b, unit in units.items() if unit not in store]
    if missing:
        replayed = replay_dynamic(draft, reference, missing, topk=topk, depth=depth, target=target)
        for b in missing:
            store.add(units[b], label_rows(replayed[b], pair=pair, strategy=DYNAMIC_STRATEGY, budget=b, **labels))
    return tuple(units.values())


def replay_drafter_units(store: ResultStore, target: LoadedModel, reference: GenerationResult,
                         drafters: Mapping[str, Drafter], *, pair: str, budget: int, variant: str,
                         labels: Mapping[str, Any]) -> tuple[str, ...]:
    """Greedy replays of any drafters (:func:`~specviz.decode.replay_acceptance`: each
    really drafts at every step), one unit ``<pair>/<drafter name>/<variant>/<reference
    key>`` per drafter.

    Args:
        drafters: drafter per strategy label (the ``strategy`` column).
        variant: the sweep's settings that the drafters' names do not show (e.g. ``d8``,
            the depth limit of n-gram tries).
        store, target, reference, pair, budget, labels: as in :func:`replay_shape_units`.

    Returns:
        The unit ids, in the order of ``drafters``.
    """
    units = []
    for name, drafter in drafters.items():
        unit = f"{pair}/{drafter.name}/{variant}/{_key(target, reference)}"
        if unit not in store:
            records = records_from_result(replay_acceptance(target, drafter, reference))
            store.add(unit, label_rows(records, pair=pair, strategy=name, budget=budget, **labels))
        units.append(unit)
    return tuple(units)


def timed_unit(store: ResultStore, target: LoadedModel, prompt: Prompt, method: str,
               make_drafter: Callable[[], Drafter | None], *, max_new_tokens: int, position: int) -> dict[str, Any]:
    """One timed greedy generation (:func:`~specviz.bench.cost.timed_run`) of ``prompt``,
    run only when its unit ``<method>/<reference key>/threads<torch threads>`` is not in
    ``store``.

    Args:
        store: where the runs are kept.
        target: the target model.
        prompt: the prompt.
        method: the method's label.
        make_drafter: builds the drafter (None: plain decoding); called only when the
            unit runs.
        max_new_tokens: tokens to generate.
        position: where the run came in the prompt's order of runs (0: first).

    Returns:
        The run's row: ``method, question_id, category, position, new_tokens, wall_s,
        steps, drafted, accepted, draft_s, verify_s, mean_nodes, output_ids``.
    """
    ids = encode_prompt(target.tokenizer, prompt.text)
    unit = f"{method}/{reference_key(target, ids, max_new_tokens)}/threads{torch.get_num_threads()}"
    if unit not in store:
        r = timed_run(target, make_drafter(), ids, max_new_tokens=max_new_tokens, method=method)
        store.add(unit, {"method": method, "question_id": prompt.question_id, "category": prompt.category,
                         "position": position, "new_tokens": r.new_tokens, "wall_s": r.wall_s, "steps": r.steps,
                         "drafted": r.drafted, "accepted": r.accepted, "draft_s": r.draft_s,
                         "verify_s": r.verify_s, "mean_nodes": r.mean_nodes, "output_ids": list(r.output_ids)})
    return store.rows_of(unit)[0]
