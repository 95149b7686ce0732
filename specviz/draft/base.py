"""Drafters: anything that proposes a draft tree for the next speculative step.

Every drafter implements :class:`Drafter`, three methods: :meth:`~Drafter.draft` (given
the committed token ids, whose last element becomes the tree's root, a
:class:`~specviz.sampling.SamplingConfig` and the verifier's sibling-sampling mode,
:data:`~specviz.sampling.SIBLING_SAMPLING`, return a :class:`~specviz.tree.DraftTree`),
:meth:`~Drafter.observe` (what a step accepted, with the target's outputs it reads:
:class:`TargetOutputs`) and :meth:`~Drafter.reset`. What only some drafters do (draft as
a generator of forwards, grow to a node limit, feed a side branch, spawn, name their
tokenizers) are optional capabilities (:class:`Stepwise`, :class:`Budgeted`,
:class:`SideBranching`) that the engine reaches through this module's functions.

The model-based drafters share one engine, :class:`DraftModelState`: the draft model's
own KV cache for one sequence, kept in sync with the committed tokens. A step feeds only
what the draft model has not seen (usually just the bonus token: draft nodes that the
target accepted keep their cached entries), then expands the tree one depth at a time,
every node of a depth in one batched forward with the tree mask. Drafters are written as
generators (:class:`Stepwise`) that *request* forwards (:class:`DraftForward`)
rather than run them, so batched decoding serves the requests of all sequences in one
forward per draft model (:func:`draft_all`) while every sequence runs exactly the logic
it would run alone.

The strategies live next door: :mod:`~specviz.draft.model` (static trees, chains,
EAGLE-2 dynamic trees), :mod:`~specviz.draft.adaptive` (chains of adaptive length),
:mod:`~specviz.draft.self_spec` (the target's first layers), :mod:`~specviz.draft.ngram`
(prompt lookup), :mod:`~specviz.draft.merged` (SpecInfer's merge of several drafters);
:mod:`~specviz.draft.registry` names them all and builds any of them by name. Drafters
that run trained heads on the target's hidden states live in :mod:`specviz.heads`.

Dimension legend: L = committed length, N = tree nodes incl. root, V = vocabulary,
S = cached slots, n = nodes fed in one forward, B = sequences batched in one forward,
H = the target's hidden size.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generator, Protocol, Sequence, runtime_checkable

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
from specviz.sampling import SamplingConfig
from specviz.tree.core import DraftTree
from specviz.tree.side import SideBranch
from specviz.tree.trie import TokenTrie
from specviz.validate import check_int

__all__ = [
    "Drafter",
    "TARGET_OUTPUTS",
    "TargetOutputs",
    "Stepwise",
    "Budgeted",
    "SideBranching",
    "drafting_steps",
    "drafting_steps_within",
    "side_branch_of",
    "fresh_copy",
    "spawn",
    "tokenizers_of",
    "DraftForward",
    "DraftModelState",
    "run_draft_forwards",
    "run_draft_steps",
    "draft_all",
]


class Drafter(ABC):
    """The protocol of every draft strategy: :meth:`draft` proposes a tree for a context,
    :meth:`observe` sees what the step accepted (with the target's outputs the drafter
    :attr:`reads`), :meth:`reset` forgets the sequence.

    A drafter may keep state between steps (a draft model's KV cache, an n-gram index,
    recent acceptance); it must stay correct when ``context`` is not an extension of
    the previous call's (e.g. a new prompt): compare and rebuild as needed.
    :meth:`reset` must *rebind* per-sequence state to fresh objects (not clear shared
    ones in place), so that :func:`spawn`'s shallow copy shares nothing mutable.

    Everything else is an optional capability, a method that only the drafters that have
    it define, which the engine reaches through this module's functions:

    * ``draft_steps(...)`` (:class:`Stepwise`): drafting as a generator of draft-model
      forwards, so that batched rows share them (:func:`drafting_steps`);
    * ``draft_steps_within(max_nodes, ...)`` (:class:`Budgeted`): a tree grown to a node
      limit by the drafter's own ranking (:func:`drafting_steps_within`; others are cut);
    * ``side_branch(context, tree)`` (:class:`SideBranching`): tokens to feed the target
      beside the tree, such as lookahead's Jacobi window (:func:`side_branch_of`);
    * ``spawn()``: a copy for another batch row, where a shallow copy plus :meth:`reset`
      is not enough (:func:`spawn`);
    * ``tokenizers``: the tokenizers whose ids the drafter proposes, which the engine
      checks against the target's (:func:`tokenizers_of`; none for model-free drafters).
    """

    #: short human-readable name used in traces, tables and legends
    name: str = "drafter"
    #: the target's outputs :meth:`observe` needs, a subset of :data:`TARGET_OUTPUTS`:
    #: ``"logits"`` for drafters that guess from the target's outputs of earlier steps
    #: (which a replay without target calls cannot supply), ``"hidden"`` for drafters that
    #: read the target's last hidden states (the engine then computes them, and passes the
    #: prefill's too)
    reads: frozenset[str] = frozenset()

    @abstractmethod
    def draft(self, context: torch.Tensor, config: SamplingConfig, sibling_sampling: str,
              generator: torch.Generator | None) -> DraftTree:
        """Propose a draft tree whose root is ``context[-1]``.

        Args:
            context: ``(L,)`` long tensor of committed token ids (prompt + generated).
            config: the sampling configuration shared with the verifier.
            sibling_sampling: one of :data:`~specviz.sampling.SIBLING_SAMPLING`.
            generator: random source for sampled drafts.

        Returns:
            A tree with at least the root; a root-only tree means "no proposal" and the
            engine then takes one plain target step.
        """

    def observe(self, step, outputs: "TargetOutputs | None" = None) -> None:  # noqa: B027 - no-op by default
        """See what a step accepted: called with each finished
        :class:`~specviz.decode.StepTrace` and, in a live run, the target's outputs at
        the step's nodes (:class:`TargetOutputs`; None in a replay). A drafter that
        reads ``"hidden"`` is also called once after the prefill, with ``step`` None and
        the hidden states of the committed tokens but the last. Adaptive drafters, n-gram
        indexes, lookahead's pool and trained heads' features update themselves here."""

    def reset(self) -> None:  # noqa: B027 - no-op by default
        """Forget all per-sequence state (caches, statistics)."""


#: the target outputs a drafter may read (:attr:`Drafter.reads`)
TARGET_OUTPUTS = frozenset({"logits", "hidden"})


@dataclass(frozen=True)
class TargetOutputs:
    """What the target computed in one step, for :meth:`Drafter.observe`.

    Attributes:
        logits: ``(N, V)`` logits at the tree's nodes (None after the prefill).
        side_logits: ``(S, V)`` logits at the side branch (None when the step fed none).
        hidden: the target's last hidden states (the input of its LM head, float32) when
            a drafter of the run reads them: ``(N, H)`` at the tree's nodes (the root and
            the accepted nodes become committed) or, after the prefill, ``(L - 1, H)`` at
            the committed tokens but the last; else None.
    """

    logits: torch.Tensor | None = None
    side_logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


# -- optional capabilities ----------------------------------------------------------------------

@runtime_checkable
class Stepwise(Protocol):
    """A drafter that drafts as a generator: it yields the draft-model forwards it needs
    (:class:`DraftForward`), receives their logits and returns the tree, so batched
    decoding serves the requests of many rows in one forward (:func:`draft_all`)."""

    def draft_steps(self, context: torch.Tensor, config: SamplingConfig, sibling_sampling: str,
                    generator: torch.Generator | None) -> Generator["DraftForward", torch.Tensor, DraftTree]: ...


@runtime_checkable
class Budgeted(Protocol):
    """A drafter that grows its tree to a node limit by its own ranking (EAGLE-2 trees, the
    n-gram trie), as a merged tree with a budget asks of each part."""

    def draft_steps_within(self, max_nodes: int, context: torch.Tensor, config: SamplingConfig,
                           sibling_sampling: str, generator: torch.Generator | None
                           ) -> Generator["DraftForward", torch.Tensor, DraftTree]: ...


@runtime_checkable
class SideBranching(Protocol):
    """A drafter that feeds the target tokens beside its tree in the step's forward (a
    :class:`~specviz.tree.SideBranch`, such as lookahead decoding's Jacobi window); the
    target's logits there come back in :attr:`TargetOutputs.side_logits`."""

    def side_branch(self, context: torch.Tensor, tree: DraftTree) -> SideBranch | None: ...


