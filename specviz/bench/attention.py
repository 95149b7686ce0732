"""How long tree attention takes: a microbenchmark of the attention step alone.

Verifying a draft tree costs one attention call per layer in which the tree's N
nodes are the queries and the committed prefix plus the tree are the keys. This
module times the three ways :mod:`specviz.attention` offers to compute it, on random
tensors with a real model's head layout:

* ``tree`` - :func:`~specviz.attention.tree_attention`, one SDPA call with the tree mask;
* ``per_path`` - :func:`~specviz.attention.per_path_attention`, one causal call per
  root-to-leaf path (the naive method: shared prefixes are recomputed per path);
* ``causal`` - :func:`~specviz.attention.causal_attention` over the same N tokens, the
  cost of verifying a chain of that length (the floor tree attention is held to).

:func:`time_tree_attention` sweeps batch size, prefix length and tree shape and returns
a tidy table with the ratios. :func:`attention_work` counts the query-key scores each
method computes, the arithmetic behind the timings: SDPA with a mask computes every
one of the ``N x (P + N)`` scores and throws the masked ones away, per-path attention
computes ``L x (P + L)`` for every path of L nodes, so the prefix is paid once per leaf.

:func:`time_verify_attention` times the attention call of one model layer during
verification the three ways :func:`specviz.models.forward_tokens` can run it
(:data:`specviz.attention.ATTENTION_CHOICES`): transformers' ``sdpa`` with the 4D mask,
specviz's masked tree attention, and the prefix/tree split.

Dimension legend: B = batch, Hq = query heads, Hkv = key/value heads, D = head dimension,
N = tree nodes including the root (the queries), P = committed prefix length,
S = P + N keys, L = nodes on one root-to-leaf path.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Mapping, Sequence

import pandas as pd
import torch

from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specviz.attention.hf import specviz_attention_forward
from specviz.attention.kernels import causal_attention, per_path_attention, tree_attention
from specviz.quant.weights import float_dtype
from specviz.sampling import make_generator
from specviz.tree.sequoia import sequoia_tree
from specviz.tree.shapes import TreeShape
from specviz.tree.core import DraftTree, leaves, root_to_leaf_paths, tree_attention_mask
from specviz.validate import check_int, check_ints

__all__ = [
    "AttentionDims",
    "QWEN25_1_5B",
    "QWEN25_0_5B",
    "TYPICAL_ACCEPTANCE",
    "CallTiming",
    "AttentionWork",
    "default_timing_shapes",
    "attention_work",
    "per_path_score_counts",
    "time_call",
    "time_tree_attention",
    "TIMING_COLUMNS",
    "time_verify_attention",
    "VERIFY_TIMING_COLUMNS",
]


@dataclass(frozen=True)
class AttentionDims:
    """Head layout of one attention layer.

    Attributes:
        n_q_heads: query heads Hq.
        n_kv_heads: key/value heads Hkv (grouped-query attention; Hq % Hkv == 0).
        head_dim: D.
    """

    n_q_heads: int = 12
    n_kv_heads: int = 2
    head_dim: int = 128

    def __post_init__(self) -> None:
        for name in ("n_q_heads", "n_kv_heads", "head_dim"):
            check_int(name, getattr(self, name))
        if self.n_q_heads % self.n_kv_heads:
            raise ValueError(
                f"n_q_heads ({self.n_q_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )


#: Qwen2.5(-Coder)-1.5B, the built-in target: 12 query heads, 2 KV heads, head dim 128.
QWEN25_1_5B = AttentionDims(12, 2, 128)
#: Qwen2.5(-Coder)-0.5B, the built-in draft: 14 query heads, 2 KV heads, head dim 64.
QWEN25_0_5B = AttentionDims(14, 2, 64)

#: A positional acceptance vector of the order a 0.5B draft reaches for a 1.5B target
#: (chance that the k-th ranked child is the accepted one); it only decides which tree
#: shapes :func:`default_timing_shapes` returns.
TYPICAL_ACCEPTANCE: tuple[float, ...] = (0.6, 0.15, 0.06, 0.03)


def default_timing_shapes(budgets: Sequence[int] = (8, 16, 32, 64), *,
                          acceptance: Sequence[float] = TYPICAL_ACCEPTANCE,
                          max_depth: int = 8) -> dict[str, TreeShape]:
    """Realistic trees of exactly the given budgets: Sequoia-optimal for ``acceptance``.

    Args:
        budgets: draft nodes per tree (root excluded), each >= 1.
        acceptance: positional acceptance vector (see :func:`specviz.tree.sequoia.sequoia_tree`).
        max_depth: depth limit of the trees.

    Returns:
        ``{"sequoia-<budget>": shape}`` in the order of ``budgets``.
    """
    return {f"sequoia-{n}": sequoia_tree(acceptance, n, max_depth).shape for n in check_ints("budgets", budgets)}


@dataclass(frozen=True)
class AttentionWork:
    """Query-key scores each method computes for one tree and prefix (per batch row and head).

    Attributes:
        n_queries: N, tree nodes including the root.
        n_keys: S = P + N.
        n_paths: root-to-leaf paths (leaves).
        tree_scores: ``N * S``; SDPA computes every score, masked or not.
        needed_scores: scores the tree mask allows (what a sparse kernel would compute).
        per_path_scores: ``sum over paths of L * (P + L)``; the naive method's work.
        causal_scores: ``N * S``; the chain of the same token count.
    """

    n_queries: int
    n_keys: int
    n_paths: int
    tree_scores: int
    needed_scores: int
    per_path_scores: int
    causal_scores: int

    @property
    def per_path_vs_tree(self) -> float:
        """How many times more scores per-path attention computes than tree attention."""
        return self.per_path_scores / self.tree_scores


def _parents(shape: TreeShape | DraftTree | Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(shape, TreeShape):
        return list(shape.parents)
    if isinstance(shape, DraftTree):
        return shape.parents.tolist()
    if isinstance(shape, torch.Tensor):
        return [int(p) for p in shape.tolist()]
    return [int(p) for p in shape]


def attention_work(shape: TreeShape | DraftTree | Sequence[int] | torch.Tensor, prefix_len: int) -> AttentionWork:
    """Count the scores each method computes for ``shape`` after ``prefix_len`` tokens."""
    check_int("prefix_len", prefix_len, 0)
    parents = _parents(shape)
    paths = root_to_leaf_paths(parents)
    n = len(parents)
    s = prefix_len + n
    needed = int(tree_attention_mask(parents, prefix_len).sum())
    per_path = sum(len(p) * (prefix_len + len(p)) for p in paths)
    return AttentionWork(n_queries=n, n_keys=s, n_paths=len(paths), tree_scores=n * s,
                         needed_scores=needed, per_path_scores=per_path, causal_scores=n * s)


def per_path_score_counts(shape: TreeShape | DraftTree | Sequence[int] | torch.Tensor, prefix_len: int) -> torch.Tensor:
    """How many times per-path attention computes each (query node, key) score the tree
    mask allows.

    Every root-to-leaf path through a node recomputes that node's row. (Each path's
    causal call also computes, and discards, the upper triangle of its own ``L x (P + L)``
    grid; :attr:`AttentionWork.per_path_scores` counts those too.)

    Returns:
        ``(N, P + N)`` long: 0 where the tree mask blocks the pair, otherwise the
        number of root-to-leaf paths through the query node.
    """
    check_int("prefix_len", prefix_len, 0)
    parents = _parents(shape)
    n = len(parents)
    counts = torch.zeros(n, prefix_len + n, dtype=torch.long)  # (N, P + N)
    for path in root_to_leaf_paths(parents):
        for j, node in enumerate(path):
            counts[node, :prefix_len] += 1
            counts[node, [prefix_len + a for a in path[: j + 1]]] += 1
    return counts


@dataclass(frozen=True)
class CallTiming:
    """Wall time of one call, from :func:`time_call`.

    Attributes:
        median_s: median over the repeats of the mean time per call, seconds.
        min_s: the fastest repeat's mean time per call, seconds.
        repeats: timed repeats.
        number: calls per repeat (chosen so that a repeat lasts at least ``min_time_s``).
    """

    median_s: float
    min_s: float
    repeats: int
    number: int


def time_call(fn: Callable[[], object], *, warmup: int = 2, repeats: int = 5,
              min_time_s: float = 0.002) -> CallTiming:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeats`` timed repeats of
    ``number`` calls each, ``number`` grown until one repeat takes ``min_time_s``
    (so microsecond calls are not lost in the timer's resolution).

    Raises:
        ValueError: on ``warmup < 0``, ``repeats < 1`` or a negative ``min_time_s``.
    """
    check_int("warmup", warmup, 0)
    check_int("repeats", repeats)
    if not min_time_s >= 0:
        raise ValueError(f"min_time_s must be >= 0 seconds, got {min_time_s}")
    for _ in range(warmup):
        fn()
    number = 1
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time_s or number >= 1 << 20:
            break
        number *= 2 if elapsed <= 0 else max(2, min(10, int(1.2 * min_time_s / elapsed) + 1))
    per_call = [elapsed / number]
    for _ in range(repeats - 1):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        per_call.append((time.perf_counter() - start) / number)
    return CallTiming(statistics.median(per_call), min(per_call), repeats, number)


