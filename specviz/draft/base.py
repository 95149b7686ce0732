"""Drafters: anything that proposes a draft tree for the next speculative step.

Every drafter implements :class:`Drafter`: given the committed token ids (whose last
element becomes the tree's root), a :class:`~specviz.sampling.SamplingConfig` and the
verifier's sibling-sampling mode, return a :class:`~specviz.tree.DraftTree`.

Sibling sampling modes (set by the verifier, see ``specviz.verify``):

* ``"greedy"`` / ``"topk"`` - siblings are the draft's top-k tokens (deterministic);
* ``"iid"`` - siblings are drawn independently from the draft distribution (rule B);
* ``"without_replacement"`` - siblings are drawn without replacement (rule C).

Under greedy decoding (temperature 0) every drafter proposes the draft's top-ranked
tokens whatever the mode, since every lossless rule then reduces to greedy.

The model-based drafters here share one engine, :class:`DraftModelState`: the draft
model's own KV cache for one sequence, kept in sync with the committed tokens. A step
feeds only what the draft model has not seen (usually just the bonus token: draft
nodes that the target accepted keep their cached entries), then expands the tree one
depth at a time, every node of a depth in one batched forward with the tree mask.
They are written as generators (:meth:`Drafter.draft_steps`) that *request* forwards
(:class:`DraftForward`) rather than run them, so batched decoding serves the requests
of all sequences in one forward per draft model (:func:`draft_all`) while every
sequence runs exactly the logic it would run alone.

* :class:`TreeDrafter` - a static :class:`~specviz.shapes.TreeShape` filled with the
  draft's ranked (or sampled) candidates; :class:`ChainDrafter` is the chain shape;
* :class:`DynamicTreeDrafter` - EAGLE-2: grow by cumulative draft log-probability,
  keep the global top-k per depth, rerank everything to the top ``budget`` nodes;
* :class:`AdaptiveChainDrafter` - a chain whose length follows recent acceptance,
  either with the popular +2/-1 heuristic or with specviz's expected-throughput rule;
* :class:`SelfSpeculativeDrafter` - the target's own first layers plus its LM head;
* :class:`MergedDrafter` - SpecInfer's token-tree merge of several drafters.

The n-gram drafters live in :mod:`specviz.ngram`; :func:`make_drafter` builds any of
them by name.

Probabilities recorded on the tree (``tree.q``) are the draft distribution the siblings
came from (after the sampling configuration); under greedy decoding, where that
distribution is one-hot, ``q`` holds the draft's temperature-1 probabilities so that a
picture or a calibration still has something to show.

Dimension legend: L = committed length, N = tree nodes incl. root, V = vocabulary,
F = draft nodes fed to the draft model this step, n = nodes fed in one forward.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generator, Sequence

import torch

from specviz.models.kvcache import (
    cache_length,
    compact_cache,
    crop_cache,
    forward_tokens,
    new_cache,
    split_cache,
    stack_caches,
)
from specviz.draft.merge import merge_trees
from specviz.models.loading import LoadedModel
from specviz.sampling import SamplingConfig, probs_from_logits
from specviz.tree.shapes import TreeShape, chain
from specviz.tree.core import DraftTree

__all__ = [
    "Drafter",
    "SIBLING_MODES",
    "check_sibling_sampling",
    "DraftForward",
    "DraftModelState",
    "run_draft_forwards",
    "draft_all",
    "TreeDrafter",
    "ChainDrafter",
    "DynamicTreeDrafter",
    "AdaptiveChainDrafter",
    "ADAPTIVE_SCHEDULES",
    "SelfSpeculativeDrafter",
    "truncated_model",
    "MergedDrafter",
    "DRAFT_STRATEGIES",
    "make_drafter",
]

SIBLING_MODES = ("greedy", "topk", "iid", "without_replacement")
_DETERMINISTIC_MODES = ("greedy", "topk")


def check_sibling_sampling(mode: str) -> str:
    """Return ``mode`` if it is one of :data:`SIBLING_MODES`, else raise ValueError."""
    if mode not in SIBLING_MODES:
        raise ValueError(f"sibling_sampling must be one of {SIBLING_MODES}, got {mode!r}")
    return mode


class Drafter(ABC):
    """Interface of every draft strategy.

    A drafter may keep state between steps (a draft model's KV cache, an n-gram index,
    recent acceptance); it must stay correct when ``context`` is not an extension of
    the previous call's (e.g. a new prompt): compare and rebuild as needed.
    :meth:`reset` must *rebind* per-sequence state to fresh objects (not clear shared
    ones in place), so that :meth:`spawn`'s shallow copy shares nothing mutable.
    """

    #: short human-readable name used in traces, tables and legends
    name: str = "drafter"

    @abstractmethod
    def draft(self, context: torch.Tensor, config: SamplingConfig, sibling_sampling: str,
              generator: torch.Generator | None) -> DraftTree:
        """Propose a draft tree whose root is ``context[-1]``.

        Args:
            context: ``(L,)`` long tensor of committed token ids (prompt + generated).
            config: the sampling configuration shared with the verifier.
            sibling_sampling: one of ``SIBLING_MODES``.
            generator: random source for sampled drafts.

        Returns:
            A tree with at least the root; a root-only tree means "no proposal" and the
            engine then takes one plain target step.
        """

    def draft_steps(self, context: torch.Tensor, config: SamplingConfig, sibling_sampling: str,
                    generator: torch.Generator | None) -> Generator["DraftForward", torch.Tensor, DraftTree]:
        """:meth:`draft` as a generator: yields the draft-model forwards it needs
        (:class:`DraftForward`), receives their logits, returns the tree. Batched decoding
        drives many of these at once (:func:`draft_all`). Drafters without a model
        request nothing."""
        yield from ()
        return self.draft(context, config, sibling_sampling, generator)

    def observe(self, step) -> None:  # noqa: B027 - optional hook, no-op by default
        """Called with each finished :class:`~specviz.decode.StepTrace` (adaptive drafters
        update themselves here)."""

    def reset(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Forget all per-sequence state (caches, statistics)."""

    def spawn(self) -> "Drafter":
        """A drafter with the same settings and shared weights but fresh per-sequence
        state; batched decoding gives one to every row."""
        clone = copy.copy(self)
        clone.reset()
        return clone

    @property
    def tokenizers(self) -> tuple:
        """Tokenizers whose ids this drafter proposes (empty for model-free drafters);
        the engine checks them against the target's."""
        return ()


