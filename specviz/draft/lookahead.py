"""Draft-free speculation from the target's own outputs: Jacobi and lookahead decoding.

**Jacobi decoding** guesses a block of ``k`` future tokens and lets the target
predict every position of the block in one forward; the guesses that match the
target's predictions are accepted (a chain, verified like any other), and the
predictions after them become the next guesses: a fixed-point iteration that
converges to greedy decoding, seldom fast on real models because a wrong guess
spoils every prediction after it.

**Lookahead decoding** (Fu et al., 2024, "Break the Sequential Dependency of LLM
Inference Using Lookahead Decoding") keeps the iteration but harvests it: the target's
forward carries, beside the tree it verifies, a *lookahead branch* of ``N - 1`` levels
of ``W`` tokens, the last ``N - 1`` Jacobi iterations of a window ahead of the root.
Token ``(l, c)`` (level ``l``, column ``c``) sits ``l + c + 1`` positions after the
root and attends to the root, to level 0's columns ``0..c`` and to its own column's
levels ``1..l``, so its context is one contiguous run of guesses. The target's
predictions at the top level become the next level; reading a column from the bottom
up plus that prediction gives an n-gram, ``(level_0[c], ..., level_{N-2}[c], new[c])``,
which goes into a pool keyed by its first token. The *verification branch* is up to
``G`` pooled n-grams that start with the root token, each a chain of ``N - 1``
guesses; specviz merges them into one token tree (shared prefixes verified once).
Both branches share one target call: ``1 + (N - 1) * W`` window-plus-root tokens and
at most ``G * (N - 1)`` guess nodes.

The window is a :class:`~specviz.tree.SideBranch`: it sees only the committed prefix
and the root, and no guess node sees it, so verification is untouched and decoding
is exactly as lossless as the rule used (greedy; under sampling the guesses are
deterministic proposals and the ``topk`` rule accepts each with the residual
target probability of its token, which is exact for any deterministic proposal).

``pool="context"`` also adds every n-gram of the committed text (prompt and output)
to the pool, the way some lookahead implementations seed it from the prompt; the
default ``"jacobi"`` pool holds only what the window produced, as in the paper.

Dimension legend: W = window width, N = n-gram size, G = guesses per step, k = Jacobi
block, V = vocabulary, S = side tokens = ``(N - 1) * W`` when the window is full.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from specviz.draft.base import Drafter
from specviz.sampling import SamplingConfig
from specviz.tree.core import DraftTree, path_to
from specviz.tree.side import SideBranch
from specviz.tree.trie import TokenTrie
from specviz.validate import check_int

__all__ = ["JacobiDrafter", "LookaheadDrafter", "lookahead_window_mask", "guess_tree", "guesses_of", "POOLS"]

#: what a lookahead pool collects: the window's n-grams, or those plus the committed text's
POOLS = ("jacobi", "context")


def _initial_guesses(context: torch.Tensor, count: int, seed: int) -> list[int]:
    """``count`` tokens drawn from ``context`` (a fixed seed: a run depends only on its
    arguments), the usual starting point of a Jacobi iteration."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, context.numel(), (count,), generator=g)
    return context[idx].tolist()


def _extends(context: list[int], seen: list[int]) -> bool:
    """True when ``context`` continues the committed tokens a drafter saw last."""
    return bool(seen) and len(context) >= len(seen) and context[:len(seen)] == seen


class JacobiDrafter(Drafter):
    """Jacobi decoding: the block of ``k`` guesses is last step's target predictions.

    After a step that accepted ``a`` guesses, the target's predictions at the block's
    nodes ``a + 1 .. k`` (made from the first rejected guess onwards) become the first
    guesses of the next block; positions nothing predicted yet (the whole block on a
    sequence's first step) get tokens drawn from the context.
    """

    reads = frozenset({"logits"})

    def __init__(self, k: int = 5, seed: int = 0) -> None:
        check_int("k", k)
        self.k = k
        self.seed = seed
        self.name = f"jacobi(k={k})"
        self.reset()

    def reset(self) -> None:
        self._seen: list[int] = []
        self._guesses: list[int] = []
        self._next_len = -1  # committed length the guesses were made for

    def draft(self, context: torch.Tensor, config: SamplingConfig, sibling_sampling: str,
              generator: torch.Generator | None) -> DraftTree:
        ctx = context.tolist()
        if not _extends(ctx, self._seen) or len(ctx) != self._next_len:
            self._guesses = []
        self._seen = ctx
        missing = self.k - len(self._guesses)
        guesses = self._guesses[:self.k] + (_initial_guesses(context, missing, self.seed + len(ctx))
                                            if missing > 0 else [])
        return DraftTree.from_lists([ctx[-1]] + guesses, list(range(-1, len(guesses))))

    def observe(self, step, outputs=None) -> None:
        if outputs is None or outputs.logits is None:
            return
        preds = outputs.logits.argmax(dim=-1).tolist()  # (N,)
        acc = step.acceptance
        self._guesses = preds[len(acc.accepted_nodes) + 1:]
        self._next_len = len(self._seen) + len(acc.committed_tokens)


def lookahead_window_mask(levels: int, width: int) -> torch.Tensor:
    """``(levels * width, levels * width)`` bool mask of the lookahead branch, tokens in
    level-major order: ``(l, c)`` attends to ``(0, c')`` for ``c' <= c`` and to
    ``(l', c)`` for ``1 <= l' <= l``."""
    check_int("levels", levels)
    check_int("width", width)
    s = levels * width
    out = torch.zeros(s, s, dtype=torch.bool)
    for level in range(levels):
        for col in range(width):
            i = level * width + col
            out[i, :col + 1] = True  # level 0, columns 0..col
            for lower in range(1, level + 1):
                out[i, lower * width + col] = True
    return out