def drafting_steps(drafter: Drafter, context: torch.Tensor, config: SamplingConfig, sibling_sampling: str,
                   generator: torch.Generator | None) -> Generator["DraftForward", torch.Tensor, DraftTree]:
    """``drafter``'s drafting as a generator of draft-model forwards (:class:`Stepwise`);
    a drafter without a model requests nothing and returns its :meth:`~Drafter.draft`."""
    if isinstance(drafter, Stepwise):
        return (yield from drafter.draft_steps(context, config, sibling_sampling, generator))
    return drafter.draft(context, config, sibling_sampling, generator)


def drafting_steps_within(drafter: Drafter, max_nodes: int, context: torch.Tensor, config: SamplingConfig,
                          sibling_sampling: str, generator: torch.Generator | None
                          ) -> Generator["DraftForward", torch.Tensor, DraftTree]:
    """:func:`drafting_steps` for a tree of at most ``max_nodes`` draft nodes (a positive
    integer): a :class:`Budgeted` drafter grows it to the smaller of its budget and this
    one, keeping its best nodes by its own ranking; any tree still larger (any other
    drafter's, or a Budgeted one that ignored the limit) is cut to its first ``max_nodes``
    nodes (parents come before children, so the cut is a tree).

    Raises:
        ValueError: ``max_nodes`` not a positive integer.
    """
    check_int("max_nodes", max_nodes)
    if isinstance(drafter, Budgeted):
        tree = yield from drafter.draft_steps_within(max_nodes, context, config, sibling_sampling, generator)
    else:
        tree = yield from drafting_steps(drafter, context, config, sibling_sampling, generator)
    return tree if tree.budget <= max_nodes else tree.subtree(range(max_nodes + 1))


