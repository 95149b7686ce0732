"""The study notebooks' units of work (:class:`~specviz.study.work.Unit`), each kept in a
:class:`~specviz.data.store.ResultStore` and run by :class:`~specviz.study.work.Work` in
the notebook's process or on a Dask cluster.

Every unit names its models by :class:`~specviz.study.work.ModelSpec` and carries the
token ids it works on, so a worker process can run it from its id and arguments alone.
Unit ids end with the greedy reference's key (target, weight mode, token budget and a
hash of the prompt and its continuation), so a unit never reads back a result computed
for another prompt, model or reference.

* :func:`reference_units` - the target's greedy continuations (:func:`references_from`
  reads them back as :class:`~specviz.decode.GenerationResult` objects);
* :func:`rank_units` - teacher-forced draft ranks along a reference, with the draft's
  top-k probabilities there when asked (the calibration data of :func:`candidates_from`);
* :func:`shape_units`, :func:`dynamic_units`, :func:`drafter_units` - greedy replays of
  static shapes, EAGLE-2 dynamic trees (:func:`dynamic_batch_units`: many references
  with their draft forwards batched) and model-free drafters, stored as labelled step
  rows (:func:`~specviz.metrics.label_rows` of :class:`~specviz.decode.StepRecord`);
  :func:`oracle_units` - the hindsight oracle of rank-ordered trees, stored the same way;
* :func:`layer_units` - top-1/top-2 agreement of truncated targets (self-speculation);
* :func:`engine_units` - live engine replays of model drafters (the cross-check);
* :func:`sampled_units` - sampled verification along a reference (expected vs realised);
* :func:`rules_units` - every verification rule along a reference at several temperatures;
* :func:`timed_units`, :func:`cost_units` - timed generations and forward cost curves
  (the speed notebook runs them with ``timing=True``: one at a time, on one worker).

Dimension legend: T = continuation tokens.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Mapping, Sequence

import torch

from specviz.decode.records import GenerationResult, result_from_row
from specviz.sampling import GREEDY, SamplingConfig
from specviz.data.prompts import Prompt
from specviz.data.store import ResultStore
from specviz.draft.base import Drafter
from specviz.study.work import ModelSpec, Unit, draft_source, models_for
from specviz.tree.budgets import shape_key
from specviz.tree.shapes import TreeShape
from specviz.validate import check_int

__all__ = [
    "DYNAMIC_STRATEGY",
    "model_tag",
    "reference_id",
    "reference_units",
    "references_from",
    "rank_units",
    "ranks_from",
    "candidates_from",
    "shape_units",
    "oracle_units",
    "dynamic_units",
    "dynamic_batch_units",
    "drafter_units",
    "layer_units",
    "engine_units",
    "sampled_units",
    "rules_units",
    "timed_units",
    "cost_units",
    "profile_units",
    "tree_drafter",
    "result_from_row",
]

#: the strategy label of EAGLE-2 dynamic trees in step tables
DYNAMIC_STRATEGY = "dynamic (EAGLE-2)"


def model_tag(models: ModelSpec) -> str:
    """``<target>/<weight mode>`` (``tiny-<seed>/...`` for the tiny pair): how unit ids name the target."""
    target = models.target if models.kind == "builtin" else f"tiny-{models.seed}"
    return f"{target}/{models.dtype}"


def _pair_tag(models: ModelSpec) -> str:
    """:func:`model_tag` plus the draft's tag, for units that run the draft."""
    return f"{model_tag(models)}{models.draft_tag}"


def reference_id(models: ModelSpec, prompt: Prompt, max_new_tokens: int, batch_size: int = 1) -> str:
    """Id of a greedy reference: ``<target>/<mode>/T<tokens>/<hash of the prompt text>``
    (``tiny-<seed>`` for the tiny pair; ``.../T<tokens>/b<batch_size>/...`` for one decoded
    in batches, which may round differently). It is the unit id of a one-prompt reference
    and the ``reference`` field of a batched one's row."""
    digest = hashlib.sha256(prompt.text.encode()).hexdigest()[:16]
    batched = f"b{batch_size}/" if batch_size > 1 else ""
    return f"{model_tag(models)}/T{max_new_tokens}/{batched}{digest}"