#: Columns of :func:`time_tree_attention`'s table, in order.
TIMING_COLUMNS: tuple[str, ...] = (
    "shape", "budget", "n_nodes", "depth", "n_leaves", "batch_size", "prefix_len", "n_keys",
    "n_q_heads", "n_kv_heads", "head_dim", "dtype", "threads", "repeats",
    "tree_ms", "per_path_ms", "causal_ms", "tree_min_ms", "per_path_min_ms", "causal_min_ms",
    "tree_vs_causal", "per_path_vs_tree",
    "per_path_vs_tree_scores", "max_abs_diff",
)


def _named_shapes(shapes: Mapping[str, TreeShape] | Sequence[TreeShape]) -> list[tuple[str, TreeShape]]:
    items = list(shapes.items()) if isinstance(shapes, Mapping) else [
        (f"shape-{i}", s) for i, s in enumerate(shapes)]
    if not items:
        raise ValueError("shapes must not be empty")
    for name, shape in items:
        if not isinstance(shape, TreeShape):
            raise TypeError(f"shape {name!r} must be a TreeShape, got {type(shape).__name__}")
        if shape.budget < 1:
            raise ValueError(f"shape {name!r} has no draft nodes; time trees with budget >= 1")
    return items


def time_tree_attention(
    shapes: Mapping[str, TreeShape] | Sequence[TreeShape],
    *,
    batch_sizes: Sequence[int] = (1,),
    prefix_lens: Sequence[int] = (128,),
    dims: AttentionDims = QWEN25_1_5B,
    dtype: torch.dtype | str = torch.float32,
    warmup: int = 2,
    repeats: int = 5,
    min_time_s: float = 0.002,
    seed: int = 0,
    on_row: Callable[[dict], None] | None = None,
) -> pd.DataFrame:
    """Time tree, per-path and causal attention over a grid of batch sizes, prefix
    lengths and tree shapes (one attention layer, random inputs, this machine's threads).

    Args:
        shapes: the trees, by name (e.g. :func:`default_timing_shapes`) or as a list.
        batch_sizes: B values; every row of a batch verifies its own copy of the tree.
        prefix_lens: committed prefix lengths P (KV cache before the root).
        dims: head layout (default: the built-in 1.5B target).
        dtype: float32, bfloat16 or float16 (or their short names).
        warmup, repeats, min_time_s: as in :func:`time_call`.
        seed: seed of the random q, k, v.
        on_row: called with each finished row (a dict of :data:`TIMING_COLUMNS`), e.g.
            to report progress.

    Returns:
        One row per (shape, batch size, prefix length), columns :data:`TIMING_COLUMNS`:
        ``*_ms`` are median milliseconds per call and ``*_min_ms`` the fastest repeat's
        (on a busy machine the minimum is the steadier estimate of what a call costs,
        the median what a run experiences); ``tree_vs_causal`` = tree_ms /
        causal_ms (the price of the tree mask over a chain of the same token count);
        ``per_path_vs_tree`` = per_path_ms / tree_ms (how much the naive method loses);
        ``per_path_vs_tree_scores`` is the same ratio predicted by score counts
        (:func:`attention_work`); ``max_abs_diff`` compares tree with per-path output.
    """
    items = _named_shapes(shapes)
    batch_sizes = check_ints("batch_sizes", batch_sizes, 1)
    prefix_lens = check_ints("prefix_lens", prefix_lens, 0)
    if not isinstance(dims, AttentionDims):
        raise TypeError(f"dims must be an AttentionDims, got {type(dims).__name__}")
    dt = float_dtype(dtype)
    gen = make_generator(seed)
    timing = dict(warmup=warmup, repeats=repeats, min_time_s=min_time_s)
    rows = []
    with torch.inference_mode():
        for name, shape in items:
            for b in batch_sizes:
                for p in prefix_lens:
                    row = _tree_timing_row(name, shape, b, p, dims, dt, gen, timing)
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
    return pd.DataFrame(rows, columns=list(TIMING_COLUMNS))


