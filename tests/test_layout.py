"""Tidy tree layout: the drawing properties a reader relies on, for 1 to 128 nodes."""

from __future__ import annotations

import itertools

import pytest
import torch

from specviz.render.layout import TreeLayout, tidy_layout
from specviz.tree.shapes import chain, expansion, kary
from specviz.tree.core import DraftTree


def _random_parents(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    parents = [-1]
    for i in range(1, n):
        # bias towards recent nodes so some trees are deep and some bushy
        lo = 0 if seed % 2 else max(0, i - 4)
        parents.append(int(torch.randint(lo, i, (1,), generator=g)))
    return parents


def _trees() -> list[list[int]]:
    trees = [[-1], list(chain(1).parents), list(chain(127).parents),
             [-1] + [0] * 127,  # star: 127 children of the root
             list(kary(2, 6).parents), list(expansion([4, 3, 2, 1]).parents)]
    trees += [_random_parents(n, seed) for n, seed in itertools.product((2, 5, 17, 64, 128), (0, 1, 2))]
    return trees


def _children(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], start=1):
        kids[p].append(i)
    return kids


@pytest.mark.parametrize("parents", _trees(), ids=lambda p: f"n{len(p)}")
def test_tidy_layout_properties(parents):
    lay = tidy_layout(parents)
    n = len(parents)
    assert lay.n_nodes == n
    assert min(lay.x) == 0.0
    # rows are depths
    for i in range(1, n):
        assert lay.y[i] == lay.y[parents[i]] + 1
    kids = _children(parents)
    for u, ks in enumerate(kids):
        if ks:
            # parent centred over its first and last child; children left to right in node order
            assert lay.x[u] == pytest.approx((lay.x[ks[0]] + lay.x[ks[-1]]) / 2)
            assert all(lay.x[a] < lay.x[b] for a, b in zip(ks, ks[1:]))
    # no overlap on a row
    rows: dict[int, list[float]] = {}
    for i in range(n):
        rows.setdefault(lay.y[i], []).append(lay.x[i])
    for xs in rows.values():
        xs.sort()
        assert all(b - a >= lay.separation - 1e-9 for a, b in zip(xs, xs[1:]))
    # no crossing edges: between two rows, parent order and child order agree
    edges = [(parents[i], i) for i in range(1, n)]
    for (p1, c1), (p2, c2) in itertools.combinations(edges, 2):
        if lay.y[c1] != lay.y[c2] or p1 == p2:
            continue
        assert (lay.x[p1] - lay.x[p2]) * (lay.x[c1] - lay.x[c2]) > 0


def test_tidy_layout_deterministic_and_accepts_trees():
    parents = _random_parents(64, 3)
    tree = DraftTree.from_lists(list(range(64)), parents)
    a, b = tidy_layout(parents), tidy_layout(tree)
    assert a == b == tidy_layout(torch.tensor(parents))
    assert isinstance(a, TreeLayout)


def test_tidy_layout_shapes():
    assert tidy_layout([-1]).x == (0.0,)
    assert tidy_layout(chain(5)).width == 0.0
    star = tidy_layout([-1, 0, 0, 0])
    assert star.x == (1.0, 0.0, 1.0, 2.0)
    assert star.depth == 1
    # subtrees are packed by contour, not one column per leaf
    lopsided = tidy_layout([-1, 0, 0, 1, 1, 2, 2])
    assert lopsided.width == 3.0
    assert tidy_layout([-1, 0, 0], separation=2.5).width == 2.5


@pytest.mark.parametrize("bad, err", [([], ValueError), ([0], ValueError), ([-1, 1], ValueError),
                                      ([-1, 0.0], TypeError)])
def test_tidy_layout_rejects_bad_parents(bad, err):
    with pytest.raises(err):
        tidy_layout(bad)


def test_tidy_layout_rejects_bad_separation():
    with pytest.raises(ValueError, match="separation"):
        tidy_layout([-1, 0], separation=0)
