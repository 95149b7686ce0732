"""Drafters that run a draft language model: static trees, chains and EAGLE-2 trees.

* :class:`ModelDrafter` - the plumbing they share: a :class:`~specviz.draft.base.DraftModelState`
  (the draft model's KV cache for one sequence) and :meth:`~ModelDrafter.draft` serving
  the forwards that a :class:`~specviz.draft.base.Stepwise` drafter requests;
* :class:`TreeDrafter` - a static :class:`~specviz.tree.shapes.TreeShape` filled with the
  draft's ranked (or sampled) candidates; :class:`ChainDrafter` is the chain shape;
* :class:`DynamicTreeDrafter` - EAGLE-2: grow by cumulative draft log-probability,
  keep the global top-k per depth, rerank everything to the top ``budget`` nodes
  (:func:`grow_dynamic_tree`, which any draft that gives logits can drive).

Probabilities recorded on the tree (``tree.q``) are the draft distribution the siblings
came from (after the sampling configuration); under greedy decoding, where that
distribution is one-hot, ``q`` holds the draft's temperature-1 probabilities so that a
picture or a calibration still has something to show (:func:`draft_distribution`).

Dimension legend: L = committed length, N = tree nodes incl. root, V = vocabulary,
n = nodes fed in one forward, k = top-k candidates per frontier node.
"""

from __future__ import annotations

import copy
import math
from abc import abstractmethod
from typing import Generator, Sequence

import torch

from specviz.draft.base import Drafter, DraftModelState, fresh_copy, run_draft_steps
from specviz.sampling import (
    SamplingConfig,
    check_sibling_sampling,
    probs_from_logits,
    require_deterministic_siblings,
    siblings_sampled,
)
from specviz.tree.core import DraftTree
from specviz.tree.shapes import TreeShape, chain
from specviz.validate import check_int

__all__ = [
    "ModelDrafter",
    "draft_distribution",
    "choose_children",
    "drafted_tree",
    "TreeDrafter",
    "ChainDrafter",
    "DynamicTreeDrafter",
    "grow_dynamic_tree",
]