def _result_row(ref: GenerationResult) -> dict[str, Any]:
    return {"prompt_ids": list(ref.prompt_ids), "output_ids": list(ref.output_ids), "text": ref.text,
            "wall_s": ref.wall_s, "stop_reason": ref.stop_reason}


def _reference_row(models: ModelSpec, text: str, max_new_tokens: int) -> dict[str, Any]:
    from specviz.decode.engine import encode_prompt, plain_generate

    target = models_for(models).target
    ids = encode_prompt(target.tokenizer, text)
    return _result_row(plain_generate(target, ids, max_new_tokens=max_new_tokens, config=GREEDY, stop_at_eos=False))


def _reference_batch_rows(models: ModelSpec, texts: Sequence[str], references: Sequence[str], max_new_tokens: int,
                          batch_size: int) -> list[dict[str, Any]]:
    from specviz.decode.engine import plain_generate_batch

    results = plain_generate_batch(models_for(models).target, list(texts), max_new_tokens=max_new_tokens,
                                   batch_size=batch_size, stop_at_eos=False)
    return [{"reference": ref_id, **_result_row(ref)} for ref_id, ref in zip(references, results)]


def reference_units(models: ModelSpec, prompts: Sequence[Prompt], max_new_tokens: int, *,
                    batch_size: int = 1) -> list[Unit]:
    """The target's greedy continuations of ``max_new_tokens`` tokens, recorded past
    end-of-sequence so any replay of that budget can use them.

    With ``batch_size`` 1, one unit per prompt decodes it alone (:func:`~specviz.decode.plain_generate`).
    With more, the prompts are sorted by length and each unit decodes ``batch_size`` of
    them together (:func:`~specviz.decode.plain_generate_batch`): several times the
    tokens per second on a CPU, at the price of batched rounding (a near-tie may break
    the other way than in a one-prompt decode). :func:`references_from` reads either.
    """
    check_int("batch_size", batch_size)
    if batch_size == 1:
        return [Unit(reference_id(models, p, max_new_tokens), _reference_row,
                     {"text": p.text, "max_new_tokens": max_new_tokens}) for p in prompts]
    ordered = sorted(prompts, key=lambda p: (len(p.text), p.question_id))
    units = []
    for start in range(0, len(ordered), batch_size):
        chunk = ordered[start:start + batch_size]
        refs = [reference_id(models, p, max_new_tokens, batch_size) for p in chunk]
        digest = hashlib.sha256(" ".join(refs).encode()).hexdigest()[:16]
        units.append(Unit(f"{model_tag(models)}/T{max_new_tokens}/b{batch_size}/batch-{digest}", _reference_batch_rows,
                          {"texts": [p.text for p in chunk], "references": refs, "max_new_tokens": max_new_tokens,
                           "batch_size": batch_size}))
    return units


def references_from(store: ResultStore, models: ModelSpec, prompts: Sequence[Prompt], max_new_tokens: int, *,
                    batch_size: int = 1) -> dict[int, GenerationResult]:
    """The finished references of :func:`reference_units` (same ``batch_size``), by question id."""
    if batch_size == 1:
        rows = {p.question_id: store.rows_of(reference_id(models, p, max_new_tokens))[0] for p in prompts}
    else:
        found = {row["reference"]: row for unit in store.units for row in store.rows_of(unit) if "reference" in row}
        rows = {}
        for p in prompts:
            ref_id = reference_id(models, p, max_new_tokens, batch_size)
            if ref_id not in found:
                raise KeyError(f"no batched reference {ref_id!r} in {store!r}; run reference_units(..., "
                               f"batch_size={batch_size}) first")
            rows[p.question_id] = found[ref_id]
    return {qid: result_from_row(row, max_new_tokens) for qid, row in rows.items()}


