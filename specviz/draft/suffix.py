"""SuffixDecoding (Oliaro et al., 2024): model-free speculation trees from suffix trees over the
request and over earlier requests' outputs.

No model drafts. Two trees count every token string of up to ``n + depth`` tokens:

* the **request tree** over this sequence's prompt and output so far, extended token by token;
* the **global tree** over the outputs of the sequences this drafter decoded before, bounded to
  the last ``max_sequences`` of them (the oldest is evicted first, its counts subtracted).

Each step, in each tree, every suffix of the context of up to ``n`` tokens that occurred before is a
candidate pattern. From a pattern's node the speculation tree grows best-first by path score: a child's
score is its parent's times the child's count over the parent's (the frequency estimate of
P(token | path)); nodes scoring under ``min_prob`` are not proposed, and the tree holds at most
``min(budget, floor(factor * pattern length))`` nodes and ``depth`` levels, so a long match earns a large
tree and a one-token match a small one. The pattern whose tree scores highest (its nodes' scores summed:
the expected accepted tokens under that estimate) proposes, the longer on a tie, and of the two trees'
proposals the higher-scoring one drafts, the request tree's on a tie: the selection rule of Snowflake's
``arctic-inference`` implementation, which vLLM runs as its ``suffix`` method.

The drafter is deterministic, as prompt lookup is: ``draft_probs`` stays None, so the verifiers
treat its proposals as one-hot drafts (the ``topk`` rule under sampling, greedy at temperature 0)
and decoding stays lossless. A node's ``q`` is its count over its parent's.

Where it pays: requests whose outputs repeat earlier text, their own or earlier requests' (agentic
loops, the same task applied to many inputs, rewrites, code edits).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Sequence

import torch

from specviz.draft.base import Drafter
from specviz.draft.ngram import context_tokens
from specviz.sampling import SamplingConfig, check_sibling_sampling
from specviz.tree.core import DraftTree
from specviz.validate import check_int

__all__ = ["SuffixCounts", "SuffixDrafter"]


class _Node:
    """A token string's node: how often the string occurred, and its one-token extensions."""

    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixCounts:
    """Occurrence counts of every token string of up to ``max_len`` tokens of some sequences (a
    suffix tree cut at depth ``max_len``), grown one token at a time.

    Args:
        max_len: the longest string counted.
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = check_int("max_len", max_len)
        self.root = _Node()
        self._open: list[_Node] = [self.root]  # the nodes of the current sequence's suffixes, shortest first
        self.n_nodes = 1

    def start(self) -> None:
        """Begin another sequence: strings do not run across the boundary."""
        self._open = [self.root]

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the current sequence, counting every string that ends at them."""
        for token in tokens:
            opened = [self.root]
            for node in self._open:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                    self.n_nodes += 1
                child.count += 1
                if len(opened) < self.max_len:
                    opened.append(child)
            self.root.count += 1
            self._open = opened

    def remove(self, tokens: Sequence[int]) -> None:
        """Subtract a sequence added before (with :meth:`start` then :meth:`extend`)."""
        for i in range(len(tokens)):
            node, detached = self.root, False
            for token in tokens[i:i + self.max_len]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0 and not detached:  # no occurrence left: the subtree goes
                    del node.children[token]
                    self.n_nodes -= _size(child)
                    detached = True
                node = child
            self.root.count -= 1

    def suffix_nodes(self, tokens: Sequence[int], longest: int) -> list[tuple[int, _Node]]:
        """``(m, node)`` for every suffix of ``tokens`` of ``m`` tokens, ``1 <= m <= longest`` and shorter
        than ``tokens``, that occurred, shortest first (a suffix that never occurred ends the list)."""
        out = []
        for m in range(1, min(longest, len(tokens) - 1) + 1):
            node = self.root
            for token in tokens[len(tokens) - m:]:
                node = node.children.get(token)
                if node is None:
                    return out
            out.append((m, node))
        return out


    def current_suffixes(self, longest: int) -> list[tuple[int, _Node]]:
        """:meth:`suffix_nodes` of the sequence being extended, read off the nodes :meth:`extend`
        keeps for its suffixes instead of walking from the root (every one occurred: it just did)."""
        length = len(self._open) - 1  # the suffixes counted so far: at most the sequence's length
        return [(m, self._open[m]) for m in range(1, min(longest, length) + 1)]


def _size(node: _Node) -> int:
    """Nodes in the subtree of ``node``, itself included."""
    return 1 + sum(_size(c) for c in node.children.values())


class _Request:
    """One sequence's counts and where its output starts (for the global tree)."""

    def __init__(self, max_len: int) -> None:
        self.counts = SuffixCounts(max_len)
        self.tokens: list[int] = []
        self.output_start: int | None = None
        self.published = False


