"""N-gram drafters: prompt lookup, as a chain or as a trie of several matches.

No model at all: the last ``n`` committed tokens are looked up among the earlier
context and whatever followed them there is proposed as the draft (Hugging Face's
``prompt_lookup_num_tokens``, "prompt lookup decoding"; SGLang's NGRAM drafter and
Lookahead decoding use the same idea). It shines on inputs that
repeat themselves: code edits, summaries that quote, retrieval answers.

* :class:`NgramIndex` - an incremental table from n-gram to the positions where it
  ends, updated with only the new tokens when the context grows;
* :class:`NgramDrafter` - the chain that followed the most recent, longest match;
* :class:`AdaptiveNgramDrafter` - the same chain, its length chosen every step for expected
  throughput from the acceptance seen per match length and the cost of verifying;
* :class:`NgramTrieDrafter` - the continuations of several matches merged into a
  token trie, i.e. a draft tree.

Both drafters are deterministic: they ignore the sampling configuration, the sibling
sampling mode and the generator, and leave ``draft_probs`` as ``None`` so every
verifier treats their proposals as one-hot draft distributions (rule D / greedy).

Continuations are *self-extending*: when a match ends so close to the end of the
context that fewer than ``k`` tokens follow it, the proposal continues with its own
tokens, exactly as if the drafted tokens were appended to the context and looked up
again. A repeating pattern (``a b a b a b``) therefore yields a full-length draft.

Dimension legend: L = committed context length, N = tree nodes including the root.
"""

from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass
from typing import Sequence

import torch

from specviz.draft.base import Drafter
from specviz.sampling import SamplingConfig, check_sibling_sampling
from specviz.tree.core import DraftTree
from specviz.tree.trie import TokenTrie
from specviz.validate import check_int

__all__ = ["NgramMatch", "NgramIndex", "NgramDrafter", "AdaptiveNgramDrafter", "NgramTrieDrafter", "context_tokens"]


def _positive_int(name: str, value) -> int:
    return check_int(name, value, type_error=TypeError)


def _ngram_range(n: int, min_n: int) -> tuple[int, int]:
    _positive_int("n", n)
    _positive_int("min_n", min_n)
    if min_n > n:
        raise ValueError(f"min_n must be <= n, got min_n={min_n} and n={n}")
    return n, min_n