def draft_distribution(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """The draft distribution siblings are drawn from, ``(..., V)``; temperature 1 under
    greedy decoding (see the module docstring)."""
    if config.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return probs_from_logits(logits, config)


def choose_children(logits: torch.Tensor, dist: torch.Tensor, ranks: Sequence[int], config: SamplingConfig,
                    mode: str, generator: torch.Generator | None) -> list[tuple[int, int]]:
    """Tokens for one node's children: ``(token, rank)`` per requested child, possibly fewer.

    Deterministic modes (and greedy decoding) take the draft's candidates of the given
    ranks; "iid" draws one token per child with replacement, "without_replacement"
    draws distinct tokens (fewer when the distribution has a smaller support).
    Shapes: ``logits``, ``dist`` ``(V,)``.
    """
    if not siblings_sampled(config, mode):
        top = torch.topk(logits, max(ranks) + 1).indices.tolist()
        return [(top[r], r) for r in ranks]
    count = len(ranks)
    if mode == "without_replacement":
        count = min(count, int((dist > 0).sum()))
    drawn = torch.multinomial(dist, count, replacement=(mode == "iid"), generator=generator).tolist()
    return [(t, int((dist > dist[t]).sum())) for t in drawn]


class ModelDrafter(Drafter):
    """Shared plumbing of drafters that run a draft model with a :class:`DraftModelState`:
    subclasses write :meth:`draft_steps`, and :meth:`draft` serves its requests.

    ``vocab=N`` drafts with a reduced vocabulary: the draft model's LM head scores only the
    ``N`` most frequent tokens of its ranking plus the tokens of the sequence
    (:mod:`specviz.draft.vocab`); the others are never proposed. None scores all."""

    def __init__(self, draft, vocab: int | None = None) -> None:
        self.draft_model = draft
        self.vocab = vocab
        self._head = None
        if vocab is not None:
            from specviz.draft.vocab import reduced_head

            self._head = reduced_head(draft, vocab)
            self.name = f"{self.name[:-1]},v={vocab})" if getattr(self, "name", "").endswith(")") else self.name
        self.reset()

    def draft(self, context, config, sibling_sampling, generator) -> DraftTree:
        return run_draft_steps(self.draft_steps(context, config, sibling_sampling, generator))

    @abstractmethod
    def draft_steps(self, context, config, sibling_sampling, generator):
        """See :class:`~specviz.draft.base.Stepwise`."""

    def reset(self) -> None:
        self.state = DraftModelState(self.draft_model.model, head=self._head)

    def spawn(self) -> "ModelDrafter":
        if self._head is None:
            return fresh_copy(self)
        clone = copy.copy(self)
        clone._head = self._head.fresh()  # the fixed rows shared, the sequence's own tokens per copy
        clone.reset()
        return clone

    @property
    def tokenizers(self) -> tuple:
        return (self.draft_model.tokenizer,)

    @property
    def forwards(self) -> int:
        """Draft-model forward passes in the last :meth:`draft` call."""
        return self.state.forwards

    @staticmethod
    def _context(context) -> list[int]:
        t = torch.as_tensor(context)
        if t.dim() != 1 or t.numel() == 0:
            raise ValueError(f"context must be a non-empty 1-D tensor of token ids, got shape {tuple(t.shape)}")
        return t.tolist()


def drafted_tree(root: int, tokens: list[int], parents: list[int], q: list[float], ranks: list[int],
                 draft_probs: torch.Tensor | None) -> DraftTree:
    """The :class:`~specviz.tree.DraftTree` of drafted nodes given as lists without the root
    (``parents`` index the full tree, 0 = the root); ``draft_probs`` is ``(N, V)`` or None."""
    return DraftTree(
        torch.tensor([root] + tokens, dtype=torch.long),
        torch.tensor([-1] + parents, dtype=torch.long),
        q=torch.tensor([1.0] + q, dtype=torch.float32),
        ranks=torch.tensor([0] + ranks, dtype=torch.long),
        draft_probs=draft_probs,
    )


class TreeDrafter(ModelDrafter):
    """A draft LM filling a static tree shape, one batched draft forward per depth.

    Node ``i`` of the shape takes its parent's candidate of rank ``shape.ranks[i]``
    (deterministic modes) or the next i.i.d. / without-replacement sample (sampling
    modes). Leaves are never fed to the draft model; a chain of ``k`` costs ``k``
    forwards (the sync included).

    Args:
        draft: the draft :class:`~specviz.models.LoadedModel`.
        shape: a :class:`~specviz.tree.shapes.TreeShape`.
        vocab: score only this many tokens plus the sequence's own (see :class:`ModelDrafter`).
    """

    def __init__(self, draft, shape: TreeShape, vocab: int | None = None) -> None:
        if not isinstance(shape, TreeShape):
            raise TypeError(f"shape must be a specviz.tree.shapes.TreeShape, got {type(shape).__name__}")
        self.shape = shape
        self.name = f"tree(n={shape.budget},d={shape.depth})"
        super().__init__(draft, vocab)

    def draft_steps(self, context, config, sibling_sampling, generator):
        check_sibling_sampling(sibling_sampling)
        ctx = self._context(context)
        root_logits = (yield self.state.sync(ctx))[-1]  # (V,)
        shape = self.shape
        sampled = siblings_sampled(config, sibling_sampling)
        kids: list[list[int]] = [[] for _ in range(shape.n_nodes)]
        for i in range(1, shape.n_nodes):
            kids[shape.parents[i]].append(i)
        # out[i] = index of shape node i in the drafted tree (absent: not drafted)
        out: dict[int, int] = {0: 0}
        tokens, parents, qs, ranks = [], [], [], []
        handle = {0: -1}
        logits_at = {0: root_logits}
        rows: dict[int, torch.Tensor] = {}  # drafted-tree index -> draft distribution
        level = [0]
        while level:
            nxt = []
            for u in level:
                if not kids[u]:
                    continue
                dist = draft_distribution(logits_at[u], config)  # (V,)
                if sampled:
                    rows[out[u]] = dist
                picks = choose_children(logits_at[u], dist, [shape.ranks[c] for c in kids[u]],
                                         config, sibling_sampling, generator)
                for c, (tok, rank) in zip(kids[u], picks):
                    out[c] = len(tokens) + 1
                    tokens.append(tok)
                    parents.append(out[u])
                    qs.append(float(dist[tok]))
                    ranks.append(rank)
                    nxt.append(c)
            feed = [c for c in nxt if kids[c]]
            if feed:
                request, handles = self.state.expand([tokens[out[c] - 1] for c in feed],
                                                     [handle[shape.parents[c]] for c in feed])
                logits = yield request  # (n, V)
                for c, h, row in zip(feed, handles, logits):
                    handle[c], logits_at[c] = h, row
            level = nxt
        draft_probs = None
        if sampled:
            draft_probs = torch.zeros(len(tokens) + 1, root_logits.shape[-1])  # (N, V)
            for i, row in rows.items():
                draft_probs[i] = row
        return drafted_tree(ctx[-1], tokens, parents, qs, ranks, draft_probs)


class ChainDrafter(TreeDrafter):
    """Classic speculative decoding: a draft LM proposes a chain of ``k`` tokens.

    Args:
        draft: the draft :class:`~specviz.models.LoadedModel`.
        k: chain length (draft tokens per step).
        vocab: score only this many tokens plus the sequence's own (see :class:`ModelDrafter`).
    """

    def __init__(self, draft, k: int = 4, vocab: int | None = None) -> None:
        check_int("k", k)
        super().__init__(draft, chain(k), vocab)
        self.k = k
        self.name = f"chain(k={k})" if vocab is None else f"chain(k={k},v={vocab})"


class DynamicTreeDrafter(ModelDrafter):
    """EAGLE-2's context-dependent draft tree (Li et al. 2024).

    Every node is scored by the cumulative draft log-probability of its path. Depth by
    depth, each frontier node proposes its ``topk`` best children and the global
    ``topk`` of those (by score) become the next frontier, fed to the draft model in one
    batched forward. After ``depth`` depths all proposed nodes are reranked and the top
    ``budget`` kept; scores never increase along a path, so the kept set is a tree.

    Siblings are deterministic, so under sampling use a verifier whose
    ``sibling_sampling`` is "topk" (rule D is exact for any deterministic siblings).

    Args:
        draft: the draft :class:`~specviz.models.LoadedModel`.
        topk: children per frontier node and frontier width.
        depth: tree depth (draft forwards per step, the sync included).
        budget: draft nodes kept after reranking.
        vocab: score only this many tokens plus the sequence's own (see :class:`ModelDrafter`).
    """

    def __init__(self, draft, topk: int = 4, depth: int = 5, budget: int = 16, vocab: int | None = None) -> None:
        for name, value in (("topk", topk), ("depth", depth), ("budget", budget)):
            check_int(name, value)
        self.topk, self.depth, self.budget = topk, depth, budget
        self.name = f"dynamic(k={topk},d={depth},n={budget})"
        super().__init__(draft, vocab)

    def draft_steps(self, context, config, sibling_sampling, generator):
        return (yield from self._grow(context, config, sibling_sampling, self.budget))

    def draft_steps_within(self, max_nodes, context, config, sibling_sampling, generator):
        check_int("max_nodes", max_nodes)
        return (yield from self._grow(context, config, sibling_sampling, min(self.budget, max_nodes)))

    def _grow(self, context, config, sibling_sampling, budget: int):
        require_deterministic_siblings(self.name, config, sibling_sampling)
        ctx = self._context(context)
        root_logits = (yield self.state.sync(ctx))[-1]  # (V,)
        grow = grow_dynamic_tree(ctx[-1], root_logits, config, self.topk, self.depth, budget)
        handle = {-1: -1}  # pool node -> its draft-cache handle
        try:
            frontier = next(grow)
            while True:
                request, handles = self.state.expand([t for _, t, _ in frontier], [handle[p] for _, _, p in frontier])
                logits = yield request  # (n, V)
                handle.update(zip([i for i, _, _ in frontier], handles))
                frontier = grow.send(logits)
        except StopIteration as done:
            return done.value


def grow_dynamic_tree(root: int, root_logits: torch.Tensor, config: SamplingConfig, topk: int, depth: int,
                      budget: int, token_ids: torch.Tensor | Sequence[int] | None = None
                      ) -> Generator[list[tuple[int, int, int]], torch.Tensor, DraftTree]:
    """EAGLE-2's tree growth for any draft that scores a node's children from logits.

    A generator: it yields each new frontier as ``(node, token, parent)`` triples (``node``
    and ``parent`` are ids in the pool of proposed nodes, -1 = the root), receives the
    draft's ``(n, V)`` logits after each frontier node, and returns the reranked
    :class:`~specviz.tree.DraftTree`. Every proposed node is scored by the cumulative
    draft log-probability of its path; each frontier node proposes its ``topk`` best
    children (children of zero probability are skipped), the global ``topk`` of those
    become the next frontier, and after ``depth`` depths the ``budget`` best nodes of the
    whole pool are kept. :class:`DynamicTreeDrafter` drives it with a draft model, the
    EAGLE drafter of :mod:`specviz.heads` with a feature head.

    Args:
        root: the root's token (the last committed token).
        root_logits: ``(V,)`` the draft's logits after the root.
        config: the sampling configuration (greedy: temperature-1 probabilities).
        topk, depth, budget: as in :class:`DynamicTreeDrafter`.
        token_ids: ``(W,)`` the token id of each logits column (a tensor or a list; a list
            saves converting a large vocabulary every step) when the draft scores only
            part of the vocabulary (a reduced draft vocabulary: ``(W,)`` root logits and
            ``(n, W)`` after each frontier, the same tree as ``-inf`` logits everywhere
            else would give, for less work per node); None: column ``i`` is token ``i``.
    """
    ids = token_ids if token_ids is None or isinstance(token_ids, list) else torch.as_tensor(token_ids).tolist()
    # Pool of every proposed node: token, pool parent (-1 = root), path score, q, rank.
    tok: list[int] = []
    par: list[int] = []
    score: list[float] = []
    qv: list[float] = []
    rank: list[int] = []
    frontier, frontier_logits = [-1], root_logits[None]  # (n, V)
    frontier_score = [0.0]
    for d in range(1, depth + 1):
        dist = draft_distribution(frontier_logits, config)  # (n, V)
        top_p, top_i = torch.topk(dist, min(topk, dist.shape[-1]), dim=-1)  # (n, k)
        new = []
        for row, parent in enumerate(frontier):
            for r in range(top_p.shape[-1]):
                p = float(top_p[row, r])
                if p <= 0.0:
                    break
                new.append(len(tok))
                tok.append(int(top_i[row, r]) if ids is None else ids[int(top_i[row, r])])
                par.append(parent)
                score.append(frontier_score[row] + math.log(p))
                qv.append(p)
                rank.append(r)
        if d == depth or not new:
            break
        frontier = sorted(new, key=lambda i: (-score[i], i))[:topk]
        frontier.sort()
        frontier_logits = yield [(i, tok[i], par[i]) for i in frontier]  # (n, V)
        frontier_score = [score[i] for i in frontier]
    keep = sorted(sorted(range(len(tok)), key=lambda i: (-score[i], i))[:budget])
    index = {-1: 0}
    for j, i in enumerate(keep):
        index[i] = j + 1
    return drafted_tree(root, [tok[i] for i in keep], [index[par[i]] for i in keep],
                        [qv[i] for i in keep], [rank[i] for i in keep], None)
