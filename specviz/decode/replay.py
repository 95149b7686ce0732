"""Greedy replays: what any drafter accepts along a recorded continuation, without
running the target on its trees.

Under greedy decoding the committed text does not depend on the drafter: it is the
target's own greedy continuation. So the target decodes each prompt once
(:func:`greedy_reference`) and every strategy is replayed against that continuation:

* :func:`replay_acceptance` - any drafter really drafts at every step, and the greedy
  walk of :func:`specviz.tree.greedy_walk` follows the continuation instead of the
  target's argmax; the steps, trees and acceptances equal a live greedy run's;
* **static shapes drafted by a model** (:func:`replay_shape`): a node's child of rank
  ``r`` is accepted iff the target's next token is the draft's rank-``r`` candidate, so
  a replay of any shape at any budget is a walk through teacher-forced ranks
  (:func:`specviz.decode.draft_ranks`) with no model call at all;
* **EAGLE-2 dynamic trees** (:func:`replay_dynamic`) depend on the draft's opinion off
  the accepted path, so the drafter really runs, but once per visited position for
  every budget together: the tree kept for the largest budget contains the tree of
  every smaller budget (its top nodes by path score), so smaller budgets are reranks;
  :func:`replay_dynamic_batch` replays many references together, their draft forwards
  batched.

Every replay stops by the engine's :class:`~specviz.decode.records.StopRules`; shape and
dynamic replays return :class:`~specviz.decode.records.StepRecord` objects, which
:mod:`specviz.metrics` aggregates (:func:`specviz.decode.records_from_result` turns a
:func:`replay_acceptance` result into the same records).

Dimension legend: P = prompt tokens, T = continuation tokens, N = tree nodes including
the root.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Sequence

import torch

from specviz.decode.plain import plain_generate
from specviz.decode.prompts import encode_prompt, stop_rules
from specviz.decode.records import GenerationResult, StepRecord, StepTrace, StopRules
from specviz.decode.rows import Row, check_drafter, finish_row, step_tree
from specviz.draft.base import Drafter, draft_all
from specviz.draft.model import DynamicTreeDrafter
from specviz.models.types import LoadedModel
from specviz.sampling import GREEDY, make_generator
from specviz.data.store import ResultStore
from specviz.tree.core import DraftTree, children_lists, depths, greedy_walk
from specviz.tree.shapes import TreeShape
from specviz.validate import check_int, check_ints
from specviz.verify.rules import Acceptance

__all__ = [
    "replay_acceptance",
    "reference_key",
    "greedy_reference",
    "replay_shape",
    "replay_dynamic",
    "replay_dynamic_batch",
    "oracle_depth",
    "replay_oracle",
]


def replay_acceptance(target: LoadedModel, drafter: Drafter, reference: GenerationResult, *,
                      max_new_tokens: int | None = None, stop_at_eos: bool = True) -> GenerationResult:
    """Greedy acceptance of ``drafter`` along a recorded greedy continuation, no target calls.

    Under greedy decoding the committed sequence does not depend on the drafter, so the
    target's greedy continuation decides every step: walking the draft tree from the root,
    a child is accepted iff its token is the next token of the continuation (the first
    such child, as :class:`~specviz.verify.GreedyVerifier` does), and the bonus is the
    continuation token after the accepted path. The steps, trees and acceptances equal
    those of a live greedy run with the same drafter and budget; only the target's
    per-node probabilities are unknown (NaN) and ``verify_time_s`` is 0.

    Args:
        target: the target model (only its tokenizer, end-of-sequence ids and context
            limit are used).
        drafter: any drafter; it is reset first.
        reference: a greedy run of the target on the prompt, e.g. ``plain_generate(...,
            stop_at_eos=False)``, whose ``output_ids`` cover every position the replay
            needs.
        max_new_tokens: token budget (default ``reference.max_new_tokens``).
        stop_at_eos: stop where a live run would stop at an end-of-sequence token.

    Raises:
        ValueError: a drafter that needs the target's outputs (Jacobi, lookahead), a
            non-greedy reference, or one that ends before a position a step
            needs (possible when it stopped at an end-of-sequence token that a draft
            then proposed; record it with ``stop_at_eos=False``).
    """
    if not isinstance(reference, GenerationResult):
        raise TypeError(f"reference must be a GenerationResult, got {type(reference).__name__}")
    if not reference.config.greedy:
        raise ValueError(f"replay needs a greedy reference, got temperature {reference.config.temperature}")
    budget = check_int("max_new_tokens", reference.max_new_tokens if max_new_tokens is None else max_new_tokens)
    check_drafter(target, drafter)
    if "logits" in drafter.reads:
        raise ValueError(f"drafter {drafter.name!r} guesses from the target's outputs at every step (its window or "
                         "last predictions), which a replay does not compute; run it live with speculative_generate")
    start = time.perf_counter()
    stops = stop_rules(target, budget, stop_at_eos)
    cont = list(reference.output_ids)
    row = Row(list(reference.prompt_ids), drafter, make_generator(0))
    drafter.reset()
    while not row.stop_reason:
        t0 = time.perf_counter()
        tree = drafter.draft(torch.tensor(row.tokens), GREEDY, "greedy", row.generator)
        draft_time = time.perf_counter() - t0
        tree = step_tree(row, tree, stops, target.vocab_size)
        acc = _replay_step(tree, cont, row.generated)
        trace = StepTrace(step=len(row.steps), tree=tree, acceptance=acc,
                          target_token_probs=torch.full((tree.n_nodes,), float("nan")),
                          expected_accepted=float(acc.n_accepted), draft_time_s=draft_time,
                          verify_time_s=0.0, drafter=drafter.name, context_len=len(row.tokens))
        row.steps.append(trace)
        drafter.observe(trace)
        row.commit(acc.committed_tokens, stops)
    return finish_row(target, row, start, drafter.name, "greedy", GREEDY, budget)


def _replay_step(tree: DraftTree, continuation: list[int], offset: int) -> Acceptance:
    """The greedy verifier's acceptance of ``tree`` when the target's next tokens are
    ``continuation[offset:]``."""
    tokens = tree.tokens.tolist()
    accept_prob = [math.nan] * len(tokens)
    accept_prob[0] = 1.0
    tried = [False] * len(tokens)
    tried[0] = True

    def wanted(node: int, depth: int) -> int:
        at = offset + depth
        if at >= len(continuation):
            raise ValueError(
                f"the reference has {len(continuation)} new tokens but this step needs token {at}; "
                "record the reference with plain_generate(..., stop_at_eos=False) and a budget at least "
                "as large as the replay's")
        return continuation[at]

    def on_try(node: int, hit: bool) -> None:
        tried[node] = True
        accept_prob[node] = 1.0 if hit else 0.0

    path, bonus = greedy_walk(children_lists(tree), tokens, wanted, on_try)
    return Acceptance(
        accepted_nodes=tuple(path), accepted_tokens=tuple(tokens[s] for s in path), bonus_token=bonus,
        node_accept_prob=torch.tensor(accept_prob, dtype=torch.float32),
        tried=torch.tensor(tried, dtype=torch.bool), rule="greedy", lossless=True)


# -- greedy references ----------------------------------------------------------------------

def reference_key(target: LoadedModel, prompt_ids: Sequence[int], max_new_tokens: int) -> str:
    """Unit id of a greedy reference in a :class:`~specviz.data.store.ResultStore`: the
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
            steps=(), wall_s=float(row["wall_time_s"]), stop_reason=str(row["stop_reason"]), drafter="none",
            verifier="none", config=GREEDY, max_new_tokens=max_new_tokens)
    ref = plain_generate(target, ids, max_new_tokens=max_new_tokens, config=GREEDY, chat=chat, stop_at_eos=False)
    if store is not None:
        store.add(key, {"output_ids": list(ref.output_ids), "wall_time_s": ref.wall_s,
                        "stop_reason": ref.stop_reason})
    return ref


