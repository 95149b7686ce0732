"""Token-tree merge of several draft trees (specviz.tree.trie)."""

import pytest
import torch

from specviz.tree.core import DraftTree, path_to
from specviz.tree.trie import merge_trees, merge_trees_with_map


def _tree(tokens, parents, q=None) -> DraftTree:
    return DraftTree.from_lists(tokens, parents, q=q)


def _token_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    tokens = tree.tokens.tolist()
    return {tuple(tokens[j] for j in path_to(tree, i)) for i in range(tree.n_nodes)}


def test_common_prefixes_are_shared():
    a = _tree([9, 1, 2, 3], [-1, 0, 1, 2], q=[1.0, 0.9, 0.8, 0.7])  # chain 1 2 3
    b = _tree([9, 1, 2, 4, 5], [-1, 0, 1, 2, 0], q=[1.0, 0.6, 0.95, 0.9, 0.3])  # 1 2 4, and 5
    merged = merge_trees([a, b])
    assert merged.n_nodes == 6  # root, 1, 5, 2, 3, 4
    assert _token_paths(merged) == _token_paths(a) | _token_paths(b)
    # breadth first, siblings by merged q: under the root 1 (0.9) before 5 (0.3);
    # under 2: 4 (0.9) before 3 (0.7)
    assert merged.tokens.tolist() == [9, 1, 5, 2, 4, 3]
    assert merged.parents.tolist() == [-1, 0, 0, 1, 3, 3]
    assert merged.q.tolist() == pytest.approx([1.0, 0.9, 0.3, 0.95, 0.9, 0.7])  # max over inputs
    assert merged.ranks.tolist() == [0, 0, 1, 0, 0, 1]
    assert merged.source.tolist() == [0, 0, 1, 0, 1, 0]  # first tree that proposed the node
    assert merged.draft_probs is None


def test_merging_a_tree_with_itself_changes_nothing_but_order():
    a = _tree([0, 4, 5, 6, 7], [-1, 0, 0, 1, 1], q=[1.0, 0.5, 0.4, 0.3, 0.2])
    merged = merge_trees([a, a, a])
    assert merged.n_nodes == a.n_nodes
    assert _token_paths(merged) == _token_paths(a)
    assert merged.source.tolist() == [0] * a.n_nodes


def test_node_maps_point_at_matching_nodes():
    a = _tree([3, 1, 2, 2, 8], [-1, 0, 0, 1, 2], q=[1.0, 0.5, 0.4, 0.3, 0.2])
    b = _tree([3, 2, 8, 1, 7], [-1, 0, 1, 0, 3], q=[1.0, 0.6, 0.1, 0.2, 0.9])
    result = merge_trees_with_map([a, b])
    tree = result.tree
    for src, node_map in zip((a, b), result.node_maps):
        assert len(node_map) == src.n_nodes
        for i, m in enumerate(node_map):
            assert int(tree.tokens[m]) == int(src.tokens[i])
            if i > 0:
                assert node_map[int(src.parents[i])] == int(tree.parents[m])


def test_duplicate_siblings_inside_one_tree_collapse():
    # i.i.d. sibling sampling can propose the same token twice
    a = _tree([0, 5, 5, 6], [-1, 0, 0, 2], q=[1.0, 0.4, 0.4, 0.2])
    result = merge_trees_with_map([a])
    assert result.tree.tokens.tolist() == [0, 5, 6]
    assert result.node_maps[0] == (0, 1, 1, 2)


def test_q_is_dropped_unless_every_input_has_it():
    a = _tree([0, 1], [-1, 0], q=[1.0, 0.5])
    b = _tree([0, 2], [-1, 0])
    merged = merge_trees([a, b])
    assert merged.q is None
    assert merged.tokens.tolist() == [0, 1, 2]  # first appearance order without q
    assert merged.ranks.tolist() == [0, 0, 1]


def test_parents_precede_children_for_many_random_trees():
    gen = torch.Generator().manual_seed(0)
    trees = []
    for _ in range(5):
        n = 12
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        tokens = [7] + torch.randint(0, 4, (n - 1,), generator=gen).tolist()
        trees.append(_tree(tokens, parents, q=torch.rand(n, generator=gen).tolist()))
    merged = merge_trees(trees)
    assert all(int(merged.parents[i]) < i for i in range(1, merged.n_nodes))
    assert _token_paths(merged) == set().union(*(_token_paths(t) for t in trees))
    assert merged.n_nodes == len(_token_paths(merged))  # every token path exactly once


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="at least one"):
        merge_trees([])
    with pytest.raises(ValueError, match="root token"):
        merge_trees([_tree([1, 2], [-1, 0]), _tree([3, 2], [-1, 0])])
    with pytest.raises(TypeError, match="DraftTree"):
        merge_trees([_tree([1], [-1]), [1, 2]])