def side_branch_of(drafter: Drafter, context: torch.Tensor, tree: DraftTree) -> SideBranch | None:
    """The tokens ``drafter`` feeds the target beside ``tree`` this step (None: none, or a
    drafter that is not :class:`SideBranching`)."""
    return drafter.side_branch(context, tree) if isinstance(drafter, SideBranching) else None


def fresh_copy(drafter: Drafter) -> Drafter:
    """A shallow copy of ``drafter`` with fresh per-sequence state (:meth:`Drafter.reset`)."""
    clone = copy.copy(drafter)
    clone.reset()
    return clone


def spawn(drafter: Drafter) -> Drafter:
    """A drafter with ``drafter``'s settings and shared weights but fresh per-sequence
    state, for another batch row: its own ``spawn()`` where it has one, else
    :func:`fresh_copy`."""
    own = getattr(drafter, "spawn", None)
    return own() if callable(own) else fresh_copy(drafter)


def tokenizers_of(drafter: Drafter) -> tuple:
    """The tokenizers whose ids ``drafter`` proposes (its ``tokenizers``; empty for
    model-free drafters)."""
    return tuple(getattr(drafter, "tokenizers", ()))


# -- the draft model's KV cache for one sequence ------------------------------------------------

#: the longest catch-up feed :meth:`DraftModelState.sync` sends with an explicit causal
#: mask (longer ones, such as a prompt's prefill, run unmasked)
SHORT_FEED = 16


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
        last_only: only the logits after the last token are wanted (a sync: the root's);
            the forward then skips the LM head at the other tokens.
    """

    state: "DraftModelState"
    tokens: list[int]
    positions: list[int]
    allowed: torch.Tensor | None
    last_only: bool = False


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
        head: what scores its last hidden states in place of its LM head: a
            :class:`~specviz.draft.vocab.ReducedHead` (a reduced draft vocabulary, which
            this state extends by every token of the sequence it drafts for), or None for
            the model's own head.
    """

    def __init__(self, model, head=None) -> None:
        self.model = model
        self.head = head
        self.reset()

    def reset(self) -> None:
        if self.head is not None:
            self.head.reset()
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
        """Sync with ``context``; the request's logits are one row, ``(1, V)``: the draft's
        distribution after ``context[-1]`` (the root)."""
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
        if self.head is not None:  # the sequence's own tokens stay proposable
            if common < len(old):
                self.head.reset()
                self.head.include(context)
            else:
                self.head.include(context[len(old):])
        # Feed at least the root: its logits are what the first depth is drafted from.
        common = min(common, len(context) - 1)
        crop_cache(self.cache, common)
        self._fed_tokens, self._fed_parent, self._fed_depth = [], [], []
        self.forwards = 1
        self.tokens = context
        feed = context[common:]
        allowed = None
        if common and 1 < len(feed) <= SHORT_FEED:
            # a catch-up of a few tokens (the last drafted token and the bonus) with its
            # causal mask spelled out: a masked forward runs the decoder layer by layer
            # (see forward_tokens), an unmasked one of several tokens runs model(...)
            allowed = torch.ones(len(feed), common + len(feed), dtype=torch.bool).tril(common)
        return DraftForward(self, feed, list(range(common, len(context))), allowed, last_only=True)

    def _accepted_slots(self, extension: list[int]) -> list[int]:
        """Cache slots of fed draft nodes spelling a prefix of ``extension`` from the root."""
        base = len(self.tokens)
        trie = TokenTrie(0)  # the root's token is never compared
        node_of = {-1: 0}  # fed handle -> its trie node
        handle_of = {}  # trie node -> the fed handle whose cache slot holds it
        for h, (tok, parent) in enumerate(zip(self._fed_tokens, self._fed_parent)):
            # only the first copy of a duplicate sibling is followed, so the slots returned
            # lie on one fed path rather than mixing two copies' subtrees
            if parent in node_of and trie.child(node_of[parent], tok) is None:
                node_of[h] = trie.insert(node_of[parent], tok)
                handle_of[node_of[h]] = h
        return [base + handle_of[node] for node in trie.walk(extension)]

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


class _RowHeads:
    """Each batch row's logits from its own sequence's head (its reduced vocabulary, or the
    model's LM head where a state has none), so a row's logits are those it gets alone."""

    def __init__(self, model, heads) -> None:
        self.heads = [model.lm_head if h is None else h for h in heads]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, N, E) -> (B, N, V)
        return torch.cat([head(hidden[b:b + 1]) for b, head in enumerate(self.heads)])