def _tree_timing_row(name: str, shape: TreeShape, b: int, p: int, dims: AttentionDims, dt: torch.dtype,
                     gen: torch.Generator, timing: Mapping[str, float]) -> dict:
    """One row of :func:`time_tree_attention`: ``shape`` over ``b`` rows with ``p`` prefix keys,
    on q, k, v drawn from ``gen``; ``timing`` holds :func:`time_call`'s settings."""
    hq, hkv, d = dims.n_q_heads, dims.n_kv_heads, dims.head_dim
    n = shape.n_nodes
    s = p + n
    q = torch.randn(b, hq, n, d, generator=gen).to(dt)  # (B, Hq, N, D)
    k = torch.randn(b, hkv, s, d, generator=gen).to(dt)  # (B, Hkv, S, D)
    v = torch.randn(b, hkv, s, d, generator=gen).to(dt)  # (B, Hkv, S, D)
    mask = tree_attention_mask(shape.parents, p).expand(b, n, s).contiguous()  # (B, N, S)
    tree_out = tree_attention(q, k, v, mask)
    path_out = per_path_attention(q, k, v, shape, p)
    diff = float((tree_out.float() - path_out.float()).abs().max())
    t_tree = time_call(lambda: tree_attention(q, k, v, mask), **timing)
    t_path = time_call(lambda: per_path_attention(q, k, v, shape, p), **timing)
    t_causal = time_call(lambda: causal_attention(q, k, v), **timing)
    work = attention_work(shape, p)
    return {
        "shape": name, "budget": shape.budget, "n_nodes": n, "depth": shape.depth,
        "n_leaves": len(leaves(shape.parents)), "batch_size": b, "prefix_len": p,
        "n_keys": s, "n_q_heads": hq, "n_kv_heads": hkv, "head_dim": d,
        "dtype": str(dt).removeprefix("torch."), "threads": torch.get_num_threads(),
        "repeats": timing["repeats"],
        "tree_ms": 1e3 * t_tree.median_s, "per_path_ms": 1e3 * t_path.median_s,
        "causal_ms": 1e3 * t_causal.median_s,
        "tree_min_ms": 1e3 * t_tree.min_s, "per_path_min_ms": 1e3 * t_path.min_s,
        "causal_min_ms": 1e3 * t_causal.min_s,
        "tree_vs_causal": t_tree.median_s / t_causal.median_s,
        "per_path_vs_tree": t_path.median_s / t_tree.median_s,
        "per_path_vs_tree_scores": work.per_path_vs_tree,
        "max_abs_diff": diff,
    }