def _key(models: ModelSpec, reference: GenerationResult) -> str:
    """``<target>/<mode>[+draft-<mode>...]/T<tokens>/<hash of prompt and continuation>``: units
    that read a reference are keyed by its content, so references decoded differently never
    share results, and by the draft's mode where it differs from the target's."""
    text = " ".join(map(str, reference.prompt_ids)) + "|" + " ".join(map(str, reference.output_ids))
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{_pair_tag(models)}/T{reference.max_new_tokens}/{digest}"


# -- teacher-forced ranks ------------------------------------------------------------------------

def _ranks_row(models: ModelSpec, source: str, prompt_ids: Sequence[int], output_ids: Sequence[int],
               k: int = 0) -> dict:
    from specviz.decode.ranks import draft_candidates, draft_ranks

    draft = draft_source(models, source)
    if not k:
        return {"ranks": draft_ranks(draft, prompt_ids, output_ids).tolist()}
    probs, ranks = draft_candidates(draft, prompt_ids, output_ids, k=k)
    return {"ranks": ranks.tolist(), "probs": probs.tolist()}


def _ranks_id(models: ModelSpec, source: str, reference: GenerationResult, k: int) -> str:
    return f"{source}/k{k}/{_key(models, reference)}" if k else f"{source}/{_key(models, reference)}"


def rank_units(models: ModelSpec, sources: Sequence[str], references: Mapping[int, GenerationResult], *,
               k: int = 0) -> list[Unit]:
    """One unit per draft source (``"draft"``, ``"self-L<n>"``) and reference: the ``(T,)``
    teacher-forced ranks of the reference's tokens among the draft's candidates. With
    ``k`` > 0 the same draft forward also stores the draft's top-``k`` probabilities at
    every continuation position (:func:`~specviz.decode.draft_candidates`), the data of
    the calibration study (:func:`candidates_from`)."""
    check_int("k", k, minimum=0)
    return [Unit(_ranks_id(models, source, ref, k), _ranks_row,
                 {"source": source, "prompt_ids": ref.prompt_ids, "output_ids": ref.output_ids, "k": k})
            for source in sources for ref in references.values()]


def ranks_from(store: ResultStore, models: ModelSpec, source: str, reference: GenerationResult, *,
               k: int = 0) -> torch.Tensor:
    """The ranks a :func:`rank_units` unit (same ``k``) stored."""
    return torch.tensor(store.rows_of(_ranks_id(models, source, reference, k))[0]["ranks"], dtype=torch.long)


def candidates_from(store: ResultStore, models: ModelSpec, source: str, reference: GenerationResult, *,
                    k: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, ranks)`` a :func:`rank_units` unit with this ``k`` stored: the draft's
    top-``k`` probabilities at every continuation position and the rank of the
    reference's token (:func:`~specviz.decode.draft_candidates`)."""
    if k < 1:
        raise ValueError(f"k must be at least 1 (rank_units(..., k=k) stores the candidates), got {k}")
    row = store.rows_of(_ranks_id(models, source, reference, k))[0]
    return torch.tensor(row["probs"], dtype=torch.float32), torch.tensor(row["ranks"], dtype=torch.long)


# -- greedy replays ------------------------------------------------------------------------------

def _shape_rows(models: ModelSpec, reference: GenerationResult, ranks: torch.Tensor,
                shapes: Mapping[str, TreeShape], pair: str, budget: int, labels: Mapping[str, Any]) -> list[dict]:
    from specviz.decode.replay import replay_shape
    from specviz.metrics.acceptance import label_rows

    target = models_for(models).target
    rows = []
    for family, shape in shapes.items():
        rows += label_rows(replay_shape(shape, ranks, reference, target=target), pair=pair, strategy=family,
                           budget=budget, **labels)
    return rows


def shape_units(models: ModelSpec, reference: GenerationResult, ranks: torch.Tensor,
                shapes: Mapping[str, TreeShape], *, pair: str, budget: int, labels: Mapping[str, Any]) -> list[Unit]:
    """Greedy replays of static shapes (:func:`~specviz.decode.replay_shape`) from the
    draft's teacher-forced ``ranks``, one unit ``<pair>/<family>/<shape key>/<reference key>``
    per shape; rows carry ``pair``, ``strategy`` (the family), ``budget`` and ``labels``."""
    key = _key(models, reference)
    return [Unit(f"{pair}/{family}/{shape_key(shape)}/{key}", _shape_rows,
                 {"reference": reference, "ranks": ranks, "shapes": {family: shape}, "pair": pair,
                  "budget": budget, "labels": dict(labels)})
            for family, shape in shapes.items()]


