"""Sequoia's dynamic program against brute force over every tree of a given size."""

import math

import pytest
import torch

from specviz.tree.sequoia import (
    best_tree_for_hardware,
    expected_tokens,
    positional_acceptance_from_counts,
    sequoia_tree,
)
from specviz.tree.shapes import chain, from_paths, kary


def all_trees(n_ranks: int, budget: int, max_depth: int):
    """Every set of ``budget`` rank paths (ranks < n_ranks, length <= max_depth) that is
    closed under prefixes, each exactly once: grow from a candidate list and only ever
    add candidates after the last one chosen."""

    def children(path):
        if len(path) == max_depth:
            return []
        return [path + (r,) for r in range(n_ranks)]

    def grow(chosen, candidates, start):
        if len(chosen) == budget:
            yield list(chosen)
            return
        for i in range(start, len(candidates)):
            c = candidates[i]
            yield from grow(chosen + [c], candidates + children(c), i + 1)

    yield from grow([], children(()), 0)


def brute_force_best(acceptance, budget, max_depth):
    return max(expected_tokens(from_paths(p), acceptance)
               for p in all_trees(len(acceptance), budget, max_depth))


def test_enumerator_counts_ordered_trees():
    # With 2 ranks (left/right) and no depth limit, n draft nodes under the root form a
    # binary tree of n + 1 nodes: Catalan number C(n + 1).
    assert [sum(1 for _ in all_trees(2, n, n)) for n in range(5)] == [1, 2, 5, 14, 42]
    # With one rank only chains exist.
    assert sum(1 for _ in all_trees(1, 4, 4)) == 1


ACCEPTANCES = [
    (0.6, 0.2, 0.1),       # decreasing, the usual case
    (0.45, 0.45),          # a tie between ranks
    (0.2, 0.5, 0.25),      # non-monotone estimate: rank 1 beats rank 0
    (0.9,),                # one rank: only chains
    (0.3, 0.0, 0.4),       # a rank that is never accepted
]


@pytest.mark.parametrize("acceptance", ACCEPTANCES)
def test_dp_is_optimal_against_brute_force(acceptance):
    max_budget = 6 if len(acceptance) <= 2 else 5
    for depth in range(0, 4):
        for budget in range(0, max_budget + 1):
            if budget > sum(len(acceptance) ** i for i in range(1, depth + 1)):
                with pytest.raises(ValueError, match="does not fit"):
                    sequoia_tree(acceptance, budget, depth)
                continue
            res = sequoia_tree(acceptance, budget, depth)
            assert res.shape.budget == budget and res.budget == budget
            assert res.shape.depth <= depth and res.max_depth == depth
            assert max(res.shape.ranks) < len(acceptance)
            assert res.expected_tokens == pytest.approx(expected_tokens(res.shape, acceptance), abs=1e-12)
            assert res.expected_tokens == pytest.approx(brute_force_best(acceptance, budget, depth),
                                                        abs=1e-12)


def test_random_acceptance_vectors_match_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        raw = torch.rand(3, generator=g, dtype=torch.float64)
        acceptance = tuple((raw / raw.sum() * 0.9).tolist())
        for budget in (3, 5):
            res = sequoia_tree(acceptance, budget, 3)
            assert res.expected_tokens == pytest.approx(brute_force_best(acceptance, budget, 3), abs=1e-12)


def test_decreasing_acceptance_uses_leading_ranks():
    # Sequoia's own recursion only ever uses ranks 0..b-1; with a decreasing vector ours must too.
    res = sequoia_tree((0.5, 0.25, 0.12, 0.06), 30, 6)
    for u in range(res.shape.n_nodes):
        kids = [res.shape.ranks[i] for i in range(1, res.shape.n_nodes) if res.shape.parents[i] == u]
        assert kids == list(range(len(kids)))


def test_result_is_ordered_parents_first_siblings_by_rank():
    res = sequoia_tree((0.5, 0.3, 0.1), 12, 4)
    s = res.shape
    assert from_paths(s.paths()) == s  # canonical breadth-first order
    assert all(s.parents[i] < i for i in range(1, s.n_nodes))


@pytest.mark.parametrize("acceptance", [(0.8, 0.1), (0.5, 0.3, 0.1), (0.3, 0.3, 0.3)])
def test_chain_of_same_budget_is_never_better(acceptance):
    for budget in range(1, 9):
        res = sequoia_tree(acceptance, budget, budget)
        assert expected_tokens(chain(budget), acceptance) <= res.expected_tokens + 1e-12


