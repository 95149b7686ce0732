"""Sequoia's dynamic program: the static tree with the most expected tokens per step.

Model (Sequoia, Chen et al. 2024): a node's ``k``-th ranked
child (rank ``k - 1``) is the one the verifier accepts with probability ``a_k``,
whatever the node and its depth, and independently of everything else. A
shape's expected tokens per step is then

    1 + sum over draft nodes v of  prod over the path root..v of a_{rank + 1},

the 1 being the bonus token the target always adds (so a root-only tree scores 1
and the value is *tau*, not accepted draft tokens per step).

The program fills ``f(m, l, b)``: the best value of a subtree of ``m`` nodes
(its root included) and depth at most ``l`` whose root's children use only ranks
``1..b``. Either rank ``b`` is left out, ``f(m, l, b - 1)``, or it heads a child
subtree of ``m - y`` nodes, ``f(y, l, b - 1) + a_b * f(m - y, l - 1, K)``. Sequoia's
own recursion always takes ranks ``1..b`` in order; the extra "leave rank b out"
choice changes nothing when ``a`` is non-increasing, and keeps the result optimal
over *all* trees when an estimated ``a`` is not. Back-pointers rebuild the tree.

:func:`best_tree_for_hardware` then picks the budget and depth minimising
``(depth * t_draft + t_verify(budget)) / F(budget, depth)``, the predicted
wall time per committed token.

Dimension legend: K = length of the acceptance vector (ranks considered),
n = budget (draft nodes, root excluded), d = depth limit, m = nodes in a subtree
(root included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from specviz.tree.shapes import TreeShape, from_paths
from specviz.validate import check_int

__all__ = [
    "SequoiaResult",
    "HardwareCandidate",
    "HardwareChoice",
    "sequoia_tree",
    "best_tree_for_hardware",
    "expected_tokens",
    "positional_acceptance_from_counts",
]


@dataclass(frozen=True)
class SequoiaResult:
    """The optimal static tree for one budget and depth limit.

    Attributes:
        shape: the tree; parents precede children, siblings ordered by rank.
        expected_tokens: expected tokens committed per step (tau, bonus included).
        budget: draft nodes requested (== ``shape.budget``).
        max_depth: depth limit the tree was built under (``shape.depth`` may be smaller).
    """

    shape: TreeShape
    expected_tokens: float
    budget: int
    max_depth: int


@dataclass(frozen=True)
class HardwareCandidate:
    """One (budget, depth limit) pair scored by :func:`best_tree_for_hardware`.

    Attributes:
        budget: draft nodes.
        max_depth: depth limit given to the dynamic program.
        depth: depth of the tree it returned (what the drafter pays for).
        expected_tokens: expected tokens per step (tau).
        step_time_s: predicted ``depth * t_draft + t_verify(budget)``, seconds.
        time_per_token_s: ``step_time_s / expected_tokens``, seconds.
    """

    budget: int
    max_depth: int
    depth: int
    expected_tokens: float
    step_time_s: float
    time_per_token_s: float


@dataclass(frozen=True)
class HardwareChoice:
    """The best tree for the measured costs, plus every candidate scored.

    Attributes:
        result: the chosen tree.
        time_per_token_s: its predicted wall time per committed token, seconds.
        candidates: every feasible (budget, depth limit) pair, in the order searched.
    """

    result: SequoiaResult
    time_per_token_s: float
    candidates: tuple[HardwareCandidate, ...]


def _check_acceptance(acceptance: Sequence[float]) -> np.ndarray:
    a = np.asarray([float(x) for x in acceptance], dtype=np.float64)  # (K,)
    if a.size == 0:
        raise ValueError("acceptance needs at least one entry (a_1, the top-1 child)")
    if not np.all(np.isfinite(a)) or np.any(a < 0) or np.any(a > 1):
        raise ValueError(f"acceptance entries must be probabilities in [0, 1], got {a.tolist()}")
    # The k-th ranked child being *the* accepted one are mutually exclusive events.
    if a.sum() > 1 + 1e-9:
        raise ValueError(
            f"acceptance entries are chances of exclusive events and must sum to <= 1, "
            f"got sum {a.sum():.6f} for {a.tolist()}"
        )
    return a


def _capacity(k: int, depth: int) -> int:
    """Most draft nodes a tree with ``k`` ranks per node and the given depth can hold."""
    return sum(k ** i for i in range(1, depth + 1))


class _Table:
    """The filled dynamic-program table, for every budget <= max_budget and depth <= max_depth."""

    def __init__(self, a: np.ndarray, max_budget: int, max_depth: int) -> None:
        k = a.size
        m_max = max_budget + 1
        self.a = a
        # value[m, l, b]: best subtree value; -inf where m nodes cannot fit.
        value = np.full((m_max + 1, max_depth + 1, k + 1), -np.inf)  # (M+1, d+1, K+1)
        # split[m, l, b]: 0 = rank b left out, y > 0 = y nodes stay with ranks < b.
        split = np.zeros((m_max + 1, max_depth + 1, k + 1), dtype=np.int64)
        value[1] = 1.0
        for l in range(1, max_depth + 1):
            for m in range(2, m_max + 1):
                # Best child subtrees of m - y nodes for y = 1..m-1, i.e. of m-1 .. 1 nodes.
                child = value[m - 1:0:-1, l - 1, k]  # (m-1,)
                fits = np.isfinite(child)
                for b in range(1, k + 1):
                    skip = value[m, l, b - 1]
                    # Scale only the feasible entries: a_b * -inf is nan when a_b == 0.
                    scaled = np.full(m - 1, -np.inf)
                    scaled[fits] = a[b - 1] * child[fits]
                    take = value[1:m, l, b - 1] + scaled  # (m-1,) indexed by y - 1
                    y = int(np.argmax(take))
                    # Ties go to leaving rank b out, so lower ranks are preferred.
                    if take[y] > skip:
                        value[m, l, b] = take[y]
                        split[m, l, b] = y + 1
                    else:
                        value[m, l, b] = skip
        self.value = value
        self.split = split

    def result(self, budget: int, max_depth: int) -> SequoiaResult:
        k = self.a.size
        best = float(self.value[budget + 1, max_depth, k])
        if math.isinf(best):
            raise ValueError(
                f"budget {budget} does not fit in depth {max_depth} with {k} ranks per node "
                f"(at most {_capacity(k, max_depth)} draft nodes)"
            )
        paths: list[tuple[int, ...]] = []
        self._rebuild(budget + 1, max_depth, k, (), paths)
        return SequoiaResult(from_paths(paths), best, budget, max_depth)

    def _rebuild(self, m: int, l: int, b: int, prefix: tuple[int, ...],
                 out: list[tuple[int, ...]]) -> None:
        """Append the paths of the subtree chosen for ``value[m, l, b]`` under ``prefix``."""
        while m > 1:
            y = int(self.split[m, l, b])
            if y > 0:
                child = prefix + (b - 1,)
                out.append(child)
                self._rebuild(m - y, l - 1, self.a.size, child, out)
                m = y
            b -= 1


def sequoia_tree(acceptance: Sequence[float], budget: int, max_depth: int) -> SequoiaResult:
    """The static tree of ``budget`` draft nodes and depth <= ``max_depth`` with the most
    expected tokens per step under the positional acceptance model.

    Args:
        acceptance: ``a_1..a_K``; ``a_k`` is the chance that the ``k``-th ranked child
            (rank ``k - 1``) is the accepted one, given its parent was reached. Entries
            in [0, 1] summing to <= 1. ``K`` caps the number of children per node.
        budget: draft nodes, root excluded (0 gives the root-only tree).
        max_depth: longest root-to-leaf path allowed.

    Raises:
        ValueError: on a bad acceptance vector, a negative budget or depth, or a budget
            that cannot fit in ``max_depth`` levels of ``K`` children.
    """
    a = _check_acceptance(acceptance)
    check_int("budget", budget, 0)
    check_int("max_depth", max_depth, 0)
    return _Table(a, budget, max_depth).result(budget, max_depth)


def expected_tokens(shape: TreeShape, acceptance: Sequence[float]) -> float:
    """Expected tokens per step (tau) of any ``shape`` under the positional model:
    ``1 + sum over draft nodes of the product of a_{rank + 1} along the path``.

    Raises:
        ValueError: if ``shape`` uses a rank with no entry in ``acceptance``.
    """
    a = _check_acceptance(acceptance)
    if max(shape.ranks) >= a.size:
        raise ValueError(
            f"shape uses rank {max(shape.ranks)} but acceptance has only {a.size} entries "
            f"(ranks 0..{a.size - 1}); pad it with zeros to score deeper ranks as never accepted"
        )
    reach = [1.0] * shape.n_nodes  # chance each node is on the accepted path
    for i in range(1, shape.n_nodes):
        reach[i] = reach[shape.parents[i]] * float(a[shape.ranks[i]])
    return float(sum(reach))


def best_tree_for_hardware(
    acceptance: Sequence[float],
    budgets: Sequence[int],
    depths: Sequence[int],
    t_draft: float,
    t_verify: Callable[[int], float] | Mapping[int, float],
) -> HardwareChoice:
    """Pick the (budget, depth limit) whose optimal tree minimises predicted time per token.

    A step costs ``depth * t_draft`` (one draft call per tree level, using the depth of
    the tree actually returned) plus ``t_verify(budget)`` (one target call over the
    tree), and commits ``F(budget, depth)`` tokens on average.

    Args:
        acceptance: positional acceptance vector, as for :func:`sequoia_tree`.
        budgets: candidate numbers of draft nodes.
        depths: candidate depth limits.
        t_draft: seconds per draft call (one tree level).
        t_verify: seconds for one target call verifying a tree of ``n`` draft nodes
            (plus its root), as a function of ``n`` or a mapping keyed by ``n``.

    Returns:
        The best choice (ties go to the earlier candidate) and every feasible candidate.

    Raises:
        ValueError: on empty or bad candidate lists, a negative ``t_draft``, a missing
            ``t_verify`` entry, or when no (budget, depth) pair is feasible.
    """
    a = _check_acceptance(acceptance)
    budgets, depths = list(budgets), list(depths)
    if not budgets or not depths:
        raise ValueError(f"budgets and depths must be non-empty, got {budgets} and {depths}")
    for n in budgets:
        check_int("budgets entry", n, 0)
    for d in depths:
        check_int("depths entry", d, 0)
    if not (t_draft >= 0):
        raise ValueError(f"t_draft must be >= 0 seconds, got {t_draft}")
    table = _Table(a, max(budgets), max(depths))
    candidates: list[HardwareCandidate] = []
    results: list[SequoiaResult] = []
    for n in budgets:
        t_v = _verify_time(t_verify, n)
        for d in depths:
            if n > _capacity(a.size, d):
                continue
            res = table.result(n, d)
            step = res.shape.depth * t_draft + t_v
            candidates.append(HardwareCandidate(n, d, res.shape.depth, res.expected_tokens,
                                                step, step / res.expected_tokens))
            results.append(res)
    if not candidates:
        raise ValueError(
            f"no budget in {budgets} fits any depth in {depths} with {a.size} ranks per node"
        )
    i = min(range(len(candidates)), key=lambda j: candidates[j].time_per_token_s)
    return HardwareChoice(results[i], candidates[i].time_per_token_s, tuple(candidates))


def _verify_time(t_verify: Callable[[int], float] | Mapping[int, float], n: int) -> float:
    if isinstance(t_verify, Mapping):
        if n not in t_verify:
            raise ValueError(f"t_verify has no entry for budget {n}; it has {sorted(t_verify)}")
        t = float(t_verify[n])
    else:
        t = float(t_verify(n))
    if not (t >= 0):
        raise ValueError(f"t_verify({n}) must be >= 0 seconds, got {t}")
    return t


def positional_acceptance_from_counts(accepted_at_rank: Sequence[int], reached: int) -> tuple[float, ...]:
    """Estimate ``a_1..a_K`` from observed verifications.

    Args:
        accepted_at_rank: ``accepted_at_rank[k]`` = how often the child of rank ``k``
            was the one accepted, over parents that were reached with all ``K`` ranked
            children drafted.
        reached: how many such parents were reached (accepted or not).

    Returns:
        ``a_k = accepted_at_rank[k - 1] / reached``, a valid input to :func:`sequoia_tree`.

    Raises:
        ValueError: on negative counts, ``reached < 1``, or more acceptances than reached parents.
    """
    counts = list(accepted_at_rank)
    if not counts:
        raise ValueError("accepted_at_rank needs at least one entry")
    for k, c in enumerate(counts):
        check_int(f"accepted_at_rank[{k}]", c, 0)
    check_int("reached", reached, 1)
    if sum(counts) > reached:
        raise ValueError(
            f"{sum(counts)} acceptances counted over only {reached} reached parents; "
            "at most one child per reached parent can be accepted"
        )
    return tuple(c / reached for c in counts)