class SuffixDrafter(Drafter):
    """SuffixDecoding's speculation trees (module docstring).

    Args:
        n: the longest pattern (context suffix) matched.
        depth: the speculation tree's most levels.
        budget: its most draft nodes.
        factor: the tree holds at most ``floor(factor * pattern length)`` nodes.
        min_prob: nodes whose path score falls below this are not proposed.
        max_sequences: earlier sequences the global tree holds (0: no global tree). A sequence
            joins it when the drafter is reset or meets a context that does not extend the last
            one; the rows of a batch are copies that share the tree but are never reset after
            their run, so their outputs do not join it.
    """

    def __init__(self, n: int = 8, depth: int = 8, budget: int = 16, factor: float = 1.0, min_prob: float = 0.1,
                 max_sequences: int = 256) -> None:
        self.n = check_int("n", n)
        self.depth = check_int("depth", depth)
        self.budget = check_int("budget", budget)
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"factor must be a positive number, got {factor!r}")
        if not (isinstance(min_prob, (int, float)) and 0 <= min_prob <= 1):
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob!r}")
        self.factor, self.min_prob = float(factor), float(min_prob)
        self.max_sequences = check_int("max_sequences", max_sequences, minimum=0)
        bound = "" if self.max_sequences == 256 else f",global={self.max_sequences}"
        self.name = f"suffix(n={n},depth={depth},budget={budget}{bound})"
        self.global_counts = SuffixCounts(self.n + self.depth)
        self._history: deque[list[int]] = deque()
        self._request = _Request(self.n + self.depth)

    # -- the trees ------------------------------------------------------------------------------

    def _publish(self) -> None:
        """Add the current sequence's output to the global tree, once (spawned rows share it)."""
        r = self._request
        if r.published or r.output_start is None or self.max_sequences == 0:
            return
        r.published = True
        output = r.tokens[r.output_start:]
        if not output:
            return
        self._history.append(output)
        self.global_counts.start()
        self.global_counts.extend(output)
        while len(self._history) > self.max_sequences:
            self.global_counts.remove(self._history.popleft())

    def _sync(self, tokens: list[int]) -> None:
        """Bring the request tree up to ``tokens``; a context that does not extend the last one
        is a new sequence (the last one's output goes to the global tree first)."""
        r = self._request
        m = len(r.tokens)
        if m and (len(tokens) < m or tokens[:m] != r.tokens):
            self._publish()
            r = self._request = _Request(self.n + self.depth)
            m = 0
        if r.output_start is None:
            r.output_start = len(tokens)
        r.counts.extend(tokens[m:])
        r.tokens.extend(tokens[m:])

    def candidates(self, context) -> list[tuple[str, int, float, list[tuple[int, int, float]]]]:
        """Each tree's proposal for ``context`` ``(L,)``: ``(tree, match length, score, nodes)``,
        ``nodes`` as ``(parent, token, q)`` in the order chosen (parents first; parent 0 is the
        root), the request tree's first. Of the suffixes that occurred, the one whose tree scores
        highest proposes (the longer one on a tie)."""
        tokens = context_tokens(context)
        self._sync(tokens)
        out = []
        request = self._request.counts.current_suffixes(min(self.n, len(tokens) - 1))
        for name, suffixes in (("request", request), ("global", self.global_counts.suffix_nodes(tokens, self.n))):
            best = None
            for length, node in suffixes:
                nodes, score = self._grow(node, min(self.budget, int(self.factor * length + 1e-6)))
                if nodes and (best is None or score >= best[2]):
                    best = (name, length, score, nodes)
            if best is not None:
                out.append(best)
        return out

    def _grow(self, start: _Node, size: int) -> tuple[list[tuple[int, int, float]], float]:
        """The best ``size`` nodes below ``start`` by path score, and their total score. A child's
        estimate is its count over its parent's, which also counts the occurrences with nothing
        after them yet (the context's own, in the request tree)."""
        nodes: list[tuple[int, int, float]] = []
        score = 0.0
        heap: list[tuple] = []  # (-score, order, depth, parent, q, node, token)
        order = 0

        def push(node: _Node, parent: int, depth: int, path: float) -> None:
            nonlocal order
            if depth >= self.depth:
                return
            for token, child in sorted(node.children.items(), key=lambda kv: -kv[1].count):
                q = child.count / node.count
                if path * q < self.min_prob:
                    break
                heapq.heappush(heap, (-path * q, order, depth + 1, parent, q, child, token))
                order += 1

        push(start, 0, 0, 1.0)
        while heap and len(nodes) < size:
            neg, _, depth, parent, q, node, token = heapq.heappop(heap)
            nodes.append((parent, token, q))
            score -= neg
            push(node, len(nodes), depth, -neg)
        return nodes, score

    # -- the drafter ----------------------------------------------------------------------------

    def draft(self, context: torch.Tensor, config: SamplingConfig, sibling_sampling: str,
              generator: torch.Generator | None) -> DraftTree:
        """The better tree's proposal, rooted at ``context[-1]`` (root only when neither matches)."""
        check_sibling_sampling(sibling_sampling)
        found = self.candidates(context)
        root = int(context[-1])
        if not found:
            return DraftTree(torch.tensor([root]), torch.tensor([-1]))
        _, _, _, nodes = max(found, key=lambda c: c[2])
        ranks, next_rank = [0], [0] * (len(nodes) + 1)
        for parent, _, _ in nodes:
            ranks.append(next_rank[parent])
            next_rank[parent] += 1
        return DraftTree(torch.tensor([root] + [t for _, t, _ in nodes], dtype=torch.long),
                         torch.tensor([-1] + [p for p, _, _ in nodes], dtype=torch.long),
                         q=torch.tensor([1.0] + [q for _, _, q in nodes], dtype=torch.float32),
                         ranks=torch.tensor(ranks, dtype=torch.long))

    def reset(self) -> None:
        """Start a new sequence; the finished one's output joins the global tree."""
        self._publish()
        self._request = _Request(self.n + self.depth)
