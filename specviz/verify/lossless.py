"""The lossless rules: greedy (E), top-k siblings (D), SpecInfer (B), Sequoia (C) and chain
rejection sampling (A), with their exact reach probabilities (see :mod:`specviz.verify.rules`).

Dimension legend: N = nodes in the draft tree including the root, V = vocabulary size,
k = children of one node, C = distinct tokens among those children.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import ClassVar

import torch

from specviz.sampling import SamplingConfig
from specviz.tree.core import DraftTree, greedy_walk
from specviz.verify.base import (Verifier, _path_indicator, _Problem, _ratio, _residual, _sample_token, _Trace,
                                 _without)

__all__ = ["GreedyVerifier", "TopKVerifier", "SpecInferVerifier", "SequoiaVerifier", "ChainVerifier"]

# Order-averaging DP states lighter than this are dropped (see specviz.verify.rules).
_NEGLIGIBLE = 1e-13


def _rejection_walk(problem: _Problem, trace: _Trace, generator: torch.Generator, *,
                    shuffle: bool, without_replacement: bool) -> int:
    """Rules A-D: walk the tree with residual updates; returns the bonus token."""
    u = 0
    while True:
        r = problem.p(u)  # (V,) residual, starts as the target distribution
        kids = problem.children[u]
        # a leaf has no draft distribution (its row may be all zero): only the bonus is sampled there
        q = problem.q(u) if kids else None  # (V,) or None for a deterministic draft
        if shuffle and q is not None and len(kids) > 1:
            kids = [kids[i] for i in torch.randperm(len(kids), generator=generator).tolist()]
        chosen = None
        for s in kids:
            x = problem.tokens[s]
            a = float(r[x]) if q is None else _ratio(float(r[x]), float(q[x]))
            trace.record(s, a)
            if trace.uniforms[s] < a:  # exactly never for a = 0, always for a = 1
                chosen = s
                break
            if q is None:
                r = _without(r, x)
            else:
                r = _residual(r, q)
                if without_replacement:
                    q = _without(q, x)
        if chosen is None:
            return _sample_token(r, trace.uniforms[0])
        trace.path.append(chosen)
        u = chosen


def _sequential_probs(r: torch.Tensor, q: torch.Tensor | None, toks: list[int],
                      without_replacement: bool) -> list[float]:
    """P(sibling i is the accepted one | parent reached) when siblings are tried in order."""
    out: list[float] = []
    still = 1.0  # probability that every earlier sibling was rejected
    for x in toks:
        a = float(r[x]) if q is None else _ratio(float(r[x]), float(q[x]))
        out.append(still * a)
        still *= 1.0 - a
        if still <= 0.0:
            break
        if q is None:
            r = _without(r, x)
        else:
            r = _residual(r, q)
            if without_replacement:
                q = _without(q, x)
    return out + [0.0] * (len(toks) - len(out))


def _random_order_probs(r: torch.Tensor, q: torch.Tensor, toks: list[int]) -> list[float]:
    """P(sibling i is the accepted one | parent reached) for rule B, averaged over all
    orders of trying the siblings (see the module docstring for why this is cheap)."""
    k = len(toks)
    classes = list(dict.fromkeys(toks))  # C distinct tokens, first-seen order
    mult = [toks.count(x) for x in classes]
    residuals = [r]
    for _ in range(k - 1):
        residuals.append(_residual(residuals[-1], q))
    cls = torch.tensor(classes, dtype=torch.long)
    r_at = torch.stack(residuals)[:, cls].tolist()  # (k, C): r_j(x_c)
    q_at = q[cls].tolist()  # (C,)
    accept = [[_ratio(r_at[j][c], q_at[c]) for c in range(len(classes))] for j in range(k)]
    alive = [[r_at[j][c] > 0.0 for c in range(len(classes))] for j in range(k)]

    def key_at(counts: tuple[int, ...], j: int) -> tuple[int, ...]:
        # Once r_j(x) = 0 a class can never be accepted again: forget its rejected count.
        return tuple(n if alive[j][c] else 0 for c, n in enumerate(counts))

    got = [0.0] * len(classes)  # P(some child of class c is the accepted one)
    states = {key_at((0,) * len(classes), 0): 1.0}  # rejected counts -> probability
    for j in range(k):
        left = k - j
        nxt: dict[tuple[int, ...], float] = defaultdict(float)
        for counts, w in states.items():
            alive_left = 0
            for c, n in enumerate(counts):
                if not alive[j][c]:
                    continue
                m = mult[c] - n
                alive_left += m
                if m == 0:
                    continue
                pick = w * m / left
                got[c] += pick * accept[j][c]
                miss = pick * (1.0 - accept[j][c])
                if j + 1 < k and miss > _NEGLIGIBLE:
                    bumped = counts[:c] + (n + 1,) + counts[c + 1:]
                    nxt[key_at(bumped, j + 1)] += miss
            dead_left = left - alive_left
            if j + 1 < k and dead_left > 0:
                miss = w * dead_left / left  # an impossible token is rejected surely
                if miss > _NEGLIGIBLE:
                    nxt[key_at(counts, j + 1)] += miss
        states = nxt
        if not states:
            break
    index = {x: c for c, x in enumerate(classes)}
    return [got[index[x]] / mult[index[x]] for x in toks]


def _rejection_reach(problem: _Problem, *, random_order: bool,
                     without_replacement: bool) -> torch.Tensor:
    """``(N,)`` float64 probability that each node is accepted, for rules A-D."""
    reach = [0.0] * problem.n
    reach[0] = 1.0
    for u in range(problem.n):  # index order is a topological order
        kids = problem.children[u]
        if not kids or reach[u] == 0.0:
            continue
        r = problem.p(u)
        q = problem.q(u)
        toks = [problem.tokens[s] for s in kids]
        if q is not None and random_order and len(kids) > 1:
            cond = _random_order_probs(r, q, toks)
        else:
            cond = _sequential_probs(r, q, toks, without_replacement)
        for s, c in zip(kids, cond):
            reach[s] = reach[u] * c
    return torch.tensor(reach, dtype=torch.float64)


@dataclass(frozen=True)
class GreedyVerifier(Verifier):
    """Rule E: follow the child whose token is ``argmax p`` (the first such child when
    several siblings share it); the bonus token is ``argmax p`` at the last accepted node."""

    name: ClassVar[str] = "greedy"
    lossless: ClassVar[bool] = True
    sibling_sampling: ClassVar[str] = "greedy"

    def _greedy_path(self, problem: _Problem, trace: _Trace) -> int:
        path, best = greedy_walk(problem.children, problem.tokens, lambda u, d: int(problem.p(u).argmax()),
                                 lambda s, hit: trace.record(s, 1.0 if hit else 0.0))
        trace.path.extend(path)
        return best

    def _walk(self, problem: _Problem, trace: _Trace, generator: torch.Generator) -> int:
        return self._greedy_path(problem, trace)

    def _reach(self, problem: _Problem) -> torch.Tensor:
        trace = _Trace(problem.n)
        self._greedy_path(problem, trace)
        return _path_indicator(problem.n, trace.path)


@dataclass(frozen=True)
class TopKVerifier(Verifier):
    """Rule D: siblings are the draft's top-k, treated as if ``q`` were one-hot.

    Children are tried in index order; sibling ``x`` is accepted with probability
    ``r(x)``; on rejection ``r(x) = 0`` and ``r`` is renormalised; if none is accepted
    the bonus token is drawn from ``r``. ``tree.draft_probs`` is ignored.
    """

    name: ClassVar[str] = "topk"
    lossless: ClassVar[bool] = True
    sibling_sampling: ClassVar[str] = "topk"

    def _walk(self, problem: _Problem, trace: _Trace, generator: torch.Generator) -> int:
        return _rejection_walk(problem, trace, generator, shuffle=False, without_replacement=False)

    def _reach(self, problem: _Problem) -> torch.Tensor:
        return _rejection_reach(problem, random_order=False, without_replacement=False)


@dataclass(frozen=True)
class SpecInferVerifier(Verifier):
    """Rule B: multi-step speculative sampling over a tree (SpecInfer).

    At a reached node the children are tried in a random order drawn from the
    generator; child ``x`` is accepted with probability ``min(1, r(x) / q(x))``; on
    rejection ``r = norm(max(r - q, 0))``. Exact when siblings are drawn i.i.d. from
    ``q``. With a deterministic draft (``tree.draft_probs`` None) it is rule D.
    """

    name: ClassVar[str] = "specinfer"
    lossless: ClassVar[bool] = True
    sibling_sampling: ClassVar[str] = "iid"
    _uses_draft: ClassVar[bool] = True

    def _walk(self, problem: _Problem, trace: _Trace, generator: torch.Generator) -> int:
        return _rejection_walk(problem, trace, generator, shuffle=True, without_replacement=False)

    def _reach(self, problem: _Problem) -> torch.Tensor:
        return _rejection_reach(problem, random_order=True, without_replacement=False)


@dataclass(frozen=True)
class SequoiaVerifier(Verifier):
    """Rule C: rule B for siblings drawn from ``q`` without replacement (Sequoia).

    Children are tried in index order (their draw order); after rejecting ``x`` the
    residual is updated as in B and ``q(x)`` is set to 0 and ``q`` renormalised.
    """

    name: ClassVar[str] = "sequoia"
    lossless: ClassVar[bool] = True
    sibling_sampling: ClassVar[str] = "without_replacement"
    _uses_draft: ClassVar[bool] = True

    def _walk(self, problem: _Problem, trace: _Trace, generator: torch.Generator) -> int:
        return _rejection_walk(problem, trace, generator, shuffle=False, without_replacement=True)

    def _reach(self, problem: _Problem) -> torch.Tensor:
        return _rejection_reach(problem, random_order=False, without_replacement=True)


@dataclass(frozen=True)
class ChainVerifier(Verifier):
    """Rule A: chain rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``; on the first
    rejection emit a sample from ``norm(max(p_i - q_i, 0))``; if every draft is
    accepted emit a sample from ``p`` at the last node. Needs a chain (at most one
    child per node); use ``specinfer`` or ``sequoia`` for trees.
    """

    name: ClassVar[str] = "chain"
    lossless: ClassVar[bool] = True
    sibling_sampling: ClassVar[str] = "iid"
    _uses_draft: ClassVar[bool] = True

    def _problem(self, tree: DraftTree, target_logits: torch.Tensor,
                 config: SamplingConfig) -> _Problem:
        problem = super()._problem(tree, target_logits, config)
        for u, kids in enumerate(problem.children):
            if len(kids) > 1:
                raise ValueError(
                    f"the chain verifier needs a chain (at most one child per node), but node {u} "
                    f"has {len(kids)} children {kids}; use 'specinfer' or 'sequoia' for trees"
                )
        return problem

    def _walk(self, problem: _Problem, trace: _Trace, generator: torch.Generator) -> int:
        return _rejection_walk(problem, trace, generator, shuffle=False, without_replacement=False)

    def _reach(self, problem: _Problem) -> torch.Tensor:
        return _rejection_reach(problem, random_order=False, without_replacement=False)