#: Columns of :func:`time_verify_attention`'s table, in order.
VERIFY_TIMING_COLUMNS: tuple[str, ...] = (
    "shape", "budget", "n_nodes", "batch_size", "prefix_len", "n_keys", "n_q_heads", "n_kv_heads", "head_dim",
    "dtype", "threads", "repeats",
    "sdpa_ms", "specviz_ms", "split_ms", "sdpa_min_ms", "specviz_min_ms", "split_min_ms",
    "specviz_vs_sdpa", "split_vs_specviz", "specviz_bitwise", "split_max_abs_diff",
)


def time_verify_attention(
    shapes: Mapping[str, TreeShape] | Sequence[TreeShape],
    *,
    batch_sizes: Sequence[int] = (1,),
    prefix_lens: Sequence[int] = (128,),
    dims: AttentionDims = QWEN25_1_5B,
    dtype: torch.dtype | str = torch.float32,
    warmup: int = 2,
    repeats: int = 5,
    min_time_s: float = 0.002,
    seed: int = 0,
    on_row: Callable[[dict], None] | None = None,
) -> pd.DataFrame:
    """Time one layer's attention call of a verification forward, as a transformers model
    makes it, with each of :data:`specviz.attention.ATTENTION_CHOICES`.

    Every batch row holds the same prefix of P slots followed by its copy of the tree;
    the mask is the additive ``(B, 1, N, P + N)`` mask :func:`specviz.models.forward_tokens`
    passes. ``sdpa`` is transformers' ``sdpa_attention_forward`` (which copies K/V per
    query head when a mask is given), ``specviz`` and ``split`` are
    :func:`specviz.attention.specviz_attention_forward` without and with the P shared keys.

    Args:
        as in :func:`time_tree_attention`.

    Returns:
        One row per (shape, batch size, prefix length), columns :data:`VERIFY_TIMING_COLUMNS`:
        ``*_ms`` median and ``*_min_ms`` fastest-repeat milliseconds per call;
        ``specviz_vs_sdpa`` = specviz_ms / sdpa_ms and ``split_vs_specviz`` = split_ms /
        specviz_ms (below 1 = faster); ``specviz_bitwise`` whether the specviz output equals
        sdpa's bit for bit; ``split_max_abs_diff`` the split's largest deviation from sdpa.
    """
    items = _named_shapes(shapes)
    batch_sizes = check_ints("batch_sizes", batch_sizes, 1)
    prefix_lens = check_ints("prefix_lens", prefix_lens, 1)
    if not isinstance(dims, AttentionDims):
        raise TypeError(f"dims must be an AttentionDims, got {type(dims).__name__}")
    dt = float_dtype(dtype)
    gen = make_generator(seed)
    hq, hkv, d = dims.n_q_heads, dims.n_kv_heads, dims.head_dim
    layer = SimpleNamespace(num_key_value_groups=hq // hkv, is_causal=True)  # what sdpa reads of the module
    scale = d ** -0.5
    rows = []
    with torch.inference_mode():
        for name, shape in items:
            n = shape.n_nodes
            for b in batch_sizes:
                for p in prefix_lens:
                    s = p + n
                    q = torch.randn(b, hq, n, d, generator=gen).to(dt)  # (B, Hq, N, D)
                    k = torch.randn(b, hkv, s, d, generator=gen).to(dt)  # (B, Hkv, S, D)
                    v = torch.randn(b, hkv, s, d, generator=gen).to(dt)  # (B, Hkv, S, D)
                    allowed = tree_attention_mask(shape.parents, p).expand(b, 1, n, s)  # (B, 1, N, S)
                    mask = torch.zeros(allowed.shape, dtype=dt).masked_fill_(~allowed, torch.finfo(dt).min)
                    calls = {
                        "sdpa": lambda: sdpa_attention_forward(layer, q, k, v, mask, scaling=scale),
                        "specviz": lambda: specviz_attention_forward(layer, q, k, v, mask, scaling=scale),
                        "split": lambda: specviz_attention_forward(layer, q, k, v, mask, scaling=scale,
                                                                   specviz_shared_keys=p),
                    }
                    outs = {key: fn()[0] for key, fn in calls.items()}  # (B, N, Hq, D) each
                    t = {key: time_call(fn, warmup=warmup, repeats=repeats, min_time_s=min_time_s)
                         for key, fn in calls.items()}
                    row = {
                        "shape": name, "budget": shape.budget, "n_nodes": n, "batch_size": b, "prefix_len": p,
                        "n_keys": s, "n_q_heads": hq, "n_kv_heads": hkv, "head_dim": d,
                        "dtype": str(dt).removeprefix("torch."), "threads": torch.get_num_threads(),
                        "repeats": repeats,
                        **{f"{key}_ms": 1e3 * t[key].median_s for key in calls},
                        **{f"{key}_min_ms": 1e3 * t[key].min_s for key in calls},
                        "specviz_vs_sdpa": t["specviz"].median_s / t["sdpa"].median_s,
                        "split_vs_specviz": t["split"].median_s / t["specviz"].median_s,
                        "specviz_bitwise": bool(torch.equal(outs["specviz"], outs["sdpa"])),
                        "split_max_abs_diff": float((outs["split"].float() - outs["sdpa"].float()).abs().max()),
                    }
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
    return pd.DataFrame(rows, columns=list(VERIFY_TIMING_COLUMNS))
