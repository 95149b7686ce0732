"""Acceptance sweeps: what many drafters, shapes and budgets accept, from one target run per prompt.

Under greedy decoding the committed text does not depend on the drafter: it is the
target's own greedy continuation. So the target decodes each prompt once
(:func:`greedy_reference`) and every strategy is replayed against that continuation,
exactly as :func:`specviz.decode.replay_acceptance` does, but cheaper where the
structure allows it:

* **static shapes drafted by a model** (chains, k-ary and expansion trees, Sequoia
  trees: :class:`~specviz.drafters.TreeDrafter` and its chain): under greedy decoding a
  node's child of rank ``r`` is accepted iff the target's next token is the draft's
  rank-``r`` candidate there. Along the accepted path the draft only ever reads the
  target's own tokens, so one teacher-forced draft forward over prompt + continuation
  gives the rank of every continuation token (:func:`draft_ranks`), and a replay of any
  shape at any budget is a walk through those ranks (:func:`replay_shape`) with no
  model call at all;
* **EAGLE-2 dynamic trees** (:func:`replay_dynamic`) depend on the draft's opinion off
  the accepted path, so the drafter really runs, but once per visited position for
  every budget together: the tree kept for the largest budget contains the tree of
  every smaller budget (its top nodes by path score), so smaller budgets are reranks;
* anything else (the n-gram chain and trie) goes through
  :func:`specviz.decode.replay_acceptance` and :func:`records_from_result`.

Every step becomes a :class:`StepRecord`; :func:`acceptance_summary` and
:func:`per_depth_table` aggregate them with the definitions of SPECDEC.md section 1 (as
:mod:`specviz.metrics` does for live traces). :func:`positional_acceptance` turns ranks
into the ``a_1..a_K`` vector Sequoia's dynamic program needs, and :func:`budget_shapes`
gives one static shape per family with exactly a given budget.

For rules that sample, :class:`TreeScorer` returns the target's logits for draft trees
at successive contexts of one sequence (one forward per context, the KV cache reused,
several trees merged into one call), so that every verification rule can be evaluated
exactly on the same trees (:func:`score_rules`).

Dimension legend: P = prompt tokens, T = continuation tokens, V = vocabulary,
N = tree nodes including the root, K = ranks considered.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import pandas as pd
import torch

from specviz.decode.engine import GenerationResult, encode_prompt, eos_token_ids, plain_generate
from specviz.draft.base import DynamicTreeDrafter
from specviz.models.kvcache import crop_cache, forward_tokens, new_cache
from specviz.draft.merge import merge_trees_with_map
from specviz.models.loading import LoadedModel
from specviz.study.store import ResultStore
from specviz.sampling import GREEDY, SamplingConfig
from specviz.tree.sequoia import positional_acceptance_from_counts, sequoia_tree
from specviz.tree.shapes import TreeShape, chain, expansion, kary
from specviz.tree.core import DraftTree, children_lists, depths, tree_attention_mask
from specviz.verify.rules import get_verifier

__all__ = [
    "StepRecord",
    "reference_key",
    "greedy_reference",
    "draft_ranks",
    "positional_acceptance",
    "first_nodes",
    "shape_key",
    "budget_shapes",
    "SHAPE_FAMILIES",
    "replay_shape",
    "replay_dynamic",
    "records_from_result",
    "records_table",
    "acceptance_summary",
    "per_depth_table",
    "TreeScorer",
    "RuleScore",
    "score_rules",
    "label_rows",
]


@dataclass(frozen=True)
class StepRecord:
    """One replayed (or live) speculative step, reduced to what acceptance metrics need.

    Attributes:
        step: 0-based step index within the sequence.
        position: tokens generated before the step.
        drafted: draft nodes verified (root excluded), after trimming to the room left.
        depth: depth of the verified tree.
        accepted: draft tokens accepted.
        extendable: the last node of the accepted path had children, i.e. the path was
            stopped by a rejection at depth ``accepted + 1`` rather than by a leaf (this
            decides the per-depth trials, as in :func:`specviz.metrics.per_depth_acceptance`).
        committed: tokens the step committed (accepted + bonus, cut at end-of-sequence).
    """

    step: int
    position: int
    drafted: int
    depth: int
    accepted: int
    extendable: bool
    committed: int


# -- greedy references ---------------------------------------------------------------------------

def reference_key(target: LoadedModel, prompt_ids: Sequence[int], max_new_tokens: int) -> str:
    """Unit id of a greedy reference in a :class:`~specviz.results.ResultStore`: the
    target, its dtype, the token budget and a hash of the prompt ids."""
    digest = hashlib.sha256(" ".join(map(str, prompt_ids)).encode()).hexdigest()[:16]
    dtype = str(target.dtype).removeprefix("torch.")
    return f"{target.name}/{dtype}/T{max_new_tokens}/{digest}"


def greedy_reference(target: LoadedModel, prompt: str | Sequence[int], max_new_tokens: int, *,
                     store: ResultStore | None = None, chat: bool = True) -> GenerationResult:
    """The target's greedy continuation of ``prompt``, recorded past end-of-sequence
    (``stop_at_eos=False``) so that any replay of budget ``<= max_new_tokens`` can use it.

    Args:
        target: the target model.
        prompt: text (chat template applied when ``chat``) or token ids.
        max_new_tokens: continuation length.
        store: where references are kept between runs and notebooks (unit id
            :func:`reference_key`); None always decodes.
        chat: apply the chat template to text prompts.
    """
    ids = encode_prompt(target.tokenizer, prompt, chat)
    key = reference_key(target, ids, max_new_tokens)
    if store is not None and key in store:
        row = store.rows_of(key)[0]
        out = tuple(int(t) for t in row["output_ids"])
        return GenerationResult(
            prompt_ids=tuple(ids), output_ids=out, text=target.tokenizer.decode(list(out), skip_special_tokens=True),
            steps=(), wall_time_s=float(row["wall_time_s"]), stop_reason=str(row["stop_reason"]), drafter="none",
            verifier="none", config=GREEDY, max_new_tokens=max_new_tokens)
    ref = plain_generate(target, ids, max_new_tokens=max_new_tokens, config=GREEDY, chat=chat, stop_at_eos=False)
    if store is not None:
        store.add(key, {"output_ids": list(ref.output_ids), "wall_time_s": ref.wall_time_s,
                        "stop_reason": ref.stop_reason})
    return ref


# -- ranks and positional acceptance --------------------------------------------------------------

@torch.no_grad()
def draft_ranks(draft, prompt_ids: Sequence[int], continuation: Sequence[int], *, max_rank: int = 64) -> torch.Tensor:
    """Rank of every continuation token in the draft's distribution, teacher-forced.

    Rank 0 means the draft's top-1 candidate at that position is the continuation's
    token. One forward of the draft over the prompt and the continuation.

    Args:
        draft: a :class:`~specviz.models.LoadedModel` or a transformers causal LM.
        prompt_ids: the prompt's token ids.
        continuation: the tokens that followed (e.g. a greedy reference's ``output_ids``).
        max_rank: ranks at or above this are reported as ``max_rank`` ("not among the
            first ``max_rank`` candidates").

    Returns:
        ``(T,)`` long tensor.
    """
    if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1:
        raise ValueError(f"max_rank must be an int >= 1, got {max_rank!r}")
    model = draft.model if isinstance(draft, LoadedModel) else draft
    cont = [int(t) for t in continuation]
    prompt = [int(t) for t in prompt_ids]
    if not cont or not prompt:
        raise ValueError(f"need a non-empty prompt and continuation, got {len(prompt)} and {len(cont)} tokens")
    ids = torch.tensor([prompt + cont[:-1]])  # (1, P + T - 1)
    t = len(cont)
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=t).logits[0].float()  # (T, V)
    target = torch.tensor(cont)[:, None]  # (T, 1)
    ranks = (logits > logits.gather(1, target)).sum(dim=1)  # (T,)
    return ranks.clamp(max=max_rank)


def positional_acceptance(ranks: torch.Tensor | Iterable[torch.Tensor], k: int = 8) -> tuple[float, ...]:
    """Sequoia's positional acceptance vector from teacher-forced ranks: ``a_j`` = share of
    positions whose target token is the draft's rank-``j - 1`` candidate, ``j = 1..k``.

    Under greedy decoding the accepted child is the one holding the target's token, so
    this is exactly "the chance that the j-th ranked child is the accepted one".

    Args:
        ranks: one ``(T,)`` tensor or several (pooled).
        k: entries of the vector (children per node considered).
    """
    parts = [ranks] if isinstance(ranks, torch.Tensor) else list(ranks)
    if not parts:
        raise ValueError("ranks must hold at least one tensor")
    pooled = torch.cat([torch.as_tensor(p).flatten() for p in parts])
    counts = torch.bincount(pooled.clamp(max=k), minlength=k + 1)[:k]  # (k,)
    return positional_acceptance_from_counts([int(c) for c in counts], int(pooled.numel()))


# -- shapes at a given budget ---------------------------------------------------------------------

#: The static shape families :func:`budget_shapes` builds, in the order it returns them.
SHAPE_FAMILIES: tuple[str, ...] = ("chain", "2-ary", "4-ary", "expansion-3-2-1", "sequoia")


def first_nodes(shape: TreeShape, n: int) -> TreeShape:
    """The first ``n`` draft nodes of ``shape`` (root kept): a breadth-first shape cut to
    an exact budget. Parents precede children, so any prefix is a tree.

    Raises:
        ValueError: if ``shape`` has fewer than ``n`` draft nodes.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if n > shape.budget:
        raise ValueError(f"the shape has {shape.budget} draft nodes, fewer than the {n} requested")
    return TreeShape(shape.parents[:n + 1], shape.ranks[:n + 1])


def shape_key(shape: TreeShape) -> str:
    """A short stable id of a shape's parents and ranks (for unit ids of result stores)."""
    text = ",".join(map(str, shape.parents)) + "|" + ",".join(map(str, shape.ranks))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _levels(width: int, budget: int) -> int:
    """Depth of a complete ``width``-ary tree with at least ``budget`` draft nodes."""
    depth, total, level = 0, 0, 1
    while total < budget:
        depth += 1
        level *= width
        total += level
    return depth


def budget_shapes(budget: int, acceptance: Sequence[float] | None = None, *,
                  sequoia_max_depth: int = 8) -> dict[str, TreeShape]:
    """One static shape per family of :data:`SHAPE_FAMILIES` with exactly ``budget`` draft nodes.

    * ``chain`` - ``chain(budget)``;
    * ``2-ary``, ``4-ary`` - complete k-ary trees cut breadth-first to the budget;
    * ``expansion-3-2-1`` - SpecInfer expansion ``[3, 2, 1, 1, ...]`` (three candidates at
      depth 1, two under each at depth 2, then chains), cut breadth-first;
    * ``sequoia`` - Sequoia's optimal tree for ``acceptance`` (only when given) and
      depth limit ``sequoia_max_depth`` (raised as far as needed to fit the budget).

    Raises:
        ValueError: on a budget below 1.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an int >= 1, got {budget!r}")
    # [3, 2] holds 9 draft nodes and every further level of the chains adds 6.
    chains = max(0, -(-(budget - 9) // 6))
    out = {
        "chain": chain(budget),
        "2-ary": first_nodes(kary(2, _levels(2, budget)), budget),
        "4-ary": first_nodes(kary(4, _levels(4, budget)), budget),
        "expansion-3-2-1": first_nodes(expansion([3, 2] + [1] * chains), budget),
    }
    if acceptance is not None:
        k = len(acceptance)
        depth = max(sequoia_max_depth, 1)
        while sum(k ** d for d in range(1, depth + 1)) < budget:
            depth += 1
        out["sequoia"] = sequoia_tree(acceptance, budget, depth).shape
    return out


# -- replays --------------------------------------------------------------------------------------

class _Continuation:
    """A greedy reference and the stopping rules a replay follows (those of the engine)."""

    def __init__(self, reference: GenerationResult, stop_ids: Sequence[int], max_new_tokens: int | None,
                 max_context: int | None) -> None:
        if not isinstance(reference, GenerationResult):
            raise TypeError(f"reference must be a GenerationResult, got {type(reference).__name__}")
        if not reference.config.greedy:
            raise ValueError(f"replays need a greedy reference, got temperature {reference.config.temperature}")
        self.tokens = list(reference.output_ids)
        self.prompt_len = len(reference.prompt_ids)
        self.budget = reference.max_new_tokens if max_new_tokens is None else max_new_tokens
        if self.budget > len(self.tokens):
            raise ValueError(f"a replay of {self.budget} tokens needs a reference at least that long, "
                             f"got {len(self.tokens)} tokens")
        self.stop_ids = set(int(t) for t in stop_ids)
        self.max_context = max_context if max_context is not None else self.prompt_len + self.budget + 1

    def room(self, generated: int) -> int:
        return min(self.budget - generated, self.max_context - (self.prompt_len + generated))

    def commit(self, generated: int, accepted: int) -> tuple[int, bool]:
        """Tokens committed by a step accepting ``accepted`` draft tokens at ``generated``,
        and whether the sequence is finished after it."""
        span = self.tokens[generated:generated + accepted + 1]
        for i, t in enumerate(span):
            if t in self.stop_ids:
                return i + 1, True
        done = generated + len(span) >= self.budget or self.prompt_len + generated + len(span) >= self.max_context
        return len(span), done


def _stop_rules(target: LoadedModel | None, stop_ids: Sequence[int] | None,
                max_context: int | None) -> tuple[Sequence[int], int | None]:
    if target is not None:
        return (eos_token_ids(target) if stop_ids is None else stop_ids,
                target.max_context if max_context is None else max_context)
    return (() if stop_ids is None else stop_ids), max_context


def replay_shape(shape: TreeShape, ranks: torch.Tensor, reference: GenerationResult, *,
                 target: LoadedModel | None = None, stop_ids: Sequence[int] | None = None,
                 max_new_tokens: int | None = None, max_context: int | None = None) -> tuple[StepRecord, ...]:
    """Greedy replay of a model drafter filling the static ``shape``, from teacher-forced ranks.

    Equals :func:`specviz.decode.replay_acceptance` with ``TreeDrafter(draft, shape)``
    (same steps, trees and acceptances) up to the floating-point rounding of the
    draft's logits: a step walks down the shape, taking at depth ``d`` the child whose
    rank is the rank of continuation token ``position + d - 1``.

    Args:
        shape: the static shape (its ``ranks`` say which candidate each node takes).
        ranks: ``(T,)`` ranks of the reference tokens (:func:`draft_ranks`).
        reference: the greedy reference the ranks belong to.
        target: supplies the end-of-sequence ids and context limit (as in replay_acceptance).
        stop_ids, max_context: set them directly instead of (or over) ``target``'s.
        max_new_tokens: token budget (default the reference's).
    """
    if not isinstance(shape, TreeShape):
        raise TypeError(f"shape must be a TreeShape, got {type(shape).__name__}")
    stops, context = _stop_rules(target, stop_ids, max_context)
    cont = _Continuation(reference, stops, max_new_tokens, context)
    ranks_list = torch.as_tensor(ranks).tolist()
    if len(ranks_list) < cont.budget:
        raise ValueError(f"got {len(ranks_list)} ranks for a replay of {cont.budget} tokens")
    node_depth = shape.depths()
    child_by_rank: dict[tuple[int, int], int] = {}
    has_child = [False] * shape.n_nodes
    for i in range(1, shape.n_nodes):
        child_by_rank[(shape.parents[i], shape.ranks[i])] = i
    records: list[StepRecord] = []
    generated, done = 0, False
    while not done:
        limit = cont.room(generated) - 1
        kept = [i for i in range(1, shape.n_nodes) if node_depth[i] <= limit]
        for i in range(shape.n_nodes):
            has_child[i] = False
        for i in kept:
            has_child[shape.parents[i]] = True
        u, accepted = 0, 0
        while True:
            child = child_by_rank.get((u, ranks_list[generated + accepted]))
            if child is None or node_depth[child] > limit:
                break
            u, accepted = child, accepted + 1
        committed, done = cont.commit(generated, accepted)
        records.append(StepRecord(step=len(records), position=generated, drafted=len(kept),
                                  depth=max((node_depth[i] for i in kept), default=0), accepted=accepted,
                                  extendable=has_child[u], committed=committed))
        generated += committed
    return tuple(records)


def _path_scores(tree: DraftTree) -> list[float]:
    """Cumulative draft log-probability of every node's path, summed root to node in the
    order :class:`~specviz.drafters.DynamicTreeDrafter` sums it (root = 0)."""
    q = tree.q.tolist()
    parents = tree.parents.tolist()
    score = [0.0] * len(q)
    for i in range(1, len(q)):
        score[i] = score[parents[i]] + math.log(q[i])
    return score


def _top_nodes(tree: DraftTree, scores: list[float], budget: int) -> DraftTree:
    """The ``budget`` best nodes by path score (ties: lower index), as the drafter keeps them."""
    keep = sorted(range(1, tree.n_nodes), key=lambda i: (-scores[i], i))[:budget]
    return tree.subtree([0] + keep)


def _walk(tree: DraftTree, cont: list[int], generated: int, limit: int) -> tuple[int, int, int, bool]:
    """Greedy acceptance of ``tree`` trimmed to depth ``limit``: (drafted, depth, accepted,
    extendable), taking at each node the first child holding the next continuation token."""
    d = depths(tree).tolist()
    kids = children_lists(tree)
    tokens = tree.tokens.tolist()
    kept = [i for i in range(1, tree.n_nodes) if d[i] <= limit]
    u, accepted = 0, 0
    while True:
        nxt = cont[generated + accepted]
        child = next((c for c in kids[u] if d[c] <= limit and tokens[c] == nxt), None)
        if child is None:
            break
        u, accepted = child, accepted + 1
    extendable = any(d[c] <= limit for c in kids[u])
    return len(kept), max((d[i] for i in kept), default=0), accepted, extendable


def replay_dynamic(draft: LoadedModel, reference: GenerationResult, budgets: Sequence[int], *, topk: int = 4,
                   depth: int = 5, target: LoadedModel | None = None, stop_ids: Sequence[int] | None = None,
                   max_new_tokens: int | None = None,
                   max_context: int | None = None) -> dict[int, tuple[StepRecord, ...]]:
    """Greedy replay of EAGLE-2 dynamic trees (``DynamicTreeDrafter(draft, topk, depth,
    budget)``) for several budgets at once.

    The drafter's expansion does not depend on the budget; only the final rerank does,
    keeping the top ``budget`` nodes by path score. So the drafter runs with the largest
    budget, once per position some budget's replay visits (in increasing order, so its
    draft cache only grows), and each budget keeps its own top nodes of that tree. The
    result equals one :func:`specviz.decode.replay_acceptance` per budget up to the
    floating-point rounding of the draft's logits.

    Returns:
        ``{budget: steps}`` for every budget given.
    """
    budgets = sorted(set(budgets))
    if not budgets:
        raise ValueError("budgets must name at least one budget")
    for b in budgets:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"every budget must be an int >= 1, got {b!r}")
    stops, context = _stop_rules(target, stop_ids, max_context)
    cont = _Continuation(reference, stops, max_new_tokens, context)
    drafter = DynamicTreeDrafter(draft, topk=topk, depth=depth, budget=budgets[-1])
    drafter.reset()
    prompt = list(reference.prompt_ids)
    position = {b: 0 for b in budgets}
    records: dict[int, list[StepRecord]] = {b: [] for b in budgets}
    active = set(budgets)
    while active:
        generated = min(position[b] for b in active)
        context_ids = torch.tensor(prompt + cont.tokens[:generated])  # (L,)
        full = drafter.draft(context_ids, GREEDY, "greedy", None)
        scores = _path_scores(full)
        for b in sorted(active):
            if position[b] != generated:
                continue
            tree = _top_nodes(full, scores, b)
            drafted, tree_depth, accepted, extendable = _walk(tree, cont.tokens, generated,
                                                              cont.room(generated) - 1)
            committed, done = cont.commit(generated, accepted)
            records[b].append(StepRecord(step=len(records[b]), position=generated, drafted=drafted,
                                         depth=tree_depth, accepted=accepted, extendable=extendable,
                                         committed=committed))
            position[b] = generated + committed
            if done:
                active.discard(b)
    return {b: tuple(r) for b, r in records.items()}


def records_from_result(result: GenerationResult) -> tuple[StepRecord, ...]:
    """The steps of a live run or of :func:`specviz.decode.replay_acceptance` as records."""
    if not isinstance(result, GenerationResult):
        raise TypeError(f"result must be a GenerationResult, got {type(result).__name__}")
    out = []
    generated = 0
    eos_cut = len(result.output_ids)
    for s in result.steps:
        kids = children_lists(s.tree)
        committed = min(s.acceptance.accept_length + 1, eos_cut - generated)
        out.append(StepRecord(step=s.step, position=generated, drafted=s.tree.budget, depth=s.tree.depth,
                              accepted=s.acceptance.accept_length,
                              extendable=bool(kids[s.acceptance.last_node]), committed=committed))
        generated += committed
    return tuple(out)


# -- aggregation ----------------------------------------------------------------------------------

def records_table(records: Sequence[StepRecord], **labels) -> pd.DataFrame:
    """Records as a tidy table, one row per step, with ``labels`` as constant columns
    (e.g. ``strategy="chain", budget=8, question_id=3``)."""
    rows = [{**labels, **asdict(r)} for r in records]
    columns = list(labels) + [f for f in StepRecord.__dataclass_fields__]
    return pd.DataFrame(rows, columns=columns)


def acceptance_summary(steps: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """Acceptance numbers per group of step rows (:func:`records_table`).

    Columns: ``by`` + ``sequences`` (distinct ``question_id``), ``steps``, ``new_tokens``,
    ``drafted_tokens``, ``accepted_tokens``, ``acceptance_rate`` (accepted / drafted),
    ``acceptance_length`` (accepted per step), ``tau`` (acceptance length + 1, tokens
    per target call) and ``mean_depth`` (of the verified trees).
    """
    by = list(by)
    missing = [c for c in by + ["accepted", "drafted", "committed", "depth"] if c not in steps.columns]
    if missing:
        raise ValueError(f"step table lacks columns {missing}; build it with records_table")
    agg = steps.groupby(by, sort=False).agg(
        sequences=("question_id", "nunique") if "question_id" in steps.columns else ("step", "size"),
        steps=("step", "size"), new_tokens=("committed", "sum"), drafted_tokens=("drafted", "sum"),
        accepted_tokens=("accepted", "sum"), mean_depth=("depth", "mean")).reset_index()
    agg["acceptance_rate"] = agg["accepted_tokens"] / agg["drafted_tokens"].where(agg["drafted_tokens"] > 0)
    agg["acceptance_length"] = agg["accepted_tokens"] / agg["steps"]
    agg["tau"] = agg["acceptance_length"] + 1.0
    return agg[by + ["sequences", "steps", "new_tokens", "drafted_tokens", "accepted_tokens", "acceptance_rate",
                     "acceptance_length", "tau", "mean_depth"]]


def per_depth_table(steps: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """Per-depth acceptance alpha_d per group: P(accepted at depth d | the path reached
    depth d - 1 and the tree had a candidate there).

    A step with ``accepted = a`` is a success at depths ``1..a`` and, when
    ``extendable``, a failure at depth ``a + 1``.

    Columns: ``by`` + ``depth``, ``trials``, ``accepted``, ``alpha``.
    """
    by = list(by)
    rows: dict[tuple, list[int]] = {}
    for key, group in steps.groupby(by, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        for accepted, extendable in zip(group["accepted"].tolist(), group["extendable"].tolist()):
            for d in range(1, accepted + 1):
                rows.setdefault(key + (d,), [0, 0])
                rows[key + (d,)][0] += 1
                rows[key + (d,)][1] += 1
            if extendable:
                rows.setdefault(key + (accepted + 1,), [0, 0])
                rows[key + (accepted + 1,)][0] += 1
    table = pd.DataFrame([(*k, t, a) for k, (t, a) in rows.items()], columns=by + ["depth", "trials", "accepted"])
    table["alpha"] = table["accepted"] / table["trials"]
    return table.sort_values(by + ["depth"], kind="stable").reset_index(drop=True)


# -- the target's view of draft trees, for rules that sample -------------------------------------

class TreeScorer:
    """Target logits for draft trees at successive contexts of one sequence.

    The KV cache holds the context except its last token (the tree's root); moving to a
    longer context of the same sequence feeds only the new tokens. A tree is one forward
    with depth-based positions and the tree mask, after which the cache is cut back, so
    the result is what :func:`specviz.decode.speculative_generate` would give the
    verifier at that context.

    Args:
        target: the target model.
    """

    def __init__(self, target: LoadedModel) -> None:
        self.target = target
        self.cache = new_cache(target.model)
        self.prefix: list[int] = []

    def _sync(self, prefix: list[int]) -> None:
        common = 0
        limit = min(len(prefix), len(self.prefix))
        while common < limit and prefix[common] == self.prefix[common]:
            common += 1
        crop_cache(self.cache, common)
        if common < len(prefix):
            new = torch.tensor([prefix[common:]])  # (1, n)
            pos = torch.arange(common, len(prefix))[None]  # (1, n)
            forward_tokens(self.target.model, self.cache, new, pos, None, logits_to_keep=1)
        self.prefix = prefix

    def logits(self, context: Sequence[int], trees: Sequence[DraftTree]) -> list[torch.Tensor]:
        """``(N_i, V)`` target logits for each tree rooted at ``context[-1]``; row j is the
        target's distribution after node j. All trees go through one forward (merged into
        one token tree: a node attends only to its ancestors, so merging changes nothing).

        Raises:
            ValueError: if a tree's root is not ``context[-1]``.
        """
        context = [int(t) for t in context]
        if not context:
            raise ValueError("context must hold at least one token")
        for i, tree in enumerate(trees):
            if int(tree.tokens[0]) != context[-1]:
                raise ValueError(f"tree {i} is rooted at token {int(tree.tokens[0])}, not at the context's "
                                 f"last token {context[-1]}")
        merged = merge_trees_with_map(list(trees))
        tree = merged.tree
        self._sync(context[:-1])
        p = len(context) - 1
        allowed = tree_attention_mask(tree.parents, p)[None]  # (1, N, P + N)
        pos = (depths(tree) + p)[None]  # (1, N)
        logits = forward_tokens(self.target.model, self.cache, tree.tokens[None], pos, allowed)[0]  # (N, V)
        crop_cache(self.cache, p)
        return [logits[list(m)] for m in merged.node_maps]


@dataclass(frozen=True)
class RuleScore:
    """One verification rule on one draft tree.

    Attributes:
        rule: the verifier's name.
        drafted: draft nodes in the tree.
        expected: exact expected accepted draft tokens (SPECDEC.md section 2).
        realised: draft tokens accepted by one verification with the given generator.
    """

    rule: str
    drafted: int
    expected: float
    realised: int


def score_rules(tree: DraftTree, target_logits: torch.Tensor, config: SamplingConfig,
                rules: Sequence[str], generator: torch.Generator) -> list[RuleScore]:
    """Exact expected and one realised acceptance of each rule in ``rules`` on ``tree``.

    Shapes: ``target_logits`` ``(N, V)``.
    """
    out = []
    for name in rules:
        verifier = get_verifier(name)
        expected = verifier.expected_accept_length(tree, target_logits, config)
        realised = verifier(tree, target_logits, config, generator).accept_length
        out.append(RuleScore(verifier.name, tree.budget, expected, realised))
    return out


def label_rows(items: Iterable, **labels) -> list[dict]:
    """Dataclass items as row dicts with constant ``labels`` first (for tidy tables)."""
    return [{**labels, **asdict(item)} for item in items]
