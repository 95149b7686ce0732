"""Tree attention: fast path, reference, prefix/tree split and per-path baseline agree; padding never leaks."""

import pytest
import torch

from specviz.attention.kernels import (
    causal_attention,
    per_path_attention,
    split_tree_attention,
    tree_attention,
    tree_attention_reference,
)
from specviz.tree.shapes import chain, expansion, from_paths
from specviz.tree.core import DraftTree, pad_trees, tree_attention_mask

TOL = dict(atol=1e-5, rtol=1e-5)


def random_tree(n_nodes: int, g: torch.Generator) -> DraftTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n_nodes)]
    return DraftTree.from_lists(list(range(n_nodes)), parents)


def qkv(b, hq, hkv, n, s, d, g, dtype=torch.float32):
    q = torch.randn(b, hq, n, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, s, d, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("hq, hkv, d", [(4, 4, 16), (6, 2, 8), (4, 1, 32)])
def test_single_tree_all_three_agree(hq, hkv, d):
    g = torch.Generator().manual_seed(hq * 100 + hkv)
    for n, prefix in [(1, 3), (7, 0), (12, 5), (20, 9)]:
        tree = random_tree(n, g)
        q, k, v = qkv(2, hq, hkv, n, prefix + n, d, g)
        mask = tree_attention_mask(tree, prefix).expand(2, n, prefix + n)  # (B, N, S)
        fast = tree_attention(q, k, v, mask)
        ref = tree_attention_reference(q, k, v, mask)
        naive = per_path_attention(q, k, v, tree, prefix)
        assert fast.shape == (2, hq, n, d)
        torch.testing.assert_close(fast, ref, **TOL)
        torch.testing.assert_close(naive, ref, **TOL)


def test_batch_of_different_trees_via_pad_trees():
    g = torch.Generator().manual_seed(1)
    trees = [random_tree(n, g) for n in (9, 4, 1, 13)]
    prefix_lens = [5, 0, 7, 2]
    batch = pad_trees(trees, prefix_lens)
    b, nmax = batch.tokens.shape
    pmax = max(prefix_lens)
    q, k, v = qkv(b, 6, 3, nmax, pmax + nmax, 16, g)
    fast = tree_attention(q, k, v, batch.mask)
    ref = tree_attention_reference(q, k, v, batch.mask)
    assert torch.isfinite(fast).all()  # padding rows see themselves: no NaN anywhere
    torch.testing.assert_close(fast, ref, **TOL)
    for r, (tree, p) in enumerate(zip(trees, prefix_lens)):
        n = tree.n_nodes
        keys = torch.cat([torch.arange(p), pmax + torch.arange(n)])  # this row's real key slots
        naive = per_path_attention(q[r:r + 1, :, :n], k[r:r + 1, :, keys], v[r:r + 1, :, keys], tree, p)
        torch.testing.assert_close(fast[r:r + 1, :, :n], naive, **TOL)


def test_padding_never_leaks_into_real_rows():
    g = torch.Generator().manual_seed(2)
    trees = [random_tree(10, g), random_tree(3, g)]
    prefix_lens = [4, 1]
    batch = pad_trees(trees, prefix_lens)
    pmax, nmax = 4, 10
    q, k, v = qkv(2, 4, 2, nmax, pmax + nmax, 8, g)
    # Rewrite everything row 1 must not see: unused prefix slots and padding node slots.
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    pad_keys = torch.cat([torch.arange(1, pmax), pmax + torch.arange(3, nmax)])
    k2[1][:, pad_keys] = 1e3 * torch.randn(2, len(pad_keys), 8, generator=g)
    v2[1][:, pad_keys] = 1e3 * torch.randn(2, len(pad_keys), 8, generator=g)
    q2[1][:, 3:] = 1e3 * torch.randn(4, nmax - 3, 8, generator=g)
    for fn in (tree_attention, tree_attention_reference):
        before = fn(q, k, v, batch.mask)
        after = fn(q2, k2, v2, batch.mask)
        assert torch.isfinite(after).all()
        # Masked keys get weight exactly 0, so real rows do not change at all.
        torch.testing.assert_close(after[1, :, :3], before[1, :, :3], atol=0, rtol=0)
        torch.testing.assert_close(after[0], before[0], atol=0, rtol=0)


@pytest.mark.parametrize("prefix", [0, 6])
def test_chain_shaped_tree_is_causal_attention(prefix):
    g = torch.Generator().manual_seed(3)
    shape = chain(7)
    n = shape.n_nodes
    q, k, v = qkv(2, 4, 2, n, prefix + n, 16, g)
    mask = tree_attention_mask(shape.parents_tensor(), prefix).unsqueeze(0).expand(2, n, prefix + n)
    causal = causal_attention(q, k, v)
    torch.testing.assert_close(tree_attention(q, k, v, mask), causal, **TOL)
    torch.testing.assert_close(tree_attention_reference(q, k, v, mask), causal, **TOL)
    torch.testing.assert_close(per_path_attention(q, k, v, shape, prefix), causal, **TOL)


def test_additive_and_boolean_masks_agree():
    g = torch.Generator().manual_seed(4)
    shape = expansion([3, 2, 1])
    n, prefix = shape.n_nodes, 5
    q, k, v = qkv(1, 4, 4, n, prefix + n, 8, g)
    mask = tree_attention_mask(shape.parents_tensor(), prefix).unsqueeze(0)  # (1, N, S)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    for fn in (tree_attention, tree_attention_reference):
        torch.testing.assert_close(fn(q, k, v, additive), fn(q, k, v, mask), **TOL)
        torch.testing.assert_close(fn(q, k, v, mask.unsqueeze(1)), fn(q, k, v, mask), atol=0, rtol=0)


def test_custom_scale_and_bf16():
    g = torch.Generator().manual_seed(5)
    shape = from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    n, prefix = shape.n_nodes, 4
    q, k, v = qkv(1, 4, 2, n, prefix + n, 16, g)
    mask = tree_attention_mask(shape.parents_tensor(), prefix).unsqueeze(0)
    ref = tree_attention_reference(q, k, v, mask, scale=0.3)
    torch.testing.assert_close(tree_attention(q, k, v, mask, scale=0.3), ref, **TOL)
    torch.testing.assert_close(per_path_attention(q, k, v, shape, prefix, scale=0.3), ref, **TOL)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    fast_bf16 = tree_attention(qb, kb, vb, mask)
    assert fast_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(fast_bf16.float(), tree_attention_reference(qb, kb, vb, mask).float(),
                               atol=3e-2, rtol=3e-2)


def test_input_errors():
    g = torch.Generator().manual_seed(6)
    q, k, v = qkv(1, 4, 2, 3, 5, 8, g)
    mask = torch.ones(1, 3, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="mask must have shape"):
        tree_attention(q, k, v, torch.ones(1, 3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be bool"):
        tree_attention(q, k, v, mask.long())
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        tree_attention(q[:, :3], k, v, mask)
    with pytest.raises(ValueError, match="4-D"):
        tree_attention(q[0], k, v, mask)
    with pytest.raises(ValueError, match="same shape"):
        causal_attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="must include the 3 query tokens"):
        causal_attention(q, k[:, :, :2], v[:, :, :2])
    with pytest.raises(ValueError, match="tree has 2 nodes"):
        per_path_attention(q, k, v, [-1, 0], 2)
    with pytest.raises(ValueError, match="prefix_len \\+ N"):
        per_path_attention(q, k, v, [-1, 0, 0], 1)


@pytest.mark.parametrize("hq, hkv, d", [(4, 4, 16), (6, 2, 8), (12, 2, 128)])
def test_split_at_the_shared_prefix_equals_the_reference(hq, hkv, d):
    g = torch.Generator().manual_seed(7 + hq)
    for n, prefix in [(1, 3), (12, 5), (20, 40)]:
        tree = random_tree(n, g)
        q, k, v = qkv(2, hq, hkv, n, prefix + n, d, g)
        mask = tree_attention_mask(tree, prefix).expand(2, n, prefix + n)  # (B, N, S)
        additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        ref = tree_attention_reference(q, k, v, mask)
        for shared in {0, 1, prefix}:
            torch.testing.assert_close(split_tree_attention(q, k, v, mask, shared), ref, **TOL)
            torch.testing.assert_close(split_tree_attention(q, k, v, additive, shared), ref, **TOL)
        assert torch.equal(split_tree_attention(q, k, v, mask, 0), tree_attention(q, k, v, mask))


def test_split_of_padded_batch_and_bf16():
    g = torch.Generator().manual_seed(8)
    trees = [random_tree(9, g) for _ in range(2)]  # no padding query (those see only themselves)
    batch = pad_trees(trees, [6, 3])  # rows share the first 3 slots
    b, nmax = batch.tokens.shape
    q, k, v = qkv(b, 6, 2, nmax, 6 + nmax, 16, g)
    ref = tree_attention_reference(q, k, v, batch.mask)
    torch.testing.assert_close(split_tree_attention(q, k, v, batch.mask, 3, scale=0.2),
                               tree_attention_reference(q, k, v, batch.mask, scale=0.2), **TOL)
    torch.testing.assert_close(split_tree_attention(q, k, v, batch.mask, 3), ref, **TOL)
    with pytest.raises(ValueError, match="blocks some query from one of the first 4 keys"):
        split_tree_attention(q, k, v, batch.mask, 4)
    with pytest.raises(ValueError, match="shared_keys must be an int in \\[0, 14\\], got 15"):
        split_tree_attention(q, k, v, batch.mask, 15)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = split_tree_attention(qb, kb, vb, batch.mask, 3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), tree_attention_reference(qb, kb, vb, batch.mask).float(),
                               atol=3e-2, rtol=3e-2)