class _LastTokens:
    """Scores only each row's last new token (row ``b``'s ``counts[b] - 1``, the rows being
    right-padded): a batch of syncs then holds ``(B, 1, V)`` logits, not ``(B, nmax, V)``."""

    def __init__(self, head, counts: list[int]) -> None:
        self.head, self.counts = head, counts

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, N, E) -> (B, 1, V)
        last = torch.tensor(self.counts, device=hidden.device) - 1
        return self.head(hidden[torch.arange(len(self.counts), device=hidden.device), last][:, None])


def run_draft_forwards(requests: Sequence[DraftForward]) -> list[torch.Tensor]:
    """Serve draft-model forward requests, one batched forward per draft model.

    Requests of different sequences on the same model run together: their caches are
    stacked (right-padded), every row's mask places its own cached slots and new tokens,
    and each cache is written back with just its new entries appended.

    Returns:
        One ``(n_i, V)`` float32 logits tensor per request, in order (``(1, V)``, after the
        last token, for a request whose ``last_only`` is set).
    """
    out: list[torch.Tensor | None] = [None] * len(requests)
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(id(r.state.model), []).append(i)
    for idx in groups.values():
        model, head = requests[idx[0]].state.model, requests[idx[0]].state.head
        if len(idx) == 1:
            r = requests[idx[0]]
            allowed = None if r.allowed is None else r.allowed[None]
            logits = forward_tokens(model, r.state.cache, torch.tensor([r.tokens]), torch.tensor([r.positions]),
                                    allowed, logits_to_keep=1 if r.last_only else 0, head=head)  # (1, n or 1, V)
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
        heads = [r.state.head for r in rows]
        head = None if all(h is None for h in heads) else _RowHeads(model, heads)
        last_only = all(r.last_only for r in rows)
        if last_only:
            head = _LastTokens(model.lm_head if head is None else head, counts)
        logits = forward_tokens(model, batched, tokens, positions, allowed, head=head)  # (B, nmax or 1, V)
        split_cache(batched, caches, lengths, smax, counts)
        for b, i in enumerate(idx):
            if last_only:
                out[i] = logits[b]
            else:
                out[i] = logits[b, counts[b] - 1:counts[b]] if rows[b].last_only else logits[b, :counts[b]]
    return out


def run_draft_steps(steps: Generator[DraftForward, torch.Tensor, DraftTree]) -> DraftTree:
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
    steps = [drafting_steps(d, c, config, sibling_sampling, g) for d, c, g in zip(drafters, contexts, generators)]
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
