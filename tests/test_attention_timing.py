"""Tests for specviz.bench.attention: score counts by hand, and tiny timing grids."""

from __future__ import annotations

import pytest
import torch

from specviz.tree.shapes import chain, expansion
from specviz.bench.attention import (
    TIMING_COLUMNS,
    VERIFY_TIMING_COLUMNS,
    AttentionDims,
    attention_work,
    default_timing_shapes,
    per_path_score_counts,
    time_call,
    time_tree_attention,
    time_verify_attention,
)
from specviz.tree.core import DraftTree

# root -> {1, 2}; 1 -> {3}: paths [0, 1, 3] and [0, 2]
PARENTS = [-1, 0, 0, 1]


def test_attention_work_by_hand():
    work = attention_work(PARENTS, prefix_len=2)
    assert (work.n_queries, work.n_keys, work.n_paths) == (4, 6, 2)
    assert work.tree_scores == work.causal_scores == 4 * 6
    # each node sees the 2 prefix keys plus its depth + 1 tree nodes: 3 + 4 + 4 + 5
    assert work.needed_scores == 16
    # paths of 3 and 2 nodes: 3 * (2 + 3) + 2 * (2 + 2)
    assert work.per_path_scores == 23
    assert work.per_path_vs_tree == pytest.approx(23 / 24)


def test_per_path_counts_match_the_work_and_the_mask():
    shape = expansion([2, 2, 1])
    counts = per_path_score_counts(shape, prefix_len=3)
    work = attention_work(shape, 3)
    # each path of L nodes needs L * P prefix scores and L * (L + 1) / 2 causal ones
    lengths = [4, 4, 4, 4]  # expansion [2, 2, 1]: four leaves at depth 3, root included
    assert int(counts.sum()) == sum(n * 3 + n * (n + 1) // 2 for n in lengths)
    assert int((counts > 0).sum()) == work.needed_scores
    assert counts[0, 0] == work.n_paths  # the root row is recomputed by every path
    tree = DraftTree.from_lists(range(len(PARENTS)), PARENTS)
    assert torch.equal(per_path_score_counts(tree, 1), per_path_score_counts(PARENTS, 1))


def test_default_shapes_have_exact_budgets():
    shapes = default_timing_shapes([3, 10])
    assert list(shapes) == ["sequoia-3", "sequoia-10"]
    assert [s.budget for s in shapes.values()] == [3, 10]
    with pytest.raises(ValueError, match="budget"):
        default_timing_shapes([0])
    with pytest.raises(ValueError, match="empty"):
        default_timing_shapes([])


def test_time_call_counts_calls():
    calls = []
    timing = time_call(lambda: calls.append(1), warmup=2, repeats=3, min_time_s=0.0)
    assert timing.repeats == 3 and timing.number == 1
    assert len(calls) == 2 + 3
    assert 0 <= timing.min_s <= timing.median_s
    with pytest.raises(ValueError, match="repeats"):
        time_call(lambda: None, repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        time_call(lambda: None, warmup=-1)


def test_time_tree_attention_small_grid():
    rows = []
    table = time_tree_attention({"chain": chain(3), "tree": expansion([2, 2])}, batch_sizes=[1, 2],
                                prefix_lens=[0, 5], dims=AttentionDims(4, 2, 8), warmup=0, repeats=1,
                                min_time_s=0.0, on_row=rows.append)
    assert list(table.columns) == list(TIMING_COLUMNS)
    assert len(table) == len(rows) == 2 * 2 * 2
    assert (table["max_abs_diff"] < 1e-5).all()
    assert (table[["tree_ms", "per_path_ms", "causal_ms"]] > 0).all().all()
    assert table["tree_vs_causal"].tolist() == pytest.approx((table["tree_ms"] / table["causal_ms"]).tolist())
    tree_rows = table[table["shape"] == "tree"]
    assert set(tree_rows["n_leaves"]) == {4} and set(tree_rows["n_keys"]) == {7, 12}


def test_time_tree_attention_bf16_and_list_of_shapes():
    table = time_tree_attention([expansion([2])], dims=AttentionDims(2, 1, 8), dtype="bf16", prefix_lens=[4],
                                warmup=0, repeats=1, min_time_s=0.0)
    assert table["shape"].tolist() == ["shape-0"] and table["dtype"].tolist() == ["bfloat16"]


def test_time_tree_attention_rejects_bad_inputs():
    with pytest.raises(ValueError, match="no draft nodes"):
        time_tree_attention([chain(0)])
    with pytest.raises(ValueError, match="batch_sizes"):
        time_tree_attention([chain(2)], batch_sizes=[0])
    with pytest.raises(TypeError, match="TreeShape"):
        time_tree_attention({"x": [-1, 0]})
    with pytest.raises(ValueError, match="multiple"):
        AttentionDims(3, 2, 8)
    with pytest.raises(ValueError, match="dtype"):
        time_tree_attention([chain(2)], dtype="w8a8-token")


def test_time_verify_attention_small_grid():
    rows = []
    table = time_verify_attention({"tree": expansion([2, 2])}, batch_sizes=[1, 2], prefix_lens=[3, 9],
                                  dims=AttentionDims(6, 2, 8), warmup=0, repeats=1, min_time_s=0.0,
                                  on_row=rows.append)
    assert list(table.columns) == list(VERIFY_TIMING_COLUMNS)
    assert len(table) == len(rows) == 4
    assert table["specviz_bitwise"].all()
    assert (table["split_max_abs_diff"] < 1e-5).all()
    assert (table[["sdpa_ms", "specviz_ms", "split_ms"]] > 0).all().all()
    assert table["split_vs_specviz"].tolist() == pytest.approx((table["split_ms"] / table["specviz_ms"]).tolist())
    with pytest.raises(ValueError, match="every entry of prefix_lens must be an int >= 1, got 0"):
        time_verify_attention([chain(2)], prefix_lens=[0])