# -- the draft model's KV cache for one sequence ------------------------------------------------

@dataclass
class DraftForward:
    """One draft-model forward that one sequence needs: feed ``tokens`` after the slots of
    ``state.cache``.

    Attributes:
        state: the sequence's :class:`DraftModelState` (its cache grows by the tokens).
        tokens: token ids to feed.
        positions: their rotary positions.
        allowed: ``(n, S + n)`` bool, which of the S cached slots and the n new tokens
            each new token may attend to; None = every cached slot plus causal among the
            new tokens.
    """

    state: "DraftModelState"
    tokens: list[int]
    positions: list[int]
    allowed: torch.Tensor | None


class DraftModelState:
    """A draft model's KV cache for one sequence plus the draft nodes fed this step.

    The cache holds the committed tokens ``tokens`` in slots ``[0, L)`` followed by the
    draft nodes fed during the current step (slot ``L + handle``). :meth:`sync`
    re-synchronises with a new context: fed nodes that the context now contains (the
    accepted path) are moved into place, everything else past the common prefix is
    dropped, and only the missing tokens are fed. :meth:`expand` feeds draft nodes with
    the tree mask and depth-based positions.

    Both return a :class:`DraftForward` request instead of running the model, so that
    :func:`run_draft_forwards` can serve the requests of many sequences in one batched
    forward; the bookkeeping is done when the request is made.

    Args:
        model: the transformers causal LM that drafts.
    """

    def __init__(self, model) -> None:
        self.model = model
        self.reset()

    def reset(self) -> None:
        self.cache = new_cache(self.model)
        self.tokens: list[int] = []
        self._fed_tokens: list[int] = []
        self._fed_parent: list[int] = []  # handle of the parent, -1 = the root
        self._fed_depth: list[int] = []
        self.forwards = 0  # forward passes since the last sync(), the sync included

    @property
    def n_fed(self) -> int:
        return len(self._fed_tokens)

    def sync(self, context: Sequence[int]) -> DraftForward:
        """Sync with ``context``; the request's last logits row is the draft's distribution
        after ``context[-1]`` (the root)."""
        context = list(context)
        if not context:
            raise ValueError("context must hold at least one token")
        old = self.tokens
        common = 0
        if len(context) >= len(old) and context[:len(old)] == old:
            common = len(old)
            kept = self._accepted_slots(context[common:])
            if kept:
                compact_cache(self.cache, [common], [kept], common + len(kept))
                common += len(kept)
        else:
            limit = min(len(old), len(context))
            while common < limit and old[common] == context[common]:
                common += 1
        # Feed at least the root: its logits are what the first depth is drafted from.
        common = min(common, len(context) - 1)
        crop_cache(self.cache, common)
        self._fed_tokens, self._fed_parent, self._fed_depth = [], [], []
        self.forwards = 1
        self.tokens = context
        return DraftForward(self, context[common:], list(range(common, len(context))), None)

    def _accepted_slots(self, extension: list[int]) -> list[int]:
        """Cache slots of fed draft nodes spelling a prefix of ``extension`` from the root."""
        base = len(self.tokens)
        children: dict[tuple[int, int], int] = {}
        for h, (tok, parent) in enumerate(zip(self._fed_tokens, self._fed_parent)):
            children.setdefault((parent, tok), h)
        slots, node = [], -1
        for tok in extension:
            h = children.get((node, tok))
            if h is None:
                break
            slots.append(base + h)
            node = h
        return slots

    def expand(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[DraftForward, list[int]]:
        """Request a forward of draft nodes; each sees the prefix, its ancestors and itself.

        Args:
            tokens: the nodes' token ids.
            parents: each node's parent handle (-1 = the root; otherwise a handle
                returned by an earlier call of this step).

        Returns:
            The request (its logits: ``(n, V)``, after each node) and the nodes' handles.
        """
        n = len(tokens)
        base = len(self.tokens)
        f0 = self.n_fed
        allowed = torch.zeros(n, base + f0 + n, dtype=torch.bool)  # (n, L + F + n)
        allowed[:, :base] = True
        positions = []
        for j, p in enumerate(parents):
            if not -1 <= p < f0:
                raise ValueError(f"parent handle {p} is not a node fed earlier this step (0..{f0 - 1} or -1)")
            depth = 1 if p == -1 else self._fed_depth[p] + 1
            positions.append(base - 1 + depth)  # the root sits at position L - 1
            allowed[j, base + f0 + j] = True
            while p != -1:
                allowed[j, base + p] = True
                p = self._fed_parent[p]
            self._fed_depth.append(depth)
        self._fed_tokens.extend(int(t) for t in tokens)
        self._fed_parent.extend(int(p) for p in parents)
        self.forwards += 1
        return DraftForward(self, [int(t) for t in tokens], positions, allowed), list(range(f0, f0 + n))


def _own_mask(request: DraftForward) -> torch.Tensor:
    """``(n, S + n)`` bool mask of a request over its own cache slots and new tokens."""
    s = cache_length(request.state.cache)
    n = len(request.tokens)
    if request.allowed is not None:
        return request.allowed
    return torch.cat([torch.ones(n, s, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], dim=1)


def run_draft_forwards(requests: Sequence[DraftForward]) -> list[torch.Tensor]:
    """Serve draft-model forward requests, one batched forward per draft model.

    Requests of different sequences on the same model run together: their caches are
    stacked (right-padded), every row's mask places its own cached slots and new tokens,
    and each cache is written back with just its new entries appended.

    Returns:
        One ``(n_i, V)`` float32 logits tensor per request, in order.
    """
    out: list[torch.Tensor | None] = [None] * len(requests)
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(id(r.state.model), []).append(i)
    for idx in groups.values():
        model = requests[idx[0]].state.model
        if len(idx) == 1:
            r = requests[idx[0]]
            allowed = None if r.allowed is None else r.allowed[None]
            logits = forward_tokens(model, r.state.cache, torch.tensor([r.tokens]), torch.tensor([r.positions]),
                                    allowed)  # (1, n, V)
            out[idx[0]] = logits[0]
            continue
        rows = [requests[i] for i in idx]
        caches = [r.state.cache for r in rows]
        lengths = [cache_length(c) for c in caches]
        counts = [len(r.tokens) for r in rows]
        smax, nmax = max(lengths), max(counts)
        tokens = torch.zeros(len(rows), nmax, dtype=torch.long)  # (B, nmax)
        positions = torch.zeros(len(rows), nmax, dtype=torch.long)
        allowed = torch.zeros(len(rows), nmax, smax + nmax, dtype=torch.bool)  # (B, nmax, Smax + nmax)
        for b, r in enumerate(rows):
            n, s = counts[b], lengths[b]
            tokens[b, :n] = torch.tensor(r.tokens)
            positions[b, :n] = torch.tensor(r.positions)
            positions[b, n:] = r.positions[-1]
            own = _own_mask(r)  # (n, s + n)
            allowed[b, :n, :s] = own[:, :s]
            allowed[b, :n, smax:smax + n] = own[:, s:]
            pad = torch.arange(n, nmax)
            allowed[b, pad, smax + pad] = True  # padding rows see only themselves
        batched = stack_caches(model, caches)
        logits = forward_tokens(model, batched, tokens, positions, allowed)  # (B, nmax, V)
        split_cache(batched, caches, lengths, smax, counts)
        for b, i in enumerate(idx):
            out[i] = logits[b, :counts[b]]
    return out


def _drive(steps: Generator[DraftForward, torch.Tensor, DraftTree]) -> DraftTree:
    """Run a drafting generator to completion, serving its requests one at a time."""
    try:
        request = next(steps)
        while True:
            (logits,) = run_draft_forwards([request])
            request = steps.send(logits)
    except StopIteration as done:
        return done.value


def draft_all(drafters: Sequence[Drafter], contexts: Sequence[torch.Tensor], config: SamplingConfig,
              sibling_sampling: str, generators: Sequence[torch.Generator | None]) -> list[DraftTree]:
    """Draft for several sequences at once (one drafter each), batching draft-model forwards.

    Every drafter runs exactly the logic of its own :meth:`Drafter.draft`; only the
    forwards that several of them need at the same moment are served together.
    """
    steps = [d.draft_steps(c, config, sibling_sampling, g) for d, c, g in zip(drafters, contexts, generators)]
    trees: list[DraftTree | None] = [None] * len(steps)
    pending: dict[int, DraftForward] = {}

    def advance(i: int, logits: torch.Tensor | None) -> None:
        try:
            pending[i] = next(steps[i]) if logits is None else steps[i].send(logits)
        except StopIteration as done:
            pending.pop(i, None)
            trees[i] = done.value

    for i in range(len(steps)):
        advance(i, None)
    while pending:
        order = list(pending)
        for i, logits in zip(order, run_draft_forwards([pending[i] for i in order])):
            advance(i, logits)
    return trees


def _distribution(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """The draft distribution siblings are drawn from, ``(..., V)``; temperature 1 under
    greedy decoding (see the module docstring)."""
    if config.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return probs_from_logits(logits, config)


def _choose_children(logits: torch.Tensor, dist: torch.Tensor, ranks: Sequence[int], config: SamplingConfig,
                     mode: str, generator: torch.Generator | None) -> list[tuple[int, int]]:
    """Tokens for one node's children: ``(token, rank)`` per requested child, possibly fewer.

    Deterministic modes (and greedy decoding) take the draft's candidates of the given
    ranks; "iid" draws one token per child with replacement, "without_replacement"
    draws distinct tokens (fewer when the distribution has a smaller support).
    Shapes: ``logits``, ``dist`` ``(V,)``.
    """
    if config.greedy or mode in _DETERMINISTIC_MODES:
        top = torch.topk(logits, max(ranks) + 1).indices.tolist()
        return [(top[r], r) for r in ranks]
    count = len(ranks)
    if mode == "without_replacement":
        count = min(count, int((dist > 0).sum()))
    drawn = torch.multinomial(dist, count, replacement=(mode == "iid"), generator=generator).tolist()
    return [(t, int((dist > dist[t]).sum())) for t in drawn]


class _ModelDrafter(Drafter):
    """Shared plumbing of drafters that run a draft model with a :class:`DraftModelState`:
    subclasses write :meth:`draft_steps`, and :meth:`draft` serves its requests."""

    def __init__(self, draft) -> None:
        self.draft_model = draft
        self.reset()

    def draft(self, context, config, sibling_sampling, generator) -> DraftTree:
        return _drive(self.draft_steps(context, config, sibling_sampling, generator))

    @abstractmethod
    def draft_steps(self, context, config, sibling_sampling, generator):
        """See :meth:`Drafter.draft_steps`."""

    def reset(self) -> None:
        self.state = DraftModelState(self.draft_model.model)

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


def _build_tree(root: int, tokens: list[int], parents: list[int], q: list[float], ranks: list[int],
                draft_probs: torch.Tensor | None) -> DraftTree:
    return DraftTree(
        torch.tensor([root] + tokens, dtype=torch.long),
        torch.tensor([-1] + parents, dtype=torch.long),
        q=torch.tensor([1.0] + q, dtype=torch.float32),
        ranks=torch.tensor([0] + ranks, dtype=torch.long),
        draft_probs=draft_probs,
    )


class TreeDrafter(_ModelDrafter):
    """A draft LM filling a static tree shape, one batched draft forward per depth.

    Node ``i`` of the shape takes its parent's candidate of rank ``shape.ranks[i]``
    (deterministic modes) or the next i.i.d. / without-replacement sample (sampling
    modes). Leaves are never fed to the draft model; a chain of ``k`` costs ``k``
    forwards (the sync included).

    Args:
        draft: the draft :class:`~specviz.models.LoadedModel`.
        shape: a :class:`~specviz.shapes.TreeShape`.
    """

    def __init__(self, draft, shape: TreeShape) -> None:
        if not isinstance(shape, TreeShape):
            raise TypeError(f"shape must be a specviz.shapes.TreeShape, got {type(shape).__name__}")
        self.shape = shape
        self.name = f"tree(n={shape.budget},d={shape.depth})"
        super().__init__(draft)

    def draft_steps(self, context, config, sibling_sampling, generator):
        check_sibling_sampling(sibling_sampling)
        ctx = self._context(context)
        root_logits = (yield self.state.sync(ctx))[-1]  # (V,)
        shape = self.shape
        sampled = not config.greedy and sibling_sampling not in _DETERMINISTIC_MODES
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
                dist = _distribution(logits_at[u], config)  # (V,)
                if sampled:
                    rows[out[u]] = dist
                picks = _choose_children(logits_at[u], dist, [shape.ranks[c] for c in kids[u]],
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
        return _build_tree(ctx[-1], tokens, parents, qs, ranks, draft_probs)


class ChainDrafter(TreeDrafter):
    """Classic speculative decoding: a draft LM proposes a chain of ``k`` tokens.

    Args:
        draft: the draft :class:`~specviz.models.LoadedModel`.
        k: chain length (draft tokens per step).
    """

    def __init__(self, draft, k: int = 4) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        super().__init__(draft, chain(k))
        self.k = k
        self.name = f"chain(k={k})"


class DynamicTreeDrafter(_ModelDrafter):
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
    """

    def __init__(self, draft, topk: int = 4, depth: int = 5, budget: int = 16) -> None:
        for name, value in (("topk", topk), ("depth", depth), ("budget", budget)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.topk, self.depth, self.budget = topk, depth, budget
        self.name = f"dynamic(k={topk},d={depth},n={budget})"
        super().__init__(draft)

    def draft_steps(self, context, config, sibling_sampling, generator):
        check_sibling_sampling(sibling_sampling)
        if not config.greedy and sibling_sampling not in _DETERMINISTIC_MODES:
            raise ValueError(
                f"{self.name} drafts deterministic top-k siblings; under sampling use a verifier with "
                f"sibling_sampling 'topk' (e.g. 'topk' or 'typical'), not {sibling_sampling!r}")
        ctx = self._context(context)
        root_logits = (yield self.state.sync(ctx))[-1]  # (V,)
        # Pool of every proposed node: token, pool parent (-1 = root), path score, q, rank.
        tok: list[int] = []
        par: list[int] = []
        score: list[float] = []
        qv: list[float] = []
        rank: list[int] = []
        frontier, frontier_logits = [-1], root_logits[None]  # (n, V)
        frontier_score = [0.0]
        handle = {-1: -1}
        for d in range(1, self.depth + 1):
            dist = _distribution(frontier_logits, config)  # (n, V)
            top_p, top_i = torch.topk(dist, self.topk, dim=-1)  # (n, k)
            new = []
            for row, parent in enumerate(frontier):
                for r in range(self.topk):
                    p = float(top_p[row, r])
                    if p <= 0.0:
                        break
                    new.append(len(tok))
                    tok.append(int(top_i[row, r]))
                    par.append(parent)
                    score.append(frontier_score[row] + math.log(p))
                    qv.append(p)
                    rank.append(r)
            if d == self.depth or not new:
                break
            frontier = sorted(new, key=lambda i: (-score[i], i))[:self.topk]
            frontier.sort()
            request, handles = self.state.expand([tok[i] for i in frontier], [handle[par[i]] for i in frontier])
            frontier_logits = yield request  # (n, V)
            frontier_score = [score[i] for i in frontier]
            handle.update(zip(frontier, handles))
        keep = sorted(sorted(range(len(tok)), key=lambda i: (-score[i], i))[:self.budget])
        index = {-1: 0}
        for j, i in enumerate(keep):
            index[i] = j + 1
        return _build_tree(ctx[-1], [tok[i] for i in keep], [index[par[i]] for i in keep],
                           [qv[i] for i in keep], [rank[i] for i in keep], None)


# -- adaptive draft length ------------------------------------------------------------------------

ADAPTIVE_SCHEDULES = ("heuristic", "throughput")


class AdaptiveChainDrafter(_ModelDrafter):
    """A draft-LM chain whose length adapts to recent acceptance.

    ``schedule="heuristic"`` is the rule of Hugging Face's assisted generation
    (``num_assistant_tokens_schedule="heuristic"``): after a step where every draft
    token was accepted, draft 2 more next time, otherwise 1 fewer.

    ``schedule="throughput"`` (specviz's rule) decides token by token, inside the step,
    whether one more draft forward pays for itself. With ``c`` the cost of a draft
    forward relative to a target verify, ``P_i`` the estimated probability that the
    first ``i`` draft tokens are all accepted, ``E = 1 + sum P_i`` the expected tokens
    this step commits and ``T = 1 + k c`` its cost, a ``(k+1)``-th token raises the
    expected throughput ``E / T`` iff ``P_{k+1} > c E / T``. ``P_i`` multiplies a
    *calibrated* acceptance per drafted token: the draft's own probability ``q`` mapped
    through a histogram of how often tokens with that ``q`` were accepted (a Beta prior
    centred on ``q`` itself), updated from every observed step; the unseen next token
    uses the running mean acceptance. So the chain stops early exactly when the draft is
    unsure, and runs long through easy text, rather than reacting one step late.

    Args:
        draft: the draft :class:`~specviz.models.LoadedModel`.
        schedule: "heuristic" or "throughput".
        k_init: chain length of the first step ("heuristic").
        k_min, k_max: bounds on the chain length.
        cost_ratio: draft-forward cost / target-verify cost for "throughput"; None
            measures it online from the step traces' wall times (fix it for
            reproducible runs).
        bins: histogram bins of the calibration of ``q``.
    """

    def __init__(self, draft, schedule: str = "throughput", k_init: int = 4, k_min: int = 1, k_max: int = 12,
                 cost_ratio: float | None = None, bins: int = 10) -> None:
        if schedule not in ADAPTIVE_SCHEDULES:
            raise ValueError(f"schedule must be one of {ADAPTIVE_SCHEDULES}, got {schedule!r}")
        for name, value in (("k_init", k_init), ("k_min", k_min), ("k_max", k_max), ("bins", bins)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not k_min <= k_init <= k_max:
            raise ValueError(f"need k_min <= k_init <= k_max, got {k_min}, {k_init}, {k_max}")
        if cost_ratio is not None and not cost_ratio > 0:
            raise ValueError(f"cost_ratio must be > 0 or None, got {cost_ratio}")
        self.schedule, self.k_init, self.k_min, self.k_max = schedule, k_init, k_min, k_max
        self.cost_ratio, self.bins = cost_ratio, bins
        self.name = f"adaptive-{schedule}"
        super().__init__(draft)

    def reset(self) -> None:
        super().reset()
        self.k = self.k_init
        edges = (torch.arange(self.bins, dtype=torch.float64) + 0.5) / self.bins
        # Beta(2 q, 2 (1 - q)) prior per bin: before any evidence a(q) = q.
        self._accepted = 2.0 * edges
        self._tried = torch.full((self.bins,), 2.0, dtype=torch.float64)
        self._mean_accept = 0.6
        self._t_draft: float | None = None
        self._t_verify: float | None = None
        self.history: list[int] = []  # chain length drafted at each step

    def _calibrated(self, q: float) -> float:
        b = min(int(q * self.bins), self.bins - 1)
        return float(self._accepted[b] / self._tried[b])

    def _ratio(self) -> float:
        if self.cost_ratio is not None:
            return self.cost_ratio
        if self._t_draft is None or self._t_verify is None or self._t_verify <= 0:
            return 0.25  # until measured: roughly a 0.5B draft against a 1.5B target on a CPU
        return self._t_draft / self._t_verify

    def _keep_going(self, reach: float, expected: float, k: int) -> bool:
        """Whether a (k+1)-th draft token is worth a forward, given ``P_k = reach`` and
        ``E = expected`` for the chain of ``k`` drafted so far."""
        c = self._ratio()
        return reach * self._mean_accept > c * expected / (1.0 + k * c)

    def draft_steps(self, context, config, sibling_sampling, generator):
        check_sibling_sampling(sibling_sampling)
        ctx = self._context(context)
        logits = (yield self.state.sync(ctx))[-1]  # (V,)
        limit = self.k if self.schedule == "heuristic" else self.k_max
        tokens, qs, ranks = [], [], []
        rows = []
        reach, expected = 1.0, 1.0  # P_k and E = 1 + sum_i P_i
        parent = -1
        while True:
            dist = _distribution(logits, config)  # (V,)
            (tok, rank), = _choose_children(logits, dist, [0], config, sibling_sampling, generator)
            tokens.append(tok)
            qs.append(float(dist[tok]))
            ranks.append(rank)
            rows.append(dist)
            reach *= self._calibrated(qs[-1])
            expected += reach
            k = len(tokens)
            if k >= limit:
                break
            if self.schedule == "throughput" and k >= self.k_min and not self._keep_going(reach, expected, k):
                break
            request, (parent,) = self.state.expand([tok], [parent])
            logits = (yield request)[0]
        self.history.append(len(tokens))
        draft_probs = None
        if not config.greedy and sibling_sampling not in _DETERMINISTIC_MODES:
            draft_probs = torch.zeros(len(tokens) + 1, logits.shape[-1])  # (N, V)
            draft_probs[:-1] = torch.stack(rows)
        return _build_tree(ctx[-1], tokens, list(range(len(tokens))), qs, ranks, draft_probs)

    def observe(self, step) -> None:
        drafted = step.tree.budget
        accepted = step.acceptance.accept_length
        if self.schedule == "heuristic":
            self.k = min(self.k_max, self.k + 2) if drafted and accepted == drafted else max(self.k_min, self.k - 1)
            return
        q = step.tree.q.tolist()
        for i in range(1, min(accepted + 1, drafted) + 1):  # the tried prefix of the chain
            b = min(int(q[i] * self.bins), self.bins - 1)
            self._tried[b] += 1.0
            self._accepted[b] += 1.0 if i <= accepted else 0.0
            self._mean_accept = 0.9 * self._mean_accept + 0.1 * (1.0 if i <= accepted else 0.0)
        forwards = max(1, drafted)
        if step.verify_time_s > 0:
            t_d, t_v = step.draft_time_s / forwards, step.verify_time_s
            self._t_draft = t_d if self._t_draft is None else 0.8 * self._t_draft + 0.2 * t_d
            self._t_verify = t_v if self._t_verify is None else 0.8 * self._t_verify + 0.2 * t_v


# -- self-speculative drafting ---------------------------------------------------------------------

def truncated_model(model, n_layers: int):
    """A causal LM that runs only the first ``n_layers`` decoder layers of ``model``, then
    its final norm and LM head, sharing every weight with ``model`` (no copy).

    Built with ``model``'s own class from a config with fewer layers; transformers'
    forward then iterates over exactly those layers.
    """
    inner = model.model
    total = len(inner.layers)
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 1 <= n_layers < total:
        raise ValueError(f"n_layers must be an int in [1, {total - 1}] for a {total}-layer model, got {n_layers!r}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:n_layers]
    with torch.device("meta"):
        small = type(model)(config)
    small.model.embed_tokens = inner.embed_tokens
    small.model.layers = torch.nn.ModuleList(list(inner.layers)[:n_layers])
    small.model.norm = inner.norm
    small.model.rotary_emb = inner.rotary_emb
    small.lm_head = model.lm_head
    small.config._attn_implementation = model.config._attn_implementation
    small.eval()
    left = [name for name, t in list(small.named_parameters()) + list(small.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"cannot share these tensors of {type(model).__name__} with a truncated copy: {left[:5]}")
    return small


class SelfSpeculativeDrafter(TreeDrafter):
    """Self-speculative drafting with no extra weights: the target's first ``n_layers``
    layers plus its final norm and LM head draft a tree of the given shape.

    Args:
        target: the target :class:`~specviz.models.LoadedModel`.
        n_layers: decoder layers the draft runs.
        shape: tree shape (default a chain of 4).
    """

    def __init__(self, target, n_layers: int, shape: TreeShape | None = None) -> None:
        small = truncated_model(target.model, n_layers)
        draft = LoadedModel(name=f"{target.name}[:{n_layers}]", model=small, tokenizer=target.tokenizer,
                            dtype=target.dtype)
        super().__init__(draft, shape if shape is not None else chain(4))
        self.n_layers = n_layers
        self.name = f"self(L={n_layers},n={self.shape.budget},d={self.shape.depth})"


# -- merged token trees ----------------------------------------------------------------------------

class MergedDrafter(Drafter):
    """SpecInfer's merged token tree: several drafters' proposals in one tree.

    Each drafter drafts from the same context; the trees are merged so that common
    prefixes are shared (:func:`specviz.merge.merge_trees`) and one target call checks
    them all. ``tree.source`` tells which drafter proposed each node. Merged siblings
    come from different draft distributions, so the merged tree is deterministic
    (no ``draft_probs``): under sampling use a verifier whose ``sibling_sampling`` is
    "topk". The sub-drafters draft in "topk" mode and do not receive :meth:`observe`.

    Args:
        drafters: at least one drafter.
    """

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        drafters = list(drafters)
        if not drafters:
            raise ValueError("MergedDrafter needs at least one drafter")
        for i, d in enumerate(drafters):
            if not isinstance(d, Drafter):
                raise TypeError(f"drafters[{i}] must be a Drafter, got {type(d).__name__}")
        self.drafters = drafters
        self.name = "merged(" + "+".join(d.name for d in drafters) + ")"

    def draft(self, context, config, sibling_sampling, generator) -> DraftTree:
        return _drive(self.draft_steps(context, config, sibling_sampling, generator))

    def draft_steps(self, context, config, sibling_sampling, generator):
        check_sibling_sampling(sibling_sampling)
        if not config.greedy and sibling_sampling not in _DETERMINISTIC_MODES:
            raise ValueError(
                "a merged tree has deterministic siblings from several drafters; under sampling use a "
                f"verifier with sibling_sampling 'topk', not {sibling_sampling!r}")
        mode = "greedy" if config.greedy else "topk"
        trees = []
        for d in self.drafters:
            trees.append((yield from d.draft_steps(context, config, mode, generator)))
        return merge_trees(trees)

    def reset(self) -> None:
        for d in self.drafters:
            d.reset()

    def spawn(self) -> "MergedDrafter":
        return MergedDrafter([d.spawn() for d in self.drafters])

    @property
    def tokenizers(self) -> tuple:
        return tuple(t for d in self.drafters for t in d.tokenizers)


# -- factory ---------------------------------------------------------------------------------------

DRAFT_STRATEGIES = ("chain", "tree", "dynamic", "adaptive", "self", "ngram", "ngram_trie", "merged")


def make_drafter(strategy: str, *, draft=None, target=None, **params) -> Drafter:
    """Build a drafter by strategy name.

    Args:
        strategy: one of :data:`DRAFT_STRATEGIES`:
            "chain" (``k``), "tree" (``shape``), "dynamic" (``topk``, ``depth``, ``budget``),
            "adaptive" (``schedule``, ...), "self" (``n_layers``, ``shape``; needs ``target``),
            "ngram" (``n``, ``k``), "ngram_trie" (``n``, ``depth``, ``budget``, ...),
            "merged" (``drafters``: a list of Drafters).
        draft: the draft :class:`~specviz.models.LoadedModel` for model-based strategies.
        target: the target model, for "self".
        **params: the strategy's constructor arguments.

    Raises:
        ValueError: unknown strategy, or a model the strategy needs is missing.
    """
    if strategy not in DRAFT_STRATEGIES:
        raise ValueError(f"unknown draft strategy {strategy!r}; valid: {', '.join(DRAFT_STRATEGIES)}")
    if strategy in ("chain", "tree", "dynamic", "adaptive") and draft is None:
        raise ValueError(f"strategy {strategy!r} needs a draft model: make_drafter({strategy!r}, draft=...)")
    if strategy == "self" and target is None:
        raise ValueError("strategy 'self' needs the target model: make_drafter('self', target=..., n_layers=...)")
    if strategy == "chain":
        return ChainDrafter(draft, **params)
    if strategy == "tree":
        return TreeDrafter(draft, **params)
    if strategy == "dynamic":
        return DynamicTreeDrafter(draft, **params)
    if strategy == "adaptive":
        return AdaptiveChainDrafter(draft, **params)
    if strategy == "self":
        return SelfSpeculativeDrafter(target, **params)
    if strategy == "merged":
        return MergedDrafter(**params)
    from specviz.draft.ngram import NgramDrafter, NgramTrieDrafter  # ngram imports this module

    return NgramDrafter(**params) if strategy == "ngram" else NgramTrieDrafter(**params)
