"""The lossy rules, shown as such: Medusa's typical acceptance (F) and the tutorials' naive
threshold rules (G). Their outputs do not follow the target distribution; the verification lab
(:mod:`specviz.verify.lab`) shows by how much."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from specviz.tree.core import depths
from specviz.verify.base import Verifier, _path_indicator, _Problem, _sample_token, _Trace

__all__ = ["TypicalVerifier", "NaiveVerifier"]


@dataclass(frozen=True)
class TypicalVerifier(Verifier):
    """Rule F, lossy: Medusa's typical acceptance.

    A node passes if ``p(x) > min(eps, alpha * exp(-H(p)))`` with ``p`` the target
    distribution at its parent. The accepted path is the deepest node whose whole path
    passes (Medusa keeps the longest accepted candidate; ties go to the lowest node
    index). The bonus token is a sample from ``p`` at the last accepted node (the argmax
    at temperature 0, where this rule reduces to greedy).

    Args:
        eps: hard threshold on ``p(x)`` (Medusa's ``posterior_threshold``).
        alpha: entropy-scaled threshold factor (Medusa's ``posterior_alpha``).
    """

    eps: float = 0.09
    alpha: float = 0.3

    name: ClassVar[str] = "typical"
    lossless: ClassVar[bool] = False
    sibling_sampling: ClassVar[str] = "topk"

    def __post_init__(self) -> None:
        if not 0.0 < self.eps <= 1.0:
            raise ValueError(f"eps must be in (0, 1], got {self.eps}")
        if not self.alpha > 0.0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")

    def _typical_path(self, problem: _Problem, trace: _Trace) -> None:
        passes = [False] * problem.n
        passes[0] = True
        probs: dict[int, torch.Tensor] = {}
        thresholds: dict[int, float] = {}
        for s in range(1, problem.n):
            u = problem.parents[s]
            if not passes[u]:
                continue
            if u not in probs:
                p = problem.p(u)  # (V,)
                entropy = float(-torch.special.xlogy(p, p).sum())
                probs[u] = p
                thresholds[u] = min(self.eps, self.alpha * math.exp(-entropy))
            passes[s] = float(probs[u][problem.tokens[s]]) > thresholds[u]
            trace.record(s, 1.0 if passes[s] else 0.0)
        depth = depths(torch.tensor(problem.parents)).tolist()
        best = max(range(problem.n), key=lambda i: (passes[i], depth[i], -i))
        node = best
        while node != 0:
            trace.path.append(node)
            node = problem.parents[node]
        trace.path.reverse()

    def _walk(self, problem: _Problem, trace: _Trace, generator: torch.Generator) -> int:
        self._typical_path(problem, trace)
        last = trace.path[-1] if trace.path else 0
        return _sample_token(problem.p(last), trace.uniforms[0])

    def _reach(self, problem: _Problem) -> torch.Tensor:
        trace = _Trace(problem.n)
        self._typical_path(problem, trace)
        return _path_indicator(problem.n, trace.path)


@dataclass(frozen=True)
class NaiveVerifier(Verifier):
    """Rule G, lossy: the tutorial rule "accept x if p(x) >= min_ratio * q(x)".

    Children are tried in index order and the first that passes is accepted. When
    none passes, the bonus token is a fresh sample from ``p`` at that node, as the
    tutorials do: together with the hard threshold this skews the output towards the
    draft (a lossless rule would sample the residual instead). With a deterministic
    draft ``q(x) = 1``.

    Args:
        min_ratio: 1.0 gives "naive" (``p >= q``), 0.5 gives "naive_half".
    """

    min_ratio: float = 1.0

    lossless: ClassVar[bool] = False
    sibling_sampling: ClassVar[str] = "iid"
    _uses_draft: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not self.min_ratio > 0.0:
            raise ValueError(f"min_ratio must be > 0, got {self.min_ratio}")

    @property
    def name(self) -> str:  # type: ignore[override]
        if self.min_ratio == 1.0:
            return "naive"
        if self.min_ratio == 0.5:
            return "naive_half"
        return f"naive_{self.min_ratio:g}"

    def _naive_path(self, problem: _Problem, trace: _Trace) -> int:
        """Fill ``trace`` and return the last accepted node."""
        u = 0
        while True:
            p = problem.p(u)
            q = problem.q(u) if problem.children[u] else None
            chosen = None
            for s in problem.children[u]:
                x = problem.tokens[s]
                q_x = 1.0 if q is None else float(q[x])
                hit = float(p[x]) >= self.min_ratio * q_x
                trace.record(s, 1.0 if hit else 0.0)
                if hit:
                    chosen = s
                    break
            if chosen is None:
                return u
            trace.path.append(chosen)
            u = chosen

    def _walk(self, problem: _Problem, trace: _Trace, generator: torch.Generator) -> int:
        last = self._naive_path(problem, trace)
        return _sample_token(problem.p(last), trace.uniforms[0])

    def _reach(self, problem: _Problem) -> torch.Tensor:
        trace = _Trace(problem.n)
        self._naive_path(problem, trace)
        return _path_indicator(problem.n, trace.path)