def context_tokens(context) -> list[int]:
    """``(L,)`` integer tensor (or sequence) of committed ids -> Python list."""
    t = torch.as_tensor(context)
    if t.dim() != 1:
        raise ValueError(f"context must be a 1-D sequence of token ids, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError("context must hold at least one token (the root of the draft tree)")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"context must hold integer token ids, got dtype {t.dtype}")
    return t.tolist()


def _lookup_chain(root: int, chain: Sequence[int]) -> DraftTree:
    """The deterministic chain ``root -> chain[0] -> ...`` of a lookup: ``q`` 1.0 and rank 0
    at every node, no ``draft_probs`` (the root alone when ``chain`` is empty)."""
    n_nodes = 1 + len(chain)
    return DraftTree(
        torch.tensor((root, *chain), dtype=torch.long),
        torch.arange(-1, n_nodes - 1, dtype=torch.long),
        q=torch.ones(n_nodes),
        ranks=torch.zeros(n_nodes, dtype=torch.long),
    )


@dataclass(frozen=True)
class NgramMatch:
    """One earlier occurrence of the context's suffix and what followed it.

    Attributes:
        end: index in the context of the last token of the earlier occurrence.
        length: how many trailing context tokens it matches (the n of the n-gram).
        continuation: the proposed tokens, ``context[end + 1:]`` self-extended to the
            requested length (see the module docstring).
    """

    end: int
    length: int
    continuation: tuple[int, ...]


class NgramIndex:
    """Where every n-gram (``min_n <= n <= max_n``) of a token sequence ends.

    The index covers n-grams whose last token has at least one token after it
    (end positions ``n - 1 .. L - 2``), so the context's own suffix is never its own
    match. :meth:`sync` adds only the n-grams ending at new positions when the
    sequence extends the previous one, and rebuilds from scratch otherwise.

    Args:
        max_n: longest n-gram indexed.
        min_n: shortest n-gram indexed.
    """

    def __init__(self, max_n: int, min_n: int = 1) -> None:
        self.max_n, self.min_n = _ngram_range(max_n, min_n)
        self._tokens: list[int] = []
        # n -> n-gram -> end positions in increasing order (appends keep them sorted)
        self._tables: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(min_n, max_n + 1)
        }
        self._n_rebuilds = 0

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def n_rebuilds(self) -> int:
        """How many times :meth:`sync` had to start over (the sequence was not an extension)."""
        return self._n_rebuilds

    def sync(self, tokens: Sequence[int]) -> None:
        """Make the index describe ``tokens`` (Python ints), reusing the work done for its prefix."""
        old = self._tokens
        m = len(old)
        if len(tokens) >= m and list(tokens[:m]) == old:
            old.extend(tokens[m:])
            start = m
        else:
            self._tokens = list(tokens)
            for table in self._tables.values():
                table.clear()
            self._n_rebuilds += 1
            start = 0
        seq = self._tokens
        last_end = len(seq) - 1  # exclusive: the final token has nothing after it yet
        for n, table in self._tables.items():
            # ends up to start - 2 were indexed on the previous call
            for e in range(max(start - 1, n - 1), last_end):
                key = tuple(seq[e - n + 1:e + 1])
                positions = table.get(key)
                if positions is None:
                    table[key] = [e]
                else:
                    positions.append(e)

    def occurrences(self, n: int, limit: int | None = None) -> tuple[int, ...]:
        """End positions of earlier occurrences of the last ``n`` tokens, most recent first.

        Args:
            n: n-gram length, ``min_n <= n <= max_n``.
            limit: return at most this many (the most recent ones); ``None`` = all.
        """
        if not self.min_n <= n <= self.max_n:
            raise ValueError(f"n must be in [{self.min_n}, {self.max_n}], got {n}")
        if limit is not None:
            _positive_int("limit", limit)
        seq = self._tokens
        if len(seq) <= n:
            return ()
        positions = self._tables[n].get(tuple(seq[-n:]))
        if not positions:
            return ()
        recent = positions if limit is None else positions[-limit:]
        return tuple(reversed(recent))

    def continuation(self, end: int, k: int) -> tuple[int, ...]:
        """The ``k`` tokens after position ``end``, self-extended past the context's end.

        Args:
            end: an end position with ``0 <= end <= L - 2``.
            k: number of tokens to return.
        """
        seq = self._tokens
        length = len(seq)
        if not 0 <= end <= length - 2:
            raise ValueError(f"end must be in [0, {length - 2}] for a context of {length} tokens, got {end}")
        _positive_int("k", k)
        out: list[int] = []
        for j in range(k):
            i = end + 1 + j
            # past the context, read the proposal itself: i - length < j since end < length - 1
            out.append(seq[i] if i < length else out[i - length])
        return tuple(out)

    def table(self, n: int) -> dict[tuple[int, ...], tuple[int, ...]]:
        """A copy of the n-gram -> end positions table for length ``n`` (for inspection)."""
        if not self.min_n <= n <= self.max_n:
            raise ValueError(f"n must be in [{self.min_n}, {self.max_n}], got {n}")
        return {key: tuple(pos) for key, pos in self._tables[n].items()}