class LookaheadDrafter(Drafter):
    """Lookahead decoding: a Jacobi window in the target's forward fills an n-gram pool
    whose guesses are verified in the same forward (see the module docstring).

    Args:
        window: W, the window's width (columns per level).
        ngram: N, the n-gram size; the window keeps ``N - 1`` levels and every guess
            is a chain of ``N - 1`` tokens.
        guesses: G, the most n-grams verified per step (the most recent for the root).
        pool: "jacobi" (the window's n-grams) or "context" (plus the committed text's).
        seed: fixes the window's starting tokens, drawn from the prompt.
    """

    reads = frozenset({"logits"})

    def __init__(self, window: int = 5, ngram: int = 4, guesses: int = 5, pool: str = "jacobi",
                 seed: int = 0) -> None:
        check_int("window", window)
        check_int("ngram", ngram)
        check_int("guesses", guesses)
        if ngram < 2:
            raise ValueError(f"ngram must be >= 2 (a guess is ngram - 1 tokens), got {ngram}")
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        self.window, self.ngram, self.guesses, self.pool_kind, self.seed = window, ngram, guesses, pool, seed
        suffix = "" if pool == "jacobi" else f",{pool}"
        self.name = f"lookahead(w={window},n={ngram},g={guesses}{suffix})"
        self._mask = lookahead_window_mask(ngram - 1, window)
        self.reset()

    def reset(self) -> None:
        self._seen: list[int] = []
        self._levels: list[list[int]] = []
        self._pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self._indexed = 0  # committed tokens whose n-grams are in a "context" pool

    # -- the pool ---------------------------------------------------------------------------------

    def _add(self, gram: tuple[int, ...]) -> None:
        """Put ``gram`` (N tokens) in the pool as the most recent n-gram of its first token."""
        grams = self._pool.setdefault(gram[0], OrderedDict())
        grams.pop(gram[1:], None)
        grams[gram[1:]] = None
        while len(grams) > self.guesses:
            grams.popitem(last=False)

    def _index_context(self, ctx: list[int]) -> None:
        n = self.ngram
        for start in range(max(0, self._indexed - n + 1), len(ctx) - n + 1):
            self._add(tuple(ctx[start:start + n]))
        self._indexed = len(ctx)

    @property
    def pool_size(self) -> int:
        """n-grams in the pool now."""
        return sum(len(g) for g in self._pool.values())

    def pool_guesses(self, token: int) -> list[tuple[int, ...]]:
        """The continuations the pool holds for ``token``, most recent first."""
        return list(reversed(self._pool.get(int(token), {})))

    # -- a step -----------------------------------------------------------------------------------

    def draft(self, context: torch.Tensor, config: SamplingConfig, sibling_sampling: str,
              generator: torch.Generator | None) -> DraftTree:
        ctx = context.tolist()
        if not _extends(ctx, self._seen):
            self.reset()
            self._levels = [_initial_guesses(context, self.window, self.seed)]
        self._seen = ctx
        if self.pool_kind == "context":
            self._index_context(ctx)
        return guess_tree(ctx[-1], self.pool_guesses(ctx[-1]))

    def side_branch(self, context: torch.Tensor, tree: DraftTree) -> SideBranch | None:
        if not self._levels:
            return None
        m, w = len(self._levels), self.window
        tokens = [t for level in self._levels for t in level]
        offsets = [level + col + 1 for level in range(m) for col in range(w)]
        groups = [level for level in range(m) for _ in range(w)]
        return SideBranch(torch.tensor(tokens), torch.tensor(offsets), self._mask[:m * w, :m * w],
                          torch.tensor(groups), tuple(f"level {level}" for level in range(m)))

    def observe(self, step, outputs=None) -> None:
        if outputs is None or outputs.side_logits is None:
            return
        side_logits = outputs.side_logits
        m, w = len(self._levels), self.window
        new = side_logits[(m - 1) * w:m * w].argmax(dim=-1).tolist()  # the top level's predictions, (W,)
        if m == self.ngram - 1:
            for col in range(w):
                self._add(tuple(level[col] for level in self._levels) + (new[col],))
            self._levels = self._levels[1:] + [new]
        else:
            self._levels.append(new)


def guess_tree(root: int, guesses: Sequence[Sequence[int]]) -> DraftTree:
    """The verification branch: ``guesses`` (chains after ``root``) merged into one token
    tree, so a shared prefix is verified once; in order of first appearance."""
    trie = TokenTrie(int(root))
    for guess in guesses:
        trie.add_path([int(t) for t in guess])
    return DraftTree.from_lists(trie.tokens, trie.parents)


def guesses_of(step) -> list[dict]:
    """The guesses a step verified, one per leaf of its tree (a guess tree is a merge of
    chains), with how many of each guess's tokens the target accepted.

    Returns:
        ``[{"tokens": [...], "accepted": a}, ...]`` in the tree's leaf order.
    """
    tree = step.tree
    parents = set(tree.parents.tolist())
    accepted = list(step.acceptance.accepted_nodes)
    out = []
    for leaf in (i for i in range(1, tree.n_nodes) if i not in parents):
        path = path_to(tree, leaf)[1:]
        a = 0
        while a < len(path) and a < len(accepted) and path[a] == accepted[a]:
            a += 1
        out.append({"tokens": [int(tree.tokens[i]) for i in path], "accepted": a})
    return out
