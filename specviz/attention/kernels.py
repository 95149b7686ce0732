"""Tree attention in plain PyTorch: a fast path, a reference, and the two baselines.

Verifying a draft tree is one attention call in which the N tree nodes are the
queries and the keys/values are the committed prefix (KV cache) followed by the
same N nodes. Node i may see the whole prefix and exactly its ancestors and
itself; :func:`specviz.tree.tree_attention_mask` and :func:`specviz.tree.pad_trees`
build that mask from the parent array. Each node's position id is the prefix length plus its depth,
so siblings share a position.

* :func:`tree_attention` - one ``scaled_dot_product_attention`` call with the tree mask;
* :func:`tree_attention_reference` - the same maths written out (masked softmax in
  at least fp32), what the tests hold the fast path to;
* :func:`split_tree_attention` - the keys every query sees (the shared prefix) without a
  mask, the rest with the mask, the two partial softmaxes merged by log-sum-exp;
* :func:`per_path_attention` - the naive alternative: one causal attention per
  root-to-leaf path, recomputing shared prefixes;
* :func:`causal_attention` - ordinary causal attention over N new tokens, the cost of
  verifying a chain of the same token count (the timing baseline).

Masks are boolean (True = may attend) or additive float (0 = attend, -inf = blocked).

Dimension legend: B = batch, Hq = query heads, Hkv = key/value heads (Hq % Hkv == 0,
grouped-query attention), N = tree nodes (queries), P = committed prefix length,
S = P + N keys, D = head dimension, P0 = keys every query may see (the shared prefix).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from specviz.tree.shapes import TreeShape
from specviz.tree.core import DraftTree, root_to_leaf_paths
from specviz.validate import check_int

__all__ = [
    "tree_attention",
    "tree_attention_reference",
    "split_tree_attention",
    "per_path_attention",
    "causal_attention",
]


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D (B, H, T, D), got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, hq, n, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(
            f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in batch or head dim"
        )
    if hq % k.shape[1] != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({k.shape[1]})")
    if k.shape[2] < n:
        raise ValueError(f"keys ({k.shape[2]}) must include the {n} query tokens (S = prefix + N)")


def _check_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Validate ``mask`` and return it as ``(B or 1, 1, N, S)`` for broadcasting over heads."""
    b, _, n, _ = q.shape
    s = k.shape[2]
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)  # (B, 1, N, S)
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, b) or mask.shape[2:] != (n, s):
        raise ValueError(
            f"mask must have shape ({b}, {n}, {s}) or ({b}, 1, {n}, {s}), got {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(f"mask must be bool (True = attend) or additive float, got dtype {mask.dtype}")
    return mask


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
                   scale: float | None = None) -> torch.Tensor:
    """Tree attention as one ``scaled_dot_product_attention`` call.

    Args:
        q: ``(B, Hq, N, D)`` queries of the tree nodes.
        k, v: ``(B, Hkv, S, D)`` keys/values, prefix first then the N nodes.
        mask: ``(B, N, S)`` or ``(B, 1, N, S)``; bool (True = may attend) or additive float.
            Every row must allow at least one key (``pad_trees`` padding rows see
            themselves), otherwise that row's output is undefined.
        scale: softmax scale; default ``1 / sqrt(D)``.

    Returns:
        ``(B, Hq, N, D)`` in ``q``'s dtype.
    """
    _check_qkv(q, k, v)
    mask = _check_mask(mask, q, k)
    if mask.dtype != torch.bool:
        mask = mask.to(q.dtype)  # SDPA wants an additive mask in the query's dtype
    # enable_gqa lets SDPA read each K/V head for its whole query group instead of
    # materialising Hq/Hkv copies with repeat_interleave; on this CPU (torch 2.13,
    # Qwen2.5 head layouts, bool and additive masks) it was as fast or faster in every
    # case measured (up to ~1.5x at B=4) and it saves the copy's memory.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def tree_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
                             scale: float | None = None) -> torch.Tensor:
    """Tree attention written out as a masked softmax, computed in at least fp32.

    Same arguments and result as :func:`tree_attention`. A row whose mask allows no
    key comes out NaN here: the reference does not hide an ill-formed mask.
    """
    _check_qkv(q, k, v)
    mask = _check_mask(mask, q, k)
    work = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[1]
    qf = q.to(work)
    kf = k.to(work).repeat_interleave(group, dim=1)  # (B, Hq, S, D)
    vf = v.to(work).repeat_interleave(group, dim=1)  # (B, Hq, S, D)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (qf @ kf.transpose(-2, -1)) * scale  # (B, Hq, N, S)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.to(work)
    weights = torch.softmax(scores, dim=-1)  # (B, Hq, N, S)
    return (weights @ vf).to(q.dtype)  # (B, Hq, N, D)


