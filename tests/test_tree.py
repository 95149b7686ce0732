"""DraftTree validation and the quantities derived from the parent array."""

import pytest
import torch

from specviz.tree.core import (
    DraftTree,
    ancestor_mask,
    children_lists,
    depths,
    leaves,
    pad_trees,
    path_to,
    position_ids,
    root_to_leaf_paths,
    tree_attention_mask,
)

# 0 -> {1, 2}, 1 -> {3, 4}, 2 -> {5}
PARENTS = [-1, 0, 0, 1, 1, 2]
TOKENS = [10, 11, 12, 13, 14, 15]


def example() -> DraftTree:
    return DraftTree.from_lists(TOKENS, PARENTS)


@pytest.mark.parametrize(
    "tokens, parents, match",
    [
        ([], [], "at least the root"),
        ([1, 2], [-1], "same length"),
        ([1, 2, 3], [-1, 0], "same length"),
        ([1, 2, 3], [-1, 2, 0], "node 1 has parent 2"),
        ([1, 2], [-1, 1], "node 1 has parent 1"),
        ([1, 2], [0, 0], "must have parent -1"),
        ([1, 2], [-1, -1], "node 1 has parent -1"),
        ([1, -5], [-1, 0], "token ids must be >= 0"),
    ],
)
def test_invalid_trees_are_rejected(tokens, parents, match):
    with pytest.raises(ValueError, match=match):
        DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def test_non_integer_inputs_are_rejected():
    with pytest.raises(TypeError, match="parents must hold integers"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1.0, 0.0]))
    with pytest.raises(ValueError, match="1-D"):
        DraftTree(torch.tensor([[1, 2]]), torch.tensor([[-1, 0]]))


def test_optional_fields_are_checked():
    with pytest.raises(ValueError, match="q must have shape"):
        DraftTree.from_lists(TOKENS, PARENTS, q=[1.0, 0.5])
    with pytest.raises(ValueError, match="ranks must have length"):
        DraftTree.from_lists(TOKENS, PARENTS, ranks=[0, 0])
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        DraftTree.from_lists(TOKENS, PARENTS, draft_probs=torch.zeros(5, 7))


def test_basic_properties():
    tree = example()
    assert tree.n_nodes == 6 and tree.budget == 5 and tree.depth == 2
    assert tree.tokens.dtype == torch.long and tree.parents.dtype == torch.long
    root_only = DraftTree.from_lists([7], [-1])
    assert root_only.budget == 0 and root_only.depth == 0


def test_derived_structure():
    tree = example()
    assert depths(tree).tolist() == [0, 1, 1, 2, 2, 2]
    assert depths(PARENTS).tolist() == [0, 1, 1, 2, 2, 2]
    assert children_lists(tree) == [[1, 2], [3, 4], [5], [], [], []]
    assert leaves(tree) == [3, 4, 5]
    assert root_to_leaf_paths(tree) == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    assert path_to(tree, 5) == [0, 2, 5] and path_to(tree, 0) == [0]
    with pytest.raises(ValueError, match="out of range"):
        path_to(tree, 6)
    assert root_to_leaf_paths([-1]) == [[0]]


def test_ancestor_mask_rows_are_paths():
    tree = example()
    mask = ancestor_mask(tree)
    assert mask.shape == (6, 6) and mask.dtype == torch.bool
    for i in range(6):
        assert torch.nonzero(mask[i]).flatten().tolist() == path_to(tree, i)


def test_positions_and_attention_mask():
    tree = example()
    assert position_ids(tree, 7).tolist() == [7, 8, 8, 9, 9, 9]
    assert position_ids(tree).tolist() == [0, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="prefix_len"):
        position_ids(tree, -1)
    mask = tree_attention_mask(tree, 3)
    assert mask.shape == (6, 9)
    assert mask[:, :3].all()
    assert torch.equal(mask[:, 3:], ancestor_mask(tree))
    assert torch.equal(tree_attention_mask(tree, 0), ancestor_mask(tree))
    with pytest.raises(ValueError, match="prefix_len"):
        tree_attention_mask(tree, -2)


def test_subtree_keeps_order_and_fields():
    tree = DraftTree.from_lists(TOKENS, PARENTS, ranks=[0, 0, 1, 0, 1, 0])
    sub = tree.subtree([0, 2, 5, 1])
    assert sub.tokens.tolist() == [10, 11, 12, 15]
    assert sub.parents.tolist() == [-1, 0, 0, 2]
    assert sub.ranks.tolist() == [0, 0, 1, 0]
    with pytest.raises(ValueError, match="not its parent"):
        tree.subtree([0, 3])
    with pytest.raises(ValueError, match="keep the root"):
        tree.subtree([1, 3])


def test_pad_trees_layout_and_padding_rows():
    big = example()
    small = DraftTree.from_lists([20, 21, 22], [-1, 0, 1])
    batch = pad_trees([big, small], [2, 4], pad_token=99)
    pmax, nmax = 4, 6
    assert batch.tokens.tolist() == [TOKENS, [20, 21, 22, 99, 99, 99]]
    assert batch.position_ids.tolist() == [[2, 3, 3, 4, 4, 4], [4, 5, 6, 6, 6, 6]]
    assert batch.node_valid.tolist() == [[True] * 6, [True] * 3 + [False] * 3]
    assert batch.n_nodes.tolist() == [6, 3] and batch.prefix_lens.tolist() == [2, 4]
    mask = batch.mask
    assert mask.shape == (2, nmax, pmax + nmax)
    # Row 0: its 2 prefix slots, then nothing up to the tree block.
    assert mask[0, :, :2].all() and not mask[0, :, 2:pmax].any()
    assert torch.equal(mask[0, :, pmax:], ancestor_mask(big))
    # Row 1: all 4 prefix slots and its own ancestors for real nodes ...
    assert mask[1, :3, :pmax].all()
    assert torch.equal(mask[1, :3, pmax:pmax + 3], ancestor_mask(small))
    # ... and padding rows see exactly themselves, so softmax stays finite.
    for i in range(3, nmax):
        assert torch.nonzero(mask[1, i]).flatten().tolist() == [pmax + i]
    # No real row looks at a padding column.
    assert not mask[1, :3, pmax + 3:].any()


def test_pad_trees_errors():
    with pytest.raises(ValueError, match="at least one tree"):
        pad_trees([], [])
    with pytest.raises(ValueError, match="prefix lengths"):
        pad_trees([example()], [1, 2])
    with pytest.raises(ValueError, match="prefix_len"):
        pad_trees([example()], [-1])