def _oracle_rows(models: ModelSpec, reference: GenerationResult, ranks: torch.Tensor, budgets: Sequence[int],
                 pair: str, labels: Mapping[str, Any]) -> list[dict]:
    from specviz.decode.replay import replay_oracle
    from specviz.metrics.acceptance import label_rows

    target = models_for(models).target
    rows = []
    for budget in budgets:
        rows += label_rows(replay_oracle(ranks, reference, budget, target=target), pair=pair, strategy="oracle",
                           budget=budget, **labels)
    return rows


def oracle_units(models: ModelSpec, reference: GenerationResult, ranks: torch.Tensor, budgets: Sequence[int], *,
                 pair: str, labels: Mapping[str, Any]) -> list[Unit]:
    """Greedy replays of the hindsight oracle (:func:`~specviz.decode.replay_oracle`) at
    every budget, one unit ``<pair>/oracle/<budgets>/<reference key>``; rows carry
    ``pair``, ``strategy="oracle"``, ``budget`` and ``labels``."""
    tag = "-".join(str(b) for b in budgets)
    return [Unit(f"{pair}/oracle/{tag}/{_key(models, reference)}", _oracle_rows,
                 {"reference": reference, "ranks": ranks, "budgets": list(budgets), "pair": pair,
                  "labels": dict(labels)})]


def _dynamic_rows(models: ModelSpec, reference: GenerationResult, budgets: Sequence[int], topk: int, depth: int,
                  pair: str, labels: Mapping[str, Any]) -> list[dict]:
    from specviz.decode.replay import replay_dynamic
    from specviz.metrics.acceptance import label_rows

    loaded = models_for(models)
    replayed = replay_dynamic(loaded.draft, reference, list(budgets), topk=topk, depth=depth, target=loaded.target)
    return [row for b in budgets
            for row in label_rows(replayed[b], pair=pair, strategy=DYNAMIC_STRATEGY, budget=b, **labels)]


def dynamic_units(models: ModelSpec, reference: GenerationResult, budgets: Sequence[int], *, topk: int, depth: int,
                  pair: str, labels: Mapping[str, Any]) -> list[Unit]:
    """Greedy replays of EAGLE-2 dynamic trees (:func:`~specviz.decode.replay_dynamic`),
    every budget in one replay: one unit ``<pair>/dynamic-k<topk>-d<depth>/<budgets>/<reference key>``;
    the step rows' ``strategy`` is :data:`DYNAMIC_STRATEGY`."""
    budgets = sorted(budgets)
    tag = "-".join(map(str, budgets))
    return [Unit(f"{pair}/dynamic-k{topk}-d{depth}/{tag}/{_key(models, reference)}", _dynamic_rows,
                 {"reference": reference, "budgets": budgets, "topk": topk, "depth": depth, "pair": pair,
                  "labels": dict(labels)})]


def _dynamic_batch_rows(models: ModelSpec, references: Sequence[GenerationResult], budgets: Sequence[int], topk: int,
                        depth: int, pair: str, labels: Sequence[Mapping[str, Any]]) -> list[dict]:
    from specviz.decode.replay import replay_dynamic_batch
    from specviz.metrics.acceptance import label_rows

    loaded = models_for(models)
    replayed = replay_dynamic_batch(loaded.draft, list(references), list(budgets), topk=topk, depth=depth,
                                    target=loaded.target)
    return [row for result, extra in zip(replayed, labels) for b in budgets
            for row in label_rows(result[b], pair=pair, strategy=DYNAMIC_STRATEGY, budget=b, **extra)]