# -- replays of shapes and dynamic trees -------------------------------------------------------

class _Continuation:
    """A greedy reference and the stopping rules a replay follows (those of the engine)."""

    def __init__(self, reference: GenerationResult, target: LoadedModel | None, stop_ids: Sequence[int] | None,
                 max_new_tokens: int | None, max_context: int | None) -> None:
        if not isinstance(reference, GenerationResult):
            raise TypeError(f"reference must be a GenerationResult, got {type(reference).__name__}")
        if not reference.config.greedy:
            raise ValueError(f"replays need a greedy reference, got temperature {reference.config.temperature}")
        self.tokens = list(reference.output_ids)
        self.prompt_len = len(reference.prompt_ids)
        budget = reference.max_new_tokens if max_new_tokens is None else max_new_tokens
        if budget > len(self.tokens):
            raise ValueError(f"a replay of {budget} tokens needs a reference at least that long, "
                             f"got {len(self.tokens)} tokens")
        # target supplies the defaults; stop_ids and max_context set them directly
        stops = stop_rules(target, budget) if target is not None else StopRules((), budget)
        self.stops = StopRules(stops.eos if stop_ids is None else tuple(int(t) for t in stop_ids), budget,
                               stops.max_context if max_context is None else max_context)

    @property
    def budget(self) -> int:
        """The replay's token budget."""
        return self.stops.max_new_tokens

    def room(self, generated: int) -> int:
        """Tokens a step may still commit after ``generated`` (:meth:`StopRules.room`)."""
        return self.stops.room(self.prompt_len, generated)

    def commit(self, generated: int, accepted: int) -> tuple[int, bool]:
        """Tokens committed by a step accepting ``accepted`` draft tokens at ``generated``,
        and whether the sequence is finished after it."""
        span = self.tokens[generated:generated + accepted + 1]
        committed, reason = self.stops.commit(span, self.prompt_len, generated)
        return len(committed), bool(reason)


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
        ranks: ``(T,)`` ranks of the reference tokens (:func:`specviz.decode.draft_ranks`).
        reference: the greedy reference the ranks belong to.
        target: supplies the end-of-sequence ids and context limit (as in replay_acceptance).
        stop_ids, max_context: set them directly instead of (or over) ``target``'s.
        max_new_tokens: token budget (default the reference's).
    """
    if not isinstance(shape, TreeShape):
        raise TypeError(f"shape must be a TreeShape, got {type(shape).__name__}")
    cont = _Continuation(reference, target, stop_ids, max_new_tokens, max_context)
    ranks_list = torch.as_tensor(ranks).tolist()
    if len(ranks_list) < cont.budget:
        raise ValueError(f"got {len(ranks_list)} ranks for a replay of {cont.budget} tokens")
    node_depth = shape.depths()
    # the shape trimmed to each depth limit a step meets: (children, drafted, depth)
    trimmed: dict[int, tuple[list[list[int]], int, int]] = {}
    records: list[StepRecord] = []
    generated, done = 0, False
    while not done:
        limit = cont.room(generated) - 1
        if limit not in trimmed:
            kids = children_lists(shape, limit)
            kept = [i for k in kids for i in k]
            trimmed[limit] = (kids, len(kept), max((node_depth[i] for i in kept), default=0))
        kids, drafted, depth = trimmed[limit]
        path, _ = greedy_walk(kids, shape.ranks, lambda u, d: ranks_list[generated + d])
        committed, done = cont.commit(generated, len(path))
        records.append(StepRecord(step=len(records), position=generated, drafted=drafted, depth=depth,
                                  accepted=len(path), extendable=bool(kids[path[-1] if path else 0]),
                                  committed=committed))
        generated += committed
    return tuple(records)


def oracle_depth(ranks: Sequence[int], budget: int, limit: int, max_rank: int | None = None) -> tuple[int, int]:
    """Deepest path a rank-ordered tree of ``budget`` nodes could reach, with hindsight.

    A drafter that adds candidates in the draft's rank order (every static shape of
    :mod:`specviz.tree.shapes`, EAGLE-2's dynamic trees) holds the rank-``r`` child of a
    node only together with its ``r`` better-ranked siblings, so reaching depth ``d``
    along the continuation costs ``sum(ranks[i] + 1 for i < d)`` nodes.

    Args:
        ranks: 0-based ranks of the next continuation tokens among the draft's
            candidates (teacher-forced, :func:`specviz.decode.draft_ranks`).
        budget: draft nodes per step.
        limit: deepest depth the step may reach (room left minus the bonus token).
        max_rank: a rank at or above it means "not among the candidates" (stops the path).

    Returns:
        ``(depth, nodes)``: the depth reached and the nodes its path needs.
    """
    depth = cost = 0
    for r in ranks[:max(limit, 0)]:
        if max_rank is not None and r >= max_rank:
            break
        if cost + r + 1 > budget:
            break
        cost += r + 1
        depth += 1
    return depth, cost


def replay_oracle(ranks: torch.Tensor, reference: GenerationResult, budget: int, *,
                  target: LoadedModel | None = None, stop_ids: Sequence[int] | None = None,
                  max_new_tokens: int | None = None, max_context: int | None = None,
                  max_rank: int = 64) -> tuple[StepRecord, ...]:
    """Greedy replay of the hindsight-best rank-ordered tree at every step: an upper bound.

    At each step the oracle knows the target's next tokens and spends its ``budget``
    nodes on the single path that reaches deepest (:func:`oracle_depth`), so no drafter
    whose trees take the draft's candidates in rank order (chains, static shapes,
    Sequoia, EAGLE-2) can accept more at that budget along the same continuation.
    Drafts that do not come from the draft model's ranking (n-gram, lookahead) are not
    bounded by it. Records say ``drafted`` = the nodes the path needed.

    Args:
        ranks: ``(T,)`` teacher-forced ranks of the reference's tokens
            (:func:`specviz.decode.draft_ranks`; ``max_rank`` there marks "not found").
        reference: the greedy reference the ranks belong to.
        budget: draft nodes per step (root excluded).
        target, stop_ids, max_new_tokens, max_context: stopping rules, as in :func:`replay_shape`.
        max_rank: the ``max_rank`` the ranks were computed with.
    """
    check_int("budget", budget)
    cont = _Continuation(reference, target, stop_ids, max_new_tokens, max_context)
    ranks_list = torch.as_tensor(ranks).tolist()
    if len(ranks_list) < cont.budget:
        raise ValueError(f"got {len(ranks_list)} ranks for a replay of {cont.budget} tokens")
    records: list[StepRecord] = []
    generated, done = 0, False
    while not done:
        limit = cont.room(generated) - 1
        depth, cost = oracle_depth(ranks_list[generated:], budget, limit, max_rank)
        committed, done = cont.commit(generated, depth)
        records.append(StepRecord(step=len(records), position=generated, drafted=cost, depth=depth,
                                  accepted=depth, extendable=depth < limit, committed=committed))
        generated += committed
    return tuple(records)


def _path_scores(tree: DraftTree) -> list[float]:
    """Cumulative draft log-probability of every node's path, summed root to node in the
    order :class:`~specviz.draft.model.DynamicTreeDrafter` sums it (root = 0)."""
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
    kids = children_lists(tree, limit)
    path, _ = greedy_walk(kids, tree.tokens.tolist(), lambda u, d: cont[generated + d])
    d = depths(tree).tolist()
    kept = [i for k in kids for i in k]
    return len(kept), max((d[i] for i in kept), default=0), len(path), bool(kids[path[-1] if path else 0])


class _DynamicReplay:
    """The state of one :func:`replay_dynamic`: a drafter, and where each budget's replay is."""

    def __init__(self, draft: LoadedModel, reference: GenerationResult, budgets: list[int], topk: int, depth: int,
                 target: LoadedModel | None, stop_ids: Sequence[int] | None, max_new_tokens: int | None,
                 max_context: int | None) -> None:
        self.cont = _Continuation(reference, target, stop_ids, max_new_tokens, max_context)
        self.drafter = DynamicTreeDrafter(draft, topk=topk, depth=depth, budget=budgets[-1])
        self.drafter.reset()
        self.prompt = list(reference.prompt_ids)
        self.position = {b: 0 for b in budgets}
        self.records: dict[int, list[StepRecord]] = {b: [] for b in budgets}
        self.active = set(budgets)
        self.generated = 0

    def context(self) -> torch.Tensor | None:
        """``(L,)`` the context the drafter drafts at next (the earliest position an
        unfinished budget's replay is at), None when every budget is done."""
        if not self.active:
            return None
        self.generated = min(self.position[b] for b in self.active)
        return torch.tensor(self.prompt + self.cont.tokens[:self.generated])

    def take(self, full: DraftTree) -> None:
        """Walk the tree drafted at :meth:`context` for every budget replaying from there."""
        generated, cont = self.generated, self.cont
        scores = _path_scores(full)
        for b in sorted(self.active):
            if self.position[b] != generated:
                continue
            tree = _top_nodes(full, scores, b)
            drafted, tree_depth, accepted, extendable = _walk(tree, cont.tokens, generated, cont.room(generated) - 1)
            committed, done = cont.commit(generated, accepted)
            self.records[b].append(StepRecord(step=len(self.records[b]), position=generated, drafted=drafted,
                                              depth=tree_depth, accepted=accepted, extendable=extendable,
                                              committed=committed))
            self.position[b] = generated + committed
            if done:
                self.active.discard(b)

    def result(self) -> dict[int, tuple[StepRecord, ...]]:
        """``{budget: steps}`` of every budget."""
        return {b: tuple(r) for b, r in self.records.items()}


