"""Tree shape constructors and validation."""

import pytest
import torch

from specviz.tree.shapes import TreeShape, chain, expansion, from_paths, kary
from specviz.tree.core import DraftTree, depths


def test_chain():
    s = chain(3)
    assert s.parents == (-1, 0, 1, 2) and s.ranks == (0, 0, 0, 0)
    assert (s.n_nodes, s.budget, s.depth, s.width) == (4, 3, 3, 1)
    assert s.paths() == ((0,), (0, 0), (0, 0, 0))
    root = chain(0)
    assert (root.n_nodes, root.budget, root.depth, root.width) == (1, 0, 0, 0)
    assert root.paths() == ()


def test_kary_is_breadth_first():
    s = kary(2, 2)
    assert s.parents == (-1, 0, 0, 1, 1, 2, 2)
    assert s.ranks == (0, 0, 1, 0, 1, 0, 1)
    assert s.paths() == ((0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1))
    assert (s.budget, s.depth, s.width) == (6, 2, 2)
    assert kary(3, 3).budget == 3 + 9 + 27
    assert kary(4, 0) == chain(0)


def test_expansion():
    s = expansion([2, 2, 1])
    assert (s.budget, s.depth, s.width) == (2 + 4 + 4, 3, 2)
    assert s.depths() == (0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
    assert all(r == 0 for r, d in zip(s.ranks, s.depths()) if d == 3)
    assert expansion([1, 1, 1]) == chain(3)
    assert expansion([3, 2]) == from_paths([(i,) for i in range(3)]
                                           + [(i, j) for i in range(3) for j in range(2)])


@pytest.mark.parametrize("bad", [[2, 0], [-1], [1.5]])
def test_expansion_rejects_bad_factors(bad):
    with pytest.raises(ValueError, match="branching"):
        expansion(bad)


@pytest.mark.parametrize("call", [lambda: chain(-1), lambda: kary(0, 2), lambda: kary(2, -1),
                                  lambda: chain(True)])
def test_counts_are_checked(call):
    with pytest.raises(ValueError, match="must be an int >="):
        call()


def test_from_paths_sorts_and_round_trips():
    medusa = [(1,), (0, 1), (0,), (0, 0), (2,), (0, 0, 0)]
    s = from_paths(medusa)
    assert s.paths() == ((0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0))
    assert s.parents == (-1, 0, 0, 0, 1, 1, 4)
    assert s.ranks == (0, 0, 1, 2, 0, 1, 0)
    for shape in (kary(2, 3), expansion([3, 1, 2]), chain(4), s):
        assert from_paths(shape.paths()) == shape
        assert from_paths(reversed(shape.paths())) == shape
    # Gaps in ranks are allowed: a sparse tree may skip a candidate.
    gap = from_paths([(0,), (2,)])
    assert gap.ranks == (0, 0, 2)
    assert from_paths([]) == chain(0)


@pytest.mark.parametrize(
    "paths, error, match",
    [
        ([(0, 0)], ValueError, r"parent path \(0,\) is not"),
        ([(0,), (1, 0)], ValueError, r"parent path \(1,\) is not"),
        ([(0,), (0,)], ValueError, "more than once"),
        ([()], ValueError, "non-empty"),
        ([(0,), (-1,)], ValueError, "negative"),
        ([(0.0,)], TypeError, "must be an int"),
    ],
)
def test_from_paths_errors(paths, error, match):
    with pytest.raises(error, match=match):
        from_paths(paths)


@pytest.mark.parametrize(
    "parents, ranks, match",
    [
        ((), (), "at least the root"),
        ((-1, 0), (0,), "same length"),
        ((0,), (0,), "parent -1"),
        ((-1,), (1,), "root's rank"),
        ((-1, 1), (0, 0), "node 1 has parent 1"),
        ((-1, 0, 0), (0, 1, 1), "sibling ranks"),
        ((-1, 0, 0), (0, 1, 0), "sibling ranks"),
        ((-1, 0), (0, -2), "rank -2"),
    ],
)
def test_tree_shape_validation(parents, ranks, match):
    with pytest.raises(ValueError, match=match):
        TreeShape(parents, ranks)


def test_tree_shape_type_checks_and_tensor_input():
    with pytest.raises(TypeError, match=r"ranks\[1\] must be an int"):
        TreeShape((-1, 0), (0, True))
    s = TreeShape(torch.tensor([-1, 0, 0]), torch.tensor([0, 0, 1]))
    assert s == kary(2, 1) and isinstance(s.parents, tuple)


def test_from_parents_assigns_sibling_ranks():
    s = TreeShape.from_parents([-1, 0, 0, 1, 0])
    assert s.ranks == (0, 0, 1, 0, 2)


def test_shapes_feed_draft_trees():
    s = expansion([2, 1])
    parents = s.parents_tensor()
    assert parents.dtype == torch.long
    assert depths(parents).tolist() == list(s.depths())
    tree = DraftTree(torch.arange(s.n_nodes), parents, ranks=torch.tensor(s.ranks))
    assert tree.depth == s.depth and tree.budget == s.budget