def split_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         shared_keys: int, *, scale: float | None = None) -> torch.Tensor:
    """Tree attention split at the keys every query sees: :func:`tree_attention`'s result
    from two attention calls merged by log-sum-exp.

    Keys ``[0, shared_keys)`` (the committed prefix when every batch row has the same
    one) are attended without a mask, keys ``[shared_keys, S)`` with ``mask[..., shared_keys:]``;
    each call returns its softmax's log-normaliser, which weighs the two partial outputs.
    Grouped-query attention reads each K/V head once for its whole query group (no copy).

    Args:
        q, k, v, mask, scale: as in :func:`tree_attention`.
        shared_keys: P0, ``0 <= P0 < S``; the mask must allow every query all of these keys.
            0 is :func:`tree_attention` itself.

    Returns:
        ``(B, Hq, N, D)`` in ``q``'s dtype; the merge is computed in fp32.

    Raises:
        ValueError: ``shared_keys`` out of range, or the mask blocks one of the shared keys.
        NotImplementedError: tensors off the CPU (the log-normaliser comes from PyTorch's CPU
            flash-attention kernel).
    """
    _check_qkv(q, k, v)
    mask = _check_mask(mask, q, k)
    s = k.shape[2]
    check_int("shared_keys", shared_keys, 0, s - 1)
    head = mask[..., :shared_keys]  # (B or 1, 1, N, P0)
    if not bool(head.all() if head.dtype == torch.bool else (head == 0).all()):
        raise ValueError(f"the mask blocks some query from one of the first {shared_keys} keys, "
                         "so they cannot be attended without it")
    if shared_keys == 0:
        return tree_attention(q, k, v, mask, scale=scale)
    if q.device.type != "cpu":
        raise NotImplementedError(f"split_tree_attention runs on the CPU only, got tensors on {q.device}")
    tail = mask[..., shared_keys:]  # (B or 1, 1, N, S - P0)
    if tail.dtype == torch.bool:  # the CPU kernel takes only an additive mask in q's dtype
        tail = torch.zeros(tail.shape, dtype=q.dtype, device=q.device).masked_fill_(~tail, float("-inf"))
    # The CPU flash kernel reads grouped K/V heads in place and returns the log-sum-exp of
    # each query's scores in fp32; F.scaled_dot_product_attention does not expose it.
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out_p, lse_p = flash(q, k[:, :, :shared_keys], v[:, :, :shared_keys], scale=scale)  # (B, Hq, N, D), (B, Hq, N)
    out_t, lse_t = flash(q, k[:, :, shared_keys:], v[:, :, shared_keys:], attn_mask=tail.to(q.dtype),
                         scale=scale)
    lse = torch.logaddexp(lse_p, lse_t)  # (B, Hq, N)
    out = out_p.float() * torch.exp(lse_p - lse)[..., None] + out_t.float() * torch.exp(lse_t - lse)[..., None]
    return out.to(q.dtype)  # (B, Hq, N, D)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     scale: float | None = None) -> torch.Tensor:
    """Ordinary causal attention of N new tokens after a prefix of ``S - N`` keys.

    Query i sees every prefix key and new tokens ``0..i``: what verifying a chain of N
    tokens costs, the baseline tree attention is timed against.

    Args:
        q: ``(B, Hq, N, D)``; k, v: ``(B, Hkv, S, D)`` with ``S >= N``.

    Returns:
        ``(B, Hq, N, D)``.
    """
    _check_qkv(q, k, v)
    n, s = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]
    if s == n:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    # SDPA's is_causal aligns the triangle to the top-left corner, which is wrong once a
    # prefix precedes the queries, so the offset triangle is passed as a mask.
    prefix = s - n
    key_pos = torch.arange(s, device=q.device)  # (S,)
    query_pos = prefix + torch.arange(n, device=q.device)  # (N,)
    allowed = key_pos[None, :] <= query_pos[:, None]  # (N, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)


def per_path_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       parents: DraftTree | TreeShape | torch.Tensor | Sequence[int], prefix_len: int, *,
                       scale: float | None = None) -> torch.Tensor:
    """The naive baseline: one causal attention per root-to-leaf path.

    Each path gathers its own queries and keys (prefix + the path's nodes) and runs
    :func:`causal_attention`; nodes on a shared prefix are recomputed by every path
    through them and written once. All batch rows share the one tree.

    Args:
        q: ``(B, Hq, N, D)``; k, v: ``(B, Hkv, prefix_len + N, D)``, tree nodes last.
        parents: the tree (a ``DraftTree``, a ``TreeShape`` or its ``(N,)`` parent array).
        prefix_len: committed prefix length P.

    Returns:
        ``(B, Hq, N, D)``, equal to :func:`tree_attention` with the tree's mask.
    """
    _check_qkv(q, k, v)
    parent_array = parents.parents if isinstance(parents, (DraftTree, TreeShape)) else parents
    n = q.shape[2]
    if len(parent_array) != n:
        raise ValueError(f"the tree has {len(parent_array)} nodes but q has {n} query tokens")
    if prefix_len < 0 or k.shape[2] != prefix_len + n:
        raise ValueError(f"k/v must hold prefix_len + N = {prefix_len} + {n} keys, got {k.shape[2]}")
    out = torch.empty_like(q)  # (B, Hq, N, D); every node lies on some path
    written = [False] * n
    for path in root_to_leaf_paths(parent_array):
        idx = torch.tensor(path, dtype=torch.long, device=q.device)  # (L,)
        kp = torch.cat([k[:, :, :prefix_len], k[:, :, prefix_len + idx]], dim=2)  # (B, Hkv, P + L, D)
        vp = torch.cat([v[:, :, :prefix_len], v[:, :, prefix_len + idx]], dim=2)  # (B, Hkv, P + L, D)
        res = causal_attention(q[:, :, idx], kp, vp, scale=scale)  # (B, Hq, L, D)
        fresh = [j for j, node in enumerate(path) if not written[node]]
        out[:, :, idx[fresh]] = res[:, :, fresh]
        for node in path:
            written[node] = True
    return out