def dynamic_batch_units(models: ModelSpec, references: Sequence[GenerationResult], budgets: Sequence[int], *,
                        topk: int, depth: int, pair: str, labels: Sequence[Mapping[str, Any]],
                        batch_size: int) -> list[Unit]:
    """:func:`dynamic_units` for many references, ``batch_size`` per unit replayed together
    (:func:`~specviz.decode.replay_dynamic_batch`: one batched draft forward serves them
    all, several times the throughput of one-by-one replays on a CPU). References are
    grouped by prompt length; ``labels[i]`` labels the rows of ``references[i]``."""
    check_int("batch_size", batch_size)
    if len(labels) != len(references):
        raise ValueError(f"got {len(labels)} label sets for {len(references)} references")
    budgets = sorted(budgets)
    tag = "-".join(map(str, budgets))
    order = sorted(range(len(references)), key=lambda i: (len(references[i].prompt_ids), i))
    units = []
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        keys = " ".join(_key(models, references[i]) for i in chunk)
        digest = hashlib.sha256(keys.encode()).hexdigest()[:16]
        units.append(Unit(f"{pair}/dynamic-k{topk}-d{depth}/{tag}/{_pair_tag(models)}/b{batch_size}/batch-{digest}",
                          _dynamic_batch_rows,
                          {"references": [references[i] for i in chunk], "budgets": budgets, "topk": topk,
                           "depth": depth, "pair": pair, "labels": [dict(labels[i]) for i in chunk]}))
    return units


def _drafter_rows(models: ModelSpec, reference: GenerationResult, drafter, strategy: str, pair: str, budget: int,
                  labels: Mapping[str, Any]) -> list[dict]:
    from specviz.decode.records import records_from_result
    from specviz.decode.replay import replay_acceptance
    from specviz.metrics.acceptance import label_rows

    records = records_from_result(replay_acceptance(models_for(models).target, drafter, reference))
    return label_rows(records, pair=pair, strategy=strategy, budget=budget, **labels)


def drafter_units(models: ModelSpec, reference: GenerationResult, drafters: Mapping[str, Any], *, pair: str,
                  budget: int, variant: str, labels: Mapping[str, Any]) -> list[Unit]:
    """Greedy replays of model-free drafters (:func:`~specviz.decode.replay_acceptance`:
    each really drafts at every step), one unit ``<pair>/<drafter name>/<variant>/<reference key>``
    per drafter (``drafters`` maps the ``strategy`` label to a picklable drafter)."""
    key = _key(models, reference)
    return [Unit(f"{pair}/{drafter.name}/{variant}/{key}", _drafter_rows,
                 {"reference": reference, "drafter": drafter, "strategy": name, "pair": pair, "budget": budget,
                  "labels": dict(labels)})
            for name, drafter in drafters.items()]


# -- self-speculation layer sweep, engine cross-check, sampled verification ------------------

def _layer_row(models: ModelSpec, layers: int, reference: GenerationResult) -> dict:
    from specviz.decode.ranks import draft_ranks, positional_acceptance
    from specviz.draft.self_spec import truncated_model

    target = models_for(models).target.model
    a = positional_acceptance(draft_ranks(truncated_model(target, layers), reference.prompt_ids,
                                          reference.output_ids), k=2)
    return {"layers": layers, "share_of_target_layers": layers / target.config.num_hidden_layers,
            "a_1 (top-1 agrees)": a[0], "a_2": a[1]}


def layer_units(models: ModelSpec, reference: GenerationResult, layer_counts: Sequence[int]) -> list[Unit]:
    """One unit per layer count: how often the target's first ``layers`` layers (plus its
    norm and LM head) agree with the whole target along ``reference`` (a_1, a_2)."""
    key = _key(models, reference)
    return [Unit(f"L{n}/{key}", _layer_row, {"layers": n, "reference": reference}) for n in layer_counts]


def _engine_row(models: ModelSpec, reference: GenerationResult, kind: str, arg: Any, strategy: str) -> dict:
    from specviz.decode.records import records_from_result
    from specviz.decode.replay import replay_acceptance
    from specviz.draft.model import DynamicTreeDrafter, TreeDrafter

    loaded = models_for(models)
    drafter = TreeDrafter(loaded.draft, arg) if kind == "tree" else DynamicTreeDrafter(loaded.draft, *arg)
    accepted = [r.accepted for r in records_from_result(replay_acceptance(loaded.target, drafter, reference))]
    return {"strategy": strategy, "accepted": accepted}


