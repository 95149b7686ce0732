"""A KV cache layer's keys and values written in place into spare room behind them, instead
of transformers' concatenation on every forward.

Used by :func:`specviz.models.kvcache.forward_tokens` (through :func:`append_kv`) and by the
fused layers (:mod:`specviz.models.fused`, through :func:`reserve_slots`), which write their
new keys and values themselves.

Dimension legend: B = rows, H = key/value heads, S = cache slots, D = head size.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

__all__ = ["APPEND_SLACK", "APPEND_FROM", "reserve_slots", "append_kv"]


#: spare slots a cache layer's buffer gets beyond what it holds when it grows: a share of
#: its length, and at least this many
APPEND_SLACK = 64



#: a layer shorter than this many slots concatenates as transformers does (a copy of a few
#: hundred slots costs less than the buffer's checks and views: 6 against 10 microseconds at
#: 200 slots of the built-in draft); from this length on it appends into a buffer
APPEND_FROM = 256



def _room(layer, name: str, n: int, like: torch.Tensor, rows_heads: tuple[int, int]) -> tuple[torch.Tensor, int]:
    """``layer``'s buffer for ``name`` with room for ``n`` slots behind the ``held`` it holds,
    and ``held``: the buffer it has where the current tensor is that buffer's leading slots
    (or holds nothing) and the new slots fit, else a new one with room for
    ``max(APPEND_SLACK, total / 2)`` more slots, the held slots copied into it. ``like``
    gives the dtype, device and head size, ``rows_heads`` the buffer's first two dimensions."""
    old = getattr(layer, name)  # (B, H, S, D), or an empty tensor
    buffers = layer.__dict__.get("_specviz_buffers")
    if buffers is None:
        buffers = layer._specviz_buffers = {}
    buf = buffers.get(name)
    held = old.shape[2] if old.dim() == 4 else 0
    if (buf is not None and held + n <= buf.shape[2] and tuple(buf.shape[:2]) == tuple(rows_heads)
            and like.dtype is buf.dtype and like.device == buf.device
            and (not held or (old.data_ptr() == buf.data_ptr() and old.stride() == buf.stride()))):
        return buf, held
    total = held + n
    buf = like.new_empty((*rows_heads, total + max(APPEND_SLACK, total // 2), like.shape[3]))
    if held:
        buf.narrow(2, 0, held).copy_(old)
    buffers[name] = buf
    return buf, held



def _append_slots(layer, name: str, new: torch.Tensor) -> torch.Tensor:
    """``layer.<name>`` with ``new`` appended along the slot axis, written in place into
    spare room behind it where it has some.

    transformers' ``DynamicLayer.update`` concatenates, which copies every slot the layer
    holds on every forward, a cost that grows with the context: one-token forwards in
    ``w8a8-token`` on 2 threads measured 44.2 ms with concatenation and 39.9 ms with this
    for the built-in draft after 1,500 slots, 84.0 and 77.8 ms for the target after 800.
    Here a layer's keys and values live at the front of a larger buffer: while the
    current tensor is that buffer's leading slots (as it stays after :func:`crop_cache`
    and :func:`compact_cache`, which narrow it) and the new slots fit, they are written
    into the buffer and the tensor becomes a longer view of it. Otherwise (the first
    forward, a tensor from transformers' own update or from :func:`select_rows` /
    :func:`split_cache`, a full buffer) a new buffer with room for
    ``max(APPEND_SLACK, length / 2)`` more slots is allocated and filled once. Below
    :data:`APPEND_FROM` slots the layer concatenates as transformers does. The values
    are the concatenation's, bit for bit; slots beyond a narrowed tensor are stale and
    get overwritten, which nothing reads (a cache's valid region is its tensors' length).
    """
    old = getattr(layer, name)  # (B, H, S, D)
    held = old.shape[2] if old.dim() == 4 else 0
    n = new.shape[2]
    if held + n < APPEND_FROM:  # short: a concatenation costs less than the buffer's bookkeeping
        layer.__dict__.get("_specviz_buffers", {}).pop(name, None)
        return torch.cat([old, new], dim=-2)
    buf, held = _room(layer, name, n, new, tuple(new.shape[:2]))
    buf.narrow(2, held, n).copy_(new)
    return buf.narrow(2, 0, held + n)



def reserve_slots(cache: DynamicCache, index: int, n: int, rows: int, kv_heads: int, head_dim: int,
                  like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Room for ``n`` more slots in layer ``index`` of ``cache``, for a forward that writes
    its new keys and values itself (:func:`~specviz.models.fused.fused_forward`).

    The layer's keys and values become views of ``held + n`` slots at the front of the same
    buffers :func:`_append_slots` uses, whose last ``n`` slots the caller must fill.
    ``like`` gives the dtype and device.

    Returns:
        ``(key buffer, value buffer, held)``, the buffers ``(B, H, capacity, D)``.
    """
    layer = cache.layers[index]
    shape = like.new_empty((rows, kv_heads, 0, head_dim))  # (B, H, 0, D): dtype, device, head size
    if not layer.is_initialized:
        layer.lazy_initialization(shape, shape)
    out = []
    held = 0
    for name in ("keys", "values"):
        buf, held = _room(layer, name, n, shape, (rows, kv_heads))
        setattr(layer, name, buf.narrow(2, 0, held + n))
        out.append(buf)
    return out[0], out[1], held



def append_kv(cache: DynamicCache, k: torch.Tensor, v: torch.Tensor, index: int):
    """``cache.update(k, v, index)`` for a full-attention ``DynamicLayer``, appending in
    place where the layer has room (:func:`_append_slots`); ``(keys, values)``."""
    layer = cache.layers[index]
    if type(layer).__name__ != "DynamicLayer":
        return cache.update(k, v, index)
    if not layer.is_initialized:
        layer.lazy_initialization(k, v)
    layer.keys = _append_slots(layer, "keys", k)
    layer.values = _append_slots(layer, "values", v)
    return layer.keys, layer.values