class NgramDrafter(Drafter):
    """Prompt lookup as a chain: propose what followed the latest, longest match.

    The last ``n`` context tokens are looked up first, then ``n - 1``, ... down to
    ``min_n``; the first length that has an earlier occurrence wins, and among its
    occurrences the most recent one (nearest text is usually the most relevant copy,
    e.g. the version of a function being edited). The ``k`` tokens that followed it
    form the chain. Without any match the tree is the root alone.

    The draft is deterministic: ``config``, ``sibling_sampling`` and ``generator`` are
    ignored, ``q`` is 1.0 and ``ranks`` 0 at every node, ``draft_probs`` is ``None``.

    Args:
        n: longest n-gram tried.
        k: maximum number of drafted tokens.
        min_n: shortest n-gram tried.
    """

    def __init__(self, n: int = 3, k: int = 5, min_n: int = 1) -> None:
        self.n, self.min_n = _ngram_range(n, min_n)
        self.k = _positive_int("k", k)
        self.name = f"ngram(n={n},k={k})" if self.min_n == 1 else f"ngram(n={n},k={k},min={self.min_n})"
        self._index = NgramIndex(n, min_n)

    def lookup(self, context) -> NgramMatch | None:
        """The match :meth:`draft` would use for ``context`` ``(L,)``, or ``None``."""
        return self._lookup(context_tokens(context))

    def _lookup(self, tokens: list[int]) -> NgramMatch | None:
        self._index.sync(tokens)
        for n in range(self.n, self.min_n - 1, -1):
            found = self._index.occurrences(n, limit=1)
            if found:
                return NgramMatch(found[0], n, self._index.continuation(found[0], self.k))
        return None

    def draft(self, context: torch.Tensor, config: SamplingConfig, sibling_sampling: str,
              generator: torch.Generator | None) -> DraftTree:
        """Chain of up to ``k`` looked-up tokens rooted at ``context[-1]`` (root only if no match)."""
        check_sibling_sampling(sibling_sampling)
        tokens = context_tokens(context)
        match = self._lookup(tokens)
        return _lookup_chain(tokens[-1], () if match is None else match.continuation)

    def reset(self) -> None:
        self._index = NgramIndex(self.n, self.min_n)