def engine_units(models: ModelSpec, reference: GenerationResult, *, shape: TreeShape, shape_name: str,
                 dynamic: tuple[int, int, int]) -> list[Unit]:
    """Accepted tokens per step of the live drafters (a static tree ``shape`` and an
    EAGLE-2 tree ``(topk, depth, budget)``) replayed through the engine along ``reference``."""
    key = _key(models, reference)
    return [Unit(f"engine/{shape_name}/{shape_key(shape)}/{key}", _engine_row,
                 {"reference": reference, "kind": "tree", "arg": shape, "strategy": shape_name}),
            Unit(f"engine/dynamic-w{dynamic[0]}-d{dynamic[1]}-b{dynamic[2]}/{key}", _engine_row,
                 {"reference": reference, "kind": "dynamic", "arg": tuple(dynamic), "strategy": DYNAMIC_STRATEGY})]


def _sampled_rows(models: ModelSpec, reference: GenerationResult, question_id: int, temperature: float,
                  budget: int, shape: TreeShape, dynamic: tuple[int, int], stride: int, seed: int) -> list[dict]:
    from specviz.decode.scoring import TreeScorer, score_rules
    from specviz.draft.model import ChainDrafter, DynamicTreeDrafter, TreeDrafter
    from specviz.sampling import make_generator

    loaded = models_for(models)
    config = SamplingConfig(temperature=temperature)
    strategies = [("chain", "chain", "iid", ChainDrafter(loaded.draft, budget)),
                  ("sequoia", "topk", "topk", TreeDrafter(loaded.draft, shape)),
                  ("sequoia", "specinfer", "iid", TreeDrafter(loaded.draft, shape)),
                  (DYNAMIC_STRATEGY, "topk", "topk", DynamicTreeDrafter(loaded.draft, dynamic[0], dynamic[1], budget))]
    scorer = TreeScorer(loaded.target)
    g = make_generator(seed + question_id)
    rows = []
    for position in range(0, reference.max_new_tokens - 1, stride):
        context = list(reference.prompt_ids) + list(reference.output_ids[:position])
        trees = [drafter.draft(torch.tensor(context), config, mode, g) for _, _, mode, drafter in strategies]
        for (name, rule, _, _), tree, logits in zip(strategies, trees, scorer.logits(context, trees)):
            for score in score_rules(tree, logits, config, [rule], g):
                rows.append({"strategy": name, "question_id": question_id, "position": position, **vars(score)})
    return rows


def sampled_units(models: ModelSpec, references: Mapping[int, GenerationResult], *, temperature: float, budget: int,
                  shape: TreeShape, dynamic: tuple[int, int], stride: int, seed: int) -> list[Unit]:
    """One unit per reference: chain, Sequoia (top-k and SpecInfer rules) and EAGLE-2
    trees of ``budget`` nodes drafted and verified at ``temperature`` at contexts every
    ``stride`` tokens, with the exact expected and the realised acceptance of each (the
    generator is seeded with ``seed + question_id``, so a unit's rows do not depend on
    where it runs)."""
    tag = f"t{temperature}/b{budget}/{shape_key(shape)}/k{dynamic[0]}-d{dynamic[1]}/s{stride}/seed{seed}"
    return [Unit(f"sampled/{tag}/{_key(models, ref)}", _sampled_rows,
                 {"reference": ref, "question_id": qid, "temperature": temperature, "budget": budget,
                  "shape": shape, "dynamic": tuple(dynamic), "stride": stride, "seed": seed})
            for qid, ref in references.items()]


def _rules_rows(models: ModelSpec, reference: GenerationResult, question_id: int, shape: TreeShape,
                chain_length: int, temperatures: Sequence[float], stride: int, seed: int) -> list[dict]:
    from specviz.decode.scoring import score_rules_along
    from specviz.metrics.acceptance import label_rows
    from specviz.sampling import make_generator

    scores = score_rules_along(models_for(models), reference, shape=shape, chain_length=chain_length,
                               temperatures=temperatures, stride=stride, generator=make_generator(seed + question_id))
    return label_rows(scores, question_id=question_id)