def test_closed_forms():
    assert sequoia_tree((0.6,), 0, 0).expected_tokens == 1.0
    res = sequoia_tree((0.6,), 4, 4)
    assert res.shape == chain(4)
    assert res.expected_tokens == pytest.approx(sum(0.6 ** i for i in range(5)))
    # With equal top-2 acceptance and budget 2, depth 1 forces two siblings.
    assert sequoia_tree((0.4, 0.4), 2, 1).shape == kary(2, 1)
    assert expected_tokens(kary(2, 2), (0.5, 0.25)) == pytest.approx(1 + 0.75 + 0.75 ** 2)


def test_input_errors():
    with pytest.raises(ValueError, match="sum to <= 1"):
        sequoia_tree((0.7, 0.6), 3, 3)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        sequoia_tree((0.5, -0.1), 3, 3)
    with pytest.raises(ValueError, match="at least one entry"):
        sequoia_tree((), 3, 3)
    with pytest.raises(ValueError, match="budget must be"):
        sequoia_tree((0.5,), -1, 3)
    with pytest.raises(ValueError, match="max_depth must be"):
        sequoia_tree((0.5,), 1, 1.5)
    with pytest.raises(ValueError, match="does not fit"):
        sequoia_tree((0.5, 0.2), 7, 2)
    with pytest.raises(ValueError, match="uses rank 2"):
        expected_tokens(kary(3, 1), (0.5, 0.2))


def test_hardware_choice_by_hand():
    # a = 0.5: a depth-1 tree of 1 node commits 1.5 tokens for 1 + 1 s; a chain of 2
    # commits 1.75 for 2 + 1 s. Budget 2 at depth 1 cannot fit with one rank.
    choice = best_tree_for_hardware((0.5,), budgets=[1, 2], depths=[1, 2], t_draft=1.0,
                                    t_verify={1: 1.0, 2: 1.0})
    assert choice.result.shape == chain(1)
    assert choice.time_per_token_s == pytest.approx(2.0 / 1.5)
    assert [(c.budget, c.max_depth, c.depth) for c in choice.candidates] == [(1, 1, 1), (1, 2, 1), (2, 2, 2)]
    for c in choice.candidates:
        assert c.time_per_token_s == pytest.approx(c.step_time_s / c.expected_tokens)


def test_hardware_choice_follows_costs():
    a = (0.6, 0.2, 0.1)
    # Free drafting and flat verification: the biggest, deepest tree wins.
    free = best_tree_for_hardware(a, [2, 8, 16], [2, 4], t_draft=0.0, t_verify=lambda n: 1.0)
    assert (free.result.budget, free.result.max_depth) == (16, 4)
    assert free.result == sequoia_tree(a, 16, 4)
    # Verification that grows steeply with the tree: the small tree wins.
    steep = best_tree_for_hardware(a, [2, 8, 16], [2, 4], t_draft=0.01, t_verify=lambda n: 1.0 + n)
    assert steep.result.budget == 2
    assert steep.time_per_token_s == min(c.time_per_token_s for c in steep.candidates)
    assert not math.isnan(steep.time_per_token_s)


def test_hardware_errors():
    with pytest.raises(ValueError, match="no entry for budget 8"):
        best_tree_for_hardware((0.5,), [8], [8], t_draft=0.1, t_verify={4: 1.0})
    with pytest.raises(ValueError, match="no budget"):
        best_tree_for_hardware((0.5,), [3], [1, 2], t_draft=0.1, t_verify=lambda n: 1.0)
    with pytest.raises(ValueError, match="non-empty"):
        best_tree_for_hardware((0.5,), [], [1], t_draft=0.1, t_verify=lambda n: 1.0)
    with pytest.raises(ValueError, match="t_draft"):
        best_tree_for_hardware((0.5,), [1], [1], t_draft=-1.0, t_verify=lambda n: 1.0)
    with pytest.raises(ValueError, match=r"t_verify\(1\)"):
        best_tree_for_hardware((0.5,), [1], [1], t_draft=0.0, t_verify=lambda n: float("nan"))


def test_positional_acceptance_from_counts():
    a = positional_acceptance_from_counts([30, 10, 5], reached=100)
    assert a == (0.3, 0.1, 0.05)
    assert sequoia_tree(a, 4, 4).budget == 4
    with pytest.raises(ValueError, match="at most one child"):
        positional_acceptance_from_counts([60, 50], reached=100)
    with pytest.raises(ValueError, match="reached must be"):
        positional_acceptance_from_counts([0], reached=0)
    with pytest.raises(ValueError, match=r"accepted_at_rank\[1\]"):
        positional_acceptance_from_counts([1, -1], reached=10)
