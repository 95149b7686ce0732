"""Tree attention in plain PyTorch: a fast path, a reference, and the two baselines.

Verifying a draft tree is one attention call in which the N tree nodes are the
queries and the keys/values are the committed prefix (KV cache) followed by the
same N nodes. Node i may see the whole prefix and exactly its ancestors and
itself; :func:`specviz.tree.tree_attention_mask` and :func:`specviz.tree.pad_trees`
build that mask from the parent array (SPECDEC.md section 4).

* :func:`tree_attention` - one ``scaled_dot_product_attention`` call with the tree mask;
* :func:`tree_attention_reference` - the same maths written out (masked softmax in
  at least fp32), what the tests hold the fast path to;
* :func:`per_path_attention` - the naive alternative: one causal attention per
  root-to-leaf path, recomputing shared prefixes;
* :func:`causal_attention` - ordinary causal attention over N new tokens, the cost of
  verifying a chain of the same token count (the timing baseline).

Masks are boolean (True = may attend) or additive float (0 = attend, -inf = blocked).

Dimension legend: B = batch, Hq = query heads, Hkv = key/value heads (Hq % Hkv == 0,
grouped-query attention), N = tree nodes (queries), P = committed prefix length,
S = P + N keys, D = head dimension.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from specviz.tree.shapes import TreeShape
from specviz.tree.core import DraftTree, root_to_leaf_paths

__all__ = ["tree_attention", "tree_attention_reference", "per_path_attention", "causal_attention"]


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