def rules_units(models: ModelSpec, references: Mapping[int, GenerationResult], *, shape: TreeShape,
                chain_length: int, temperatures: Sequence[float], stride: int, seed: int) -> list[Unit]:
    """One unit per reference: every verification rule on the draft's trees (``shape``)
    and chains (``chain_length``) at contexts every ``stride`` tokens, at each temperature
    (:func:`~specviz.decode.score_rules_along`, generator seeded with ``seed + question_id``)."""
    tag = f"{shape_key(shape)}/c{chain_length}/t{'-'.join(map(str, temperatures))}/s{stride}/seed{seed}"
    return [Unit(f"rules/{tag}/{_key(models, ref)}", _rules_rows,
                 {"reference": ref, "question_id": qid, "shape": shape, "chain_length": chain_length,
                  "temperatures": list(temperatures), "stride": stride, "seed": seed})
            for qid, ref in references.items()]


# -- the speed notebook's timing units (run with ``Work.run(..., timing=True)``) -------------------

def tree_drafter(shape: TreeShape, pair) -> Drafter:
    """A :class:`~specviz.draft.model.TreeDrafter` of ``pair``'s draft filling ``shape``
    (for ``functools.partial(tree_drafter, shape)`` as a timed unit's drafter)."""
    from specviz.draft.model import TreeDrafter

    return TreeDrafter(pair.draft, shape)


def _timed_row(models: ModelSpec, prompt: Prompt, method: str, make: Callable | None, max_new_tokens: int,
               position: int) -> dict[str, Any]:
    from specviz.bench.cost import timed_run
    from specviz.decode.engine import encode_prompt
    from specviz.data.machine import machine_label

    loaded = models_for(models)
    ids = encode_prompt(loaded.target.tokenizer, prompt.text)
    r = timed_run(loaded.target, None if make is None else make(loaded), ids, max_new_tokens=max_new_tokens,
                  method=method)
    return {"method": method, "question_id": prompt.question_id, "category": prompt.category,
            "position": position, "new_tokens": r.new_tokens, "wall_s": r.wall_s, "steps": r.steps,
            "drafted": r.drafted, "accepted": r.accepted, "draft_s": r.draft_s, "verify_s": r.verify_s,
            "mean_nodes": r.mean_nodes, "output_ids": list(r.output_ids), "prompt_ids": list(ids),
            "machine": machine_label()}


def timed_units(models: ModelSpec, prompt: Prompt, methods: Sequence[tuple[str, Callable | None]], *,
                max_new_tokens: int, threads: int | None, first_position: int = 0) -> list[Unit]:
    """One timed greedy generation (:func:`~specviz.bench.cost.timed_run`) per method, in
    the order given, unit ``<method>/<reference id>[+draft-<mode>...]/threads<n>`` (the
    draft's tag, :attr:`~specviz.study.work.ModelSpec.draft_tag`, for methods that draft).

    Args:
        methods: ``(label, make)`` pairs; ``make(pair)`` builds the drafter from the loaded
            pair (a module-level function or a :func:`functools.partial` of one, e.g.
            ``partial(build_drafter, spec)`` or ``partial(tree_drafter, shape)``); None
            times plain decoding.
        threads: the torch threads the units run with (part of the id).
        first_position: where the first method comes in the prompt's order of runs.
    """
    ref = reference_id(models, prompt, max_new_tokens)
    return [Unit(f"{label}/{ref}{'' if make is None else models.draft_tag}/threads{threads or 'default'}", _timed_row,
                 {"prompt": prompt, "method": label, "make": make, "max_new_tokens": max_new_tokens,
                  "position": first_position + i})
            for i, (label, make) in enumerate(methods)]