class AdaptiveNgramDrafter(NgramDrafter):
    """Prompt lookup whose chain length is chosen every step for expected throughput.

    A fixed-length lookup chain pays for its drafted tokens whether or not they are likely
    to be accepted: on a CPU where verifying 4 tokens costs about twice a decoding step, a
    weak one-token match drafted to length 3 loses time. This drafter drafts ``k`` of the
    match's up to ``k_max`` continuation tokens, ``k`` (possibly 0: no proposal) maximizing

        ``E(k) / C(k)``, ``E(k) = 1 + sum_{i <= k} a_m(1) ... a_m(i)``, ``C(k) = t(k + 1) / t(1)``,

    the expected tokens the step commits over its cost relative to a plain step, where
    ``a_m(i)`` is the estimated probability that the ``i``-th continuation token of a match
    of ``m`` tokens is accepted given the ones before it were, and ``t(n)`` the time of a
    verification forward of ``n`` tokens.

    ``a_m(i)`` is the mean of a Beta posterior counted from this sequence's steps, against
    the tokens each step committed whether or not this drafter drafted it (:meth:`observe`;
    the prior ``Beta(prior_accepted, prior_rejected)``, by default 1 and 1: a half,
    optimistic enough that every match length is tried). ``t(n)`` is either given (``costs``, e.g. the
    benchmark's measured cost curve, for reproducible runs) or measured online from the
    steps' verification wall times (the median of the latest per tree size; a sequence's
    first step, which may carry a first forward's one-off setup, is left out); sizes not
    measured yet are interpolated from the measured ones, with ``prior_slope`` (the extra
    cost of each more token, relative to a plain step) before two sizes are known. Greedy
    output is unchanged; only the drafts differ. A replay
    (:func:`specviz.decode.replay_acceptance`) times nothing, so there the costs stay at
    the prior: give ``costs`` for a replay that drafts as a live run would. After each
    draft, :attr:`last_worth` holds the chosen chain's ``E(k) / C(k)`` (1.0 when it
    proposes nothing).

    Args:
        n, min_n: longest and shortest n-gram tried (as :class:`NgramDrafter`).
        k_max: longest chain drafted.
        costs: ``t(1), t(2), ..., t(k_max + 1)`` in any unit, or None to measure them.
        prior_accepted, prior_rejected: the Beta prior of every ``a_m(i)``.
        prior_slope: assumed ``t(n + 1) / t(1) - t(n) / t(1)`` until measured.
    """

    def __init__(self, n: int = 3, k_max: int = 8, min_n: int = 1, costs: Sequence[float] | None = None,
                 prior_accepted: float = 1.0, prior_rejected: float = 1.0, prior_slope: float = 0.25) -> None:
        super().__init__(n=n, k=k_max, min_n=min_n)
        if costs is not None:
            costs = [float(c) for c in costs]
            if len(costs) != k_max + 1 or not all(c > 0 for c in costs):
                raise ValueError(f"costs must hold k_max + 1 = {k_max + 1} positive times t(1)..t({k_max + 1}), "
                                 f"got {costs}")
        for name, value in (("prior_accepted", prior_accepted), ("prior_rejected", prior_rejected)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not prior_slope >= 0:
            raise ValueError(f"prior_slope must be >= 0, got {prior_slope}")
        self.costs = costs
        self.prior = (float(prior_accepted), float(prior_rejected))
        self.prior_slope = float(prior_slope)
        self.name = f"ngram-adaptive(n={n},k<={k_max})" + ("" if self.min_n == 1 else f",min={self.min_n}")
        self.reset()

    @property
    def k_max(self) -> int:
        """The longest chain drafted (the lookup's ``k``)."""
        return self.k

    def reset(self) -> None:
        super().reset()
        shape = (self.n + 1, self.k_max + 1)  # [match length m, position i]
        self._accepted = torch.full(shape, self.prior[0], dtype=torch.float64)
        self._tried = torch.full(shape, self.prior[0] + self.prior[1], dtype=torch.float64)
        self._time: dict[int, list[float]] = {}  # tree size -> its latest verification times (seconds)
        self._last_match: tuple[int, tuple[int, ...]] | None = None  # (match length, continuation)
        self.last_worth = 1.0
        self.history: list[tuple[int, int]] = []  # (match length or 0, tokens drafted) per draft

    def withdraw(self) -> None:
        """Drop the latest draft: another drafter drafts the step instead (as in
        :class:`~specviz.draft.switch.SwitchDrafter`). :attr:`history` records the step as
        drafting nothing; :meth:`observe` still learns from the tokens the step commits."""
        if self.history:
            self.history[-1] = (self.history[-1][0], 0)

    def plain_step_time(self) -> float | None:
        """The estimated time of a one-token verification, ``t(1)``, in seconds from the
        steps observed so far (with given ``costs`` too), or None before any was timed."""
        if not self._time:
            return None
        if 1 in self._time:
            return self.verify_time(1)
        size = min(self._time)
        rel = self.relative_costs()
        return self.verify_time(size) / rel[size - 1] if size - 1 < len(rel) else None

    #: verification times kept per tree size (the latest ones)
    time_samples: int = 32

    def verify_time(self, size: int) -> float | None:
        """The measured time of verifying a tree of ``size`` nodes, in seconds: the lower
        median of its latest :attr:`time_samples` steps (one slow step, a first forward
        or the machine busy for a moment, moves a mean but not a median), or None if no
        step of that size was timed."""
        samples = self._time.get(size)
        return statistics.median_low(samples) if samples else None

    def relative_costs(self) -> list[float]:
        """``C(k) = t(k + 1) / t(1)`` for ``k = 0 .. k_max``, as the next draft would use them."""
        if self.costs is not None:
            return [c / self.costs[0] for c in self.costs]
        sizes = sorted(self._time)
        means = {s: self.verify_time(s) for s in sizes}
        out = []
        for size in range(1, self.k_max + 2):
            if not sizes:
                out.append(1.0 + self.prior_slope * (size - 1))
                continue
            lo = max((s for s in sizes if s <= size), default=None)
            hi = min((s for s in sizes if s >= size), default=None)
            if lo is not None and hi is not None and lo != hi:  # between two measured sizes
                t = means[lo] + (means[hi] - means[lo]) * (size - lo) / (hi - lo)
            elif lo is not None and lo == size:
                t = means[lo]
            else:  # outside the measured sizes: the nearest one plus the prior slope
                near = lo if lo is not None else hi
                base = means[1] if 1 in means else means[near] / (1.0 + self.prior_slope * (near - 1))
                t = means[near] + self.prior_slope * base * (size - near)
            out.append(t)
        base = out[0]
        return [max(t / base, 1e-9) for t in out]

    def choose_length(self, match_length: int, available: int) -> int:
        """The number of continuation tokens (``0 .. available``) to draft for a match of
        ``match_length`` tokens: the ``k`` maximizing ``E(k) / C(k)`` (the shortest on ties)."""
        cost = self.relative_costs()
        rate = (self._accepted[match_length] / self._tried[match_length]).tolist()
        best_k, best, reach, expected = 0, 1.0, 1.0, 1.0
        for k in range(1, available + 1):
            reach *= rate[k]
            expected += reach
            value = expected / cost[k]
            if value > best * (1 + 1e-12):
                best_k, best = k, value
        self.last_worth = best
        return best_k

    def draft(self, context: torch.Tensor, config: SamplingConfig, sibling_sampling: str,
              generator: torch.Generator | None) -> DraftTree:
        """A chain of the chosen number of the match's continuation tokens (root only when
        there is no match or drafting none is expected to be fastest)."""
        check_sibling_sampling(sibling_sampling)
        tokens = context_tokens(context)
        match = self._lookup(tokens)
        chain: tuple[int, ...] = ()
        self._last_match = None
        self.last_worth = 1.0
        if match is not None:
            k = self.choose_length(match.length, len(match.continuation))
            chain = match.continuation[:k]
            self._last_match = (match.length, match.continuation)
        self.history.append((0 if match is None else match.length, len(chain)))
        return _lookup_chain(tokens[-1], chain)

    def observe(self, step, outputs=None) -> None:
        """Count, for the latest match's length, which of its continuation tokens the step's
        committed tokens (accepted plus bonus) confirm, and record the step's verification
        time for its tree size.

        Position ``i`` of the continuation counts as tried when every token before it
        matched the committed ones and the step committed at least ``i`` tokens, and as
        accepted when it matches too. On the drafted positions that is exactly what the
        verifier accepted (a rejected draft token is never the token committed in its
        place); beyond them, and on a step the lookup did not draft (no proposal, or
        another drafter's), it is what a draft of that length would have given: under
        greedy decoding the committed tokens do not depend on the draft, and under sampling
        the committed token equals a deterministic draft token with the probability that
        the token is accepted. So a short chain learns whether a longer one would have
        paid."""
        size = step.tree.n_nodes
        if step.verify_time_s > 0 and step.step != 0:
            samples = self._time.setdefault(size, [])
            samples.append(step.verify_time_s)
            del samples[:-self.time_samples]
        last, self._last_match = self._last_match, None
        if last is None:
            return
        m, continuation = last
        committed = (*step.acceptance.accepted_tokens, step.acceptance.bonus_token)
        for i in range(1, min(len(continuation), len(committed)) + 1):
            hit = continuation[i - 1] == committed[i - 1]
            self._tried[m, i] += 1
            self._accepted[m, i] += float(hit)
            if not hit:
                break


class NgramTrieDrafter(Drafter):
    """Several prompt-lookup matches merged into one token trie (a draft tree).

    **Matches.** Up to ``max_matches`` distinct earlier occurrences of the context's
    suffix are collected, longest n-gram first and, within one length, most recent
    first; an occurrence found at length n is not counted again at shorter lengths.
    Each contributes its ``depth``-token continuation (self-extended, see the module
    docstring).

    **Trie.** Continuations are inserted under the root, sharing common prefixes. A
    trie node is supported by the matches whose continuation passes through it.

    **Budget rule.** Nodes are kept best-first from the root until ``budget`` draft
    nodes are chosen, comparing (1) the longest n-gram among the supporting matches,
    (2) the number of supporting matches, (3) the most recent supporting match, then
    insertion order. A child's supporters are a subset of its parent's, so no child
    outranks its parent and the kept nodes form a tree; they are numbered in the
    order chosen, which puts parents before children and siblings in rank order.

    **q and ranks.** ``q[i]`` is the *empirical frequency* of node i's token among the
    matches that support its parent (for depth 1: among all matches) - a count
    ratio, not a model probability. ``ranks[i]`` is node i's position among its kept
    siblings under the budget rule. ``draft_probs`` stays ``None`` so verifiers treat
    the draft as deterministic, and ``config``, ``sibling_sampling`` and
    ``generator`` are ignored.

    Args:
        n: longest n-gram tried.
        depth: tokens per continuation (the tree's maximum depth).
        budget: maximum number of draft nodes (root excluded).
        max_matches: maximum number of earlier occurrences merged.
        min_n: shortest n-gram tried.
    """

    def __init__(self, n: int = 3, depth: int = 5, budget: int = 16, max_matches: int = 8,
                 min_n: int = 1) -> None:
        self.n, self.min_n = _ngram_range(n, min_n)
        self.depth = _positive_int("depth", depth)
        self.budget = _positive_int("budget", budget)
        self.max_matches = _positive_int("max_matches", max_matches)
        self.name = f"ngram-trie(n={n},budget={budget})"
        self._index = NgramIndex(n, min_n)

    def matches(self, context) -> tuple[NgramMatch, ...]:
        """The matches :meth:`draft` merges for ``context`` ``(L,)``, in collection order."""
        return self._matches(context_tokens(context))

    def _matches(self, tokens: list[int]) -> tuple[NgramMatch, ...]:
        self._index.sync(tokens)
        found: list[NgramMatch] = []
        seen: set[int] = set()
        for n in range(self.n, self.min_n - 1, -1):
            # at most len(found) of these were already seen at a longer length, so the
            # limit still leaves at least max_matches - len(found) new ones
            for end in self._index.occurrences(n, limit=self.max_matches):
                if end in seen:
                    continue
                seen.add(end)
                found.append(NgramMatch(end, n, self._index.continuation(end, self.depth)))
                if len(found) == self.max_matches:
                    return tuple(found)
        return tuple(found)

    def draft(self, context: torch.Tensor, config: SamplingConfig, sibling_sampling: str,
              generator: torch.Generator | None) -> DraftTree:
        """Trie of the matches' continuations rooted at ``context[-1]``, at most ``budget`` nodes."""
        return self._trie(context, sibling_sampling, self.budget)

    def draft_steps_within(self, max_nodes, context, config, sibling_sampling, generator):
        """The trie's best ``min(budget, max_nodes)`` nodes, chosen as :meth:`draft` chooses."""
        _positive_int("max_nodes", max_nodes)
        yield from ()
        return self._trie(context, sibling_sampling, min(self.budget, max_nodes))

    def _trie(self, context: torch.Tensor, sibling_sampling: str, budget: int) -> DraftTree:
        check_sibling_sampling(sibling_sampling)
        tokens = context_tokens(context)
        found = self._matches(tokens)
        root = tokens[-1]

        # full trie over all continuations; a node is supported by the matches through it
        trie = TokenTrie(root)
        support: dict[int, list[NgramMatch]] = {0: list(found)}
        for m in found:
            for node in trie.add_path(m.continuation):
                support.setdefault(node, []).append(m)
        count = [len(support[i]) for i in range(len(trie))]
        longest = [max((m.length for m in support[i]), default=0) for i in range(len(trie))]
        recent = [max((m.end for m in support[i]), default=-1) for i in range(len(trie))]
        parents = trie.parents
        children = trie.children()

        # best-first selection; heapq is a min-heap, hence the negated keys
        def key(i: int) -> tuple[int, int, int, int]:
            return (-longest[i], -count[i], -recent[i], i)

        frontier = [key(c) for c in children[0]]
        heapq.heapify(frontier)
        kept = [0]
        new_index = {0: 0}
        while frontier and len(kept) <= budget:
            i = heapq.heappop(frontier)[-1]
            new_index[i] = len(kept)
            kept.append(i)
            for c in children[i]:
                heapq.heappush(frontier, key(c))

        n_kept = len(kept)
        out_parents = [-1] + [new_index[parents[i]] for i in kept[1:]]
        q = [1.0] + [count[i] / count[parents[i]] for i in kept[1:]]
        ranks = [0] * n_kept
        next_rank = [0] * n_kept
        for j in range(1, n_kept):
            ranks[j] = next_rank[out_parents[j]]
            next_rank[out_parents[j]] += 1
        return DraftTree(
            torch.tensor([trie.tokens[i] for i in kept], dtype=torch.long),
            torch.tensor(out_parents, dtype=torch.long),
            q=torch.tensor(q, dtype=torch.float32),
            ranks=torch.tensor(ranks, dtype=torch.long),
        )

    def reset(self) -> None:
        self._index = NgramIndex(self.n, self.min_n)