def _dynamic_budgets(budgets: Sequence[int]) -> list[int]:
    """The distinct budgets, in increasing order, checked to be positive ints."""
    budgets = sorted(set(budgets))
    if not budgets:
        raise ValueError("budgets must name at least one budget")
    check_ints("budgets", budgets)
    return budgets


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
    state = _DynamicReplay(draft, reference, _dynamic_budgets(budgets), topk, depth, target, stop_ids,
                           max_new_tokens, max_context)
    while (context := state.context()) is not None:
        state.take(state.drafter.draft(context, GREEDY, "greedy", None))
    return state.result()


def replay_dynamic_batch(draft: LoadedModel, references: Sequence[GenerationResult], budgets: Sequence[int], *,
                         topk: int = 4, depth: int = 5, target: LoadedModel | None = None,
                         stop_ids: Sequence[int] | None = None, max_new_tokens: int | None = None,
                         max_context: int | None = None) -> list[dict[int, tuple[StepRecord, ...]]]:
    """:func:`replay_dynamic` of several references at once, their draft forwards batched.

    Every reference keeps its own drafter and cache and runs exactly the logic of
    :func:`replay_dynamic`; only the draft-model forwards that the replays need at the
    same moment run as one batched forward (:func:`specviz.draft.draft_all`), which reads
    the draft's weights once for all of them. Results equal one :func:`replay_dynamic`
    per reference up to the floating-point rounding of batched products. References of
    similar prompt length batch best (the first forward of each drafter feeds its whole
    prompt, padded to the longest).

    Returns:
        one ``{budget: steps}`` per reference, in order.
    """
    if isinstance(references, GenerationResult) or not len(references):
        raise ValueError("references must be a non-empty list of greedy references")
    budgets = _dynamic_budgets(budgets)
    states = [_DynamicReplay(draft, ref, budgets, topk, depth, target, stop_ids, max_new_tokens, max_context)
              for ref in references]
    while True:
        live = [(state, context) for state in states if (context := state.context()) is not None]
        if not live:
            break
        trees = draft_all([s.drafter for s, _ in live], [c for _, c in live], GREEDY, "greedy", [None] * len(live))
        for (state, _), tree in zip(live, trees):
            state.take(tree)
    return [state.result() for state in states]