def _profile_rows(models: ModelSpec, prompt: Prompt, method: str, max_new_tokens: int,
                  warmup: bool) -> list[dict[str, Any]]:
    from specviz.bench.e2e import parse_method
    from specviz.bench.profile import profile_method
    from specviz.decode.engine import encode_prompt
    from specviz.draft.registry import build_drafter

    loaded = models_for(models)
    spec = parse_method(method)
    drafter = build_drafter(spec, loaded) if spec.is_strategy else None
    ids = encode_prompt(loaded.target.tokenizer, prompt.text)
    table = profile_method(spec, loaded, ids, max_new_tokens=max_new_tokens, drafter=drafter,
                           verifier=spec.verifier(0.0), warmup=warmup)
    table.insert(1, "question_id", prompt.question_id)
    table.insert(2, "category", prompt.category)
    return table.to_dict("records")


def profile_units(models: ModelSpec, prompt: Prompt, methods: Sequence[str], *, max_new_tokens: int,
                  threads: int | None, warmup: bool = True) -> list[Unit]:
    """One greedy generation under torch's profiler per method (names in the benchmark's
    grammar; :func:`~specviz.bench.profile.profile_method`), unit
    ``profile/<method>/<reference id>[+draft-<mode>...]/threads<n>``: rows per phase of the engine, in
    milliseconds per generated token by kind of work. ``warmup=False`` skips the untimed
    first run (when the same process has just run the methods)."""
    ref = reference_id(models, prompt, max_new_tokens) + models.draft_tag
    return [Unit(f"profile/{m}/{ref}/threads{threads or 'default'}", _profile_rows,
                 {"prompt": prompt, "method": m, "max_new_tokens": max_new_tokens, "warmup": warmup})
            for m in methods]


def _cost_rows(models: ModelSpec, role: str, sizes: Sequence[int], prefix_len: int, warmup: int, repeats: int,
               seed: int, dtype: str | None, rows: int = 1) -> list[dict]:
    import gc

    from specviz.bench.cost import forward_cost_curve
    from specviz.models.loading import load_model
    from specviz.data.machine import machine_label

    own = models.dtype if role == "target" else models.draft_mode
    if dtype is None or dtype == own:
        model = getattr(models_for(models), role)
    else:  # another weight mode, loaded for this unit only (the tiny pair is converted from memory)
        source = (getattr(models_for(models), role) if models.kind == "tiny"
                  else models.target if role == "target" else models.draft)
        model = load_model(source, dtype)
    curve = forward_cost_curve(model, list(sizes), prefix_len=prefix_len, warmup=warmup, repeats=repeats, seed=seed,
                               rows=rows)
    del model
    gc.collect()
    return curve.assign(role=role, dtype=dtype or own, machine=machine_label()).to_dict("records")


def cost_units(models: ModelSpec, roles: Sequence[str], sizes: Sequence[int], *, prefix_len: int, repeats: int,
               seed: int, warmup: int = 1, dtype: str | None = None, rows: int = 1) -> list[Unit]:
    """One unit per role (``"target"``, ``"draft"``): the cost of one forward of ``n`` new
    tokens after a ``prefix_len``-token cache for each ``n`` in ``sizes``
    (:func:`~specviz.bench.cost.forward_cost_curve`), in the model's weight mode in the
    pair (the draft's may differ: :attr:`~specviz.study.work.ModelSpec.draft_dtype`) or in
    ``dtype`` (that model is then loaded for the unit only); ``rows`` sequences at once
    (a batched step's forward)."""
    check_int("rows", rows)
    tag = (f"n{'-'.join(map(str, sizes))}/p{prefix_len}/w{warmup}/r{repeats}/seed{seed}"
           + (f"/rows{rows}" if rows > 1 else ""))

    def mode(role: str) -> str:
        if dtype is not None:
            return dtype
        return models.dtype if role == "target" else f"{models.dtype}{models.draft_tag}"

    return [Unit(f"cost/{role}/{mode(role)}/{tag}", _cost_rows,
                 {"role": role, "sizes": list(sizes), "prefix_len": prefix_len, "warmup": warmup,
                  "repeats": repeats, "seed": seed, "dtype": dtype, "rows": rows})
            for role in roles]
