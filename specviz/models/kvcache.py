"""KV cache bookkeeping for tree verification on transformers' own models and caches.

specviz runs the model classes of ``transformers`` unchanged. What it adds is how a
draft tree goes through them and what stays in the cache afterwards:

* :func:`forward_tokens` - one forward of new tokens on top of a ``DynamicCache`` with
  explicit position ids and an explicit 4D mask (the tree mask), returning fp32 logits
  (and, on request, the last hidden states, the input of the LM head);
  a masked forward attends with specviz's tree attention (:mod:`specviz.attention.hf`)
  or, as the reference, with transformers' ``sdpa``;
* :func:`compact_cache` - after acceptance keep, per batch row, the committed prefix
  plus the accepted path: the path's entries are copied into place right after the
  row's prefix and the cache is narrowed; nothing before the prefix end is touched or
  recomputed, and nothing from rejected nodes survives in the valid region;
* :func:`stack_caches` / :func:`split_cache` - several one-sequence caches of different
  lengths as one right-padded batch for a single forward, and back;
* :func:`crop_cache`, :func:`select_rows`, :func:`cache_length`.

Batch layout: cache slot ``s`` of row ``b`` is valid iff ``s < prefix_lens[b]``. Rows
with shorter prefixes carry stale (always finite) entries up to the common length,
which their attention masks hide. Masks are passed to the model as additive float
tensors in the model's dtype (0 where a query may attend, the dtype's minimum where it
may not), the form every attention implementation of transformers accepts.

Dimension legend: B = batch rows, N = new tokens this forward, S = cache slots before
the forward, H = key/value heads, D = head size, V = vocabulary, M = kept path length,
E = hidden size.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
import weakref
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specviz.models.decoder import direct_forward_supported, has_hooks, layer_modules, layers_unchanged
from specviz.models.device import model_device, to_device
from specviz.models.slots import append_kv, reserve_slots
from specviz.models.fused import FUSED_MAX_TOKENS, causal_over_cache, fused_forward, is_fused
from specviz.quant.passes import prompt_positions, prompt_rows
from specviz.attention.hf import ATTENTION_CHOICES, SHARED_KEYS_KWARG, SPECVIZ_ATTENTION, attention_implementation
from specviz.validate import check_choice

__all__ = [
    "new_cache",
    "cache_length",
    "crop_cache",
    "select_rows",
    "compact_cache",
    "stack_caches",
    "split_cache",
    "additive_mask",
    "decoder_of",
    "reserve_slots",
    "forward_tokens",
]


def new_cache(model) -> DynamicCache:
    """An empty ``DynamicCache`` laid out for ``model`` (a transformers causal LM).

    Raises:
        ValueError: if the model uses sliding-window layers, whose caches drop old
            entries and cannot be compacted slot by slot.
    """
    cache = DynamicCache(config=model.config)
    sliding = [i for i, layer in enumerate(cache.layers) if getattr(layer, "is_sliding", False)]
    if sliding:
        raise ValueError(
            f"model layers {sliding[:5]} use sliding-window attention; specviz's tree verification "
            "needs full-attention KV caches"
        )
    return cache


def cache_length(cache: DynamicCache) -> int:
    """Number of slots currently held (the same in every layer)."""
    return int(cache.get_seq_length())


def _layers(cache: DynamicCache):
    return [layer for layer in cache.layers if layer.is_initialized and layer.keys is not None
            and layer.keys.numel() > 0]


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` slots of every layer (a view; no copy)."""
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    for layer in _layers(cache):
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def select_rows(cache: DynamicCache, rows: Sequence[int]) -> None:
    """Keep only batch rows ``rows`` (in that order)."""
    index = torch.as_tensor(list(rows), dtype=torch.long)
    for layer in _layers(cache):
        layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))
        layer.values = layer.values.index_select(0, index.to(layer.values.device))


@torch.no_grad()
def compact_cache(cache: DynamicCache, dst_start: Sequence[int], src_slots: Sequence[Sequence[int]],
                  new_length: int) -> None:
    """Move each row's kept entries into place and narrow the cache to ``new_length``.

    Row ``b`` gets ``cache[b, :, src_slots[b][j]]`` written to slot ``dst_start[b] + j``.
    Every ``src_slots[b][j] >= dst_start[b] + j`` (entries only move left), and the copy
    goes through a gathered temporary, so overlapping ranges are safe.

    Args:
        cache: the cache, modified in place.
        dst_start: ``(B,)`` first destination slot per row (its committed prefix length).
        src_slots: per row, the non-empty list of slots to keep, in order.
        new_length: slots to keep afterwards (at least ``max(dst_start[b] + len(src_slots[b]))``).
    """
    rows = len(src_slots)
    if rows != len(dst_start):
        raise ValueError(f"got {len(dst_start)} destination starts for {rows} rows")
    if any(len(s) == 0 for s in src_slots):
        raise ValueError("every row must keep at least one slot")
    m = max(len(s) for s in src_slots)
    # Pad short rows by repeating their last pair: a duplicate write of the same value.
    src = torch.tensor([list(s) + [s[-1]] * (m - len(s)) for s in src_slots], dtype=torch.long)  # (B, M)
    dst = torch.tensor([[d + min(j, len(s) - 1) for j in range(m)] for d, s in zip(dst_start, src_slots)],
                       dtype=torch.long)  # (B, M)
    if bool((dst >= new_length).any()):
        raise ValueError(f"new_length {new_length} is shorter than the kept entries")
    if all(list(s) == list(range(d, d + len(s))) for d, s in zip(dst_start, src_slots)):
        crop_cache(cache, new_length)  # every path is already in place (e.g. a chain)
        return
    for layer in _layers(cache):
        for name in ("keys", "values"):
            kv = getattr(layer, name)  # (B, H, S, D)
            h, d = kv.shape[1], kv.shape[3]
            s_idx = src.to(kv.device)[:, None, :, None].expand(rows, h, m, d)  # (B, H, M, D)
            d_idx = dst.to(kv.device)[:, None, :, None].expand(rows, h, m, d)
            moved = kv.gather(2, s_idx)  # (B, H, M, D)
            kv.scatter_(2, d_idx, moved)
            setattr(layer, name, kv[:, :, :new_length])


def _assign(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values


def stack_caches(model, caches: Sequence[DynamicCache]) -> DynamicCache:
    """One cache holding ``caches`` (one sequence each) as batch rows, right-padded with
    zeros to the longest; row ``b``'s slots ``[0, cache_length(caches[b]))`` are real."""
    lengths = [cache_length(c) for c in caches]
    out = new_cache(model)
    if max(lengths) == 0:
        return out
    smax = max(lengths)
    full = next(c for c, n in zip(caches, lengths) if n)
    for i, ref in enumerate(full.layers):
        stacked = []
        for name in ("keys", "values"):
            like = getattr(ref, name)  # (1, H, S, D)
            buf = like.new_zeros((len(caches), like.shape[1], smax, like.shape[3]))  # (B, H, Smax, D)
            for b, (c, n) in enumerate(zip(caches, lengths)):
                if n:
                    buf[b, :, :n] = getattr(c.layers[i], name)[0]
            stacked.append(buf)
        _assign(out.layers[i], *stacked)
    return out


def split_cache(batched: DynamicCache, caches: Sequence[DynamicCache], lengths: Sequence[int], start: int,
                new: Sequence[int]) -> None:
    """Write back into ``caches[b]`` its ``lengths[b]`` old slots plus the ``new[b]`` slots that a
    forward on :func:`stack_caches`'s result appended at ``start`` (the padded length)."""
    for b, cache in enumerate(caches):
        index = torch.cat([torch.arange(lengths[b]), torch.arange(start, start + new[b])])  # (S_b + n_b,)
        for i, layer in enumerate(batched.layers):
            keys = layer.keys[b:b + 1].index_select(2, index.to(layer.keys.device))  # (1, H, S_b + n_b, D)
            values = layer.values[b:b + 1].index_select(2, index.to(layer.values.device))
            _assign(cache.layers[i], keys, values)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean ``(B, N, K)`` "may attend" mask -> additive ``(B, 1, N, K)`` float mask."""
    if allowed.dtype != torch.bool or allowed.dim() != 3:
        raise ValueError(f"allowed must be a bool (B, N, K) tensor, got {allowed.dtype} {tuple(allowed.shape)}")
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    out.masked_fill_(~allowed, torch.finfo(dtype).min)
    return out[:, None]  # (B, 1, N, K)


def decoder_of(model):
    """The decoder stack of a transformers causal LM (``model.model`` for Llama-style
    models): the module whose output, after the final norm, is the LM head's input.

    Raises:
        ValueError: the model has no such submodule.
    """
    prefix = getattr(model, "base_model_prefix", "model") or "model"
    decoder = getattr(model, prefix, None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise ValueError(f"{type(model).__name__} has no decoder stack at .{prefix} with .layers; "
                         "specviz reads last hidden states from Llama-style causal LMs")
    return decoder


@contextlib.contextmanager
def _capture_hidden(model):
    """Collect the decoder's ``last_hidden_state`` (after the final norm) of the forwards
    run inside the block into the yielded list."""
    captured: list[torch.Tensor] = []

    def hook(module, args, output):
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = decoder_of(model).register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def _before_attention(layer, rotary, h, cos, sin):
    """A decoder layer up to its attention: input norm, query/key/value projections, rotary
    embedding; ``(q, k, v)``, each ``(B, heads, N, D)``. The layer's own modules and the
    model's own rotary function, in the order of the layer's forward."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    heads = (*h.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(x).view(heads).transpose(1, 2)
    k = attn.k_proj(x).view(heads).transpose(1, 2)
    v = attn.v_proj(x).view(heads).transpose(1, 2)
    return rotary(q, k, cos, sin) + (v,)


def _after_attention(layer, h, out):
    """A decoder layer after its attention (``out`` ``(B, N, heads, D)``): output
    projection, residual, norm, MLP, residual; the new ``h``."""
    h = h + layer.self_attn.o_proj(out.reshape(*h.shape[:-1], -1).contiguous())
    return h + layer.mlp(layer.post_attention_layernorm(h))


class _BeforeAttention(torch.nn.Module):
    """:func:`_before_attention` of one layer as a module, to be traced."""

    def __init__(self, layer, rotary) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary

    def forward(self, h, cos, sin):
        return _before_attention(self.layer, self.rotary, h, cos, sin)


class _AfterAttention(torch.nn.Module):
    """:func:`_after_attention` of one layer as a module, to be traced."""

    def __init__(self, layer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, h, out):
        return _after_attention(self.layer, h, out)


#: ``SPECVIZ_NO_TRACE=1`` runs the decoder loop's layer halves as Python module calls
NO_TRACE_ENV = "SPECVIZ_NO_TRACE"
#: the module classes (by defining module) whose forward a recorded program reproduces
#: for every input: no branch on input shapes or on a flag a caller may flip later. A
#: layer holding any other module (adapters, a user's own modules) runs as Python calls.
TRACEABLE_MODULES = {
    "torch.nn.modules.linear": {"Linear"},
    "torch.nn.modules.activation": {"SiLU"},
    "transformers.activations": {"SiLUActivation"},
    "transformers.models.qwen2.modeling_qwen2": {"Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm"},
    "transformers.models.llama.modeling_llama": {"LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm"},
    "specviz.quant.w8a8": {"W8A8TokenLinear", "SharedInputGroup", "SharedInputSlice"},
    "specviz.quant.w4a8": {"W4A8TokenLinear"},
}
_programs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _layer_programs(model, layers, rotary, h, cos_sin):
    """Each layer's two halves (:class:`_BeforeAttention`, :class:`_AfterAttention`) as
    TorchScript programs, for a model on a CPU, or None where the Python modules run.

    A program runs the same operators in the same order as the modules (bitwise the same
    results) without the Python interpreter between them, which on a 2-core CPU saves about
    a tenth of a one-token forward of the 1.5B target. The programs are traced on the first
    forward that gets here (a few seconds), kept with the model, and traced again when its
    layers change. None on an accelerator (where TorchScript could fuse operators), with a
    forward hook inside a layer (which a program would not call) or a module outside
    :data:`TRACEABLE_MODULES`, with ``SPECVIZ_NO_TRACE=1``, or while a trace is being
    recorded.
    """
    if (h.device.type != "cpu" or os.environ.get(NO_TRACE_ENV, "").strip().lower() in ("1", "true", "yes")
            or torch.jit.is_tracing()):
        return None
    found = _programs.get(model)
    if found is not None and found[0] == (h.device, h.dtype) and layers_unchanged(found[1], layers):
        return found[2]
    recorded = (list(layers), layer_modules(layers))
    for m in recorded[1][0] + [p for p, _ in recorded[1][1]]:
        if has_hooks(m) or type(m).__name__ not in TRACEABLE_MODULES.get(type(m).__module__, ()):
            return None
    programs = []
    x = h
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on Python values; the tests compare the results
        for layer in layers:
            before, after = _BeforeAttention(layer, rotary), _AfterAttention(layer)
            q, _, _ = before(x, *cos_sin)
            out = q.transpose(1, 2)  # an attention output's shape (B, N, heads, D): an example input only
            programs.append((torch.jit.trace(before, (x, *cos_sin), check_trace=False),
                             torch.jit.trace(after, (x, out), check_trace=False)))
            x = after(x, out)
    _programs[model] = ((h.device, h.dtype), recorded, programs)
    return programs


def _direct_forward(model, cache: DynamicCache, tokens: torch.Tensor, position_ids: torch.Tensor,
                    mask: torch.Tensor | None, logits_to_keep: int, extra: dict, hidden: bool, head=None):
    """The decoder of a :data:`DIRECT_FORWARD_CLASSES` model run layer by layer: the
    modules its own forward calls (embedding, rotary embedding, norms, projections, MLP,
    LM head), the same cache contents and the same attention function with the same
    arguments, in the same order, so the logits are bitwise those of ``model(...)``.
    What it skips is the plumbing around them (mask construction, output records, the
    decoder layers' and attention modules' own calls), a few milliseconds per forward,
    and, in layers of :data:`APPEND_FROM` slots or more, the cache's copy of every slot on
    every forward (new slots are written into spare room behind the old ones,
    :func:`~specviz.models.slots.append_kv`). On
    a CPU the layers' halves before and after attention run as TorchScript programs of the
    same operators (:func:`_layer_programs`).

    ``mask`` is the 4D additive mask (passed through unchanged by transformers' mask code
    as well), or None for one new token per row attending to the whole cache.

    Returns:
        ``(logits, last hidden states or None)``, in the model's dtype.
    """
    decoder = model.model
    config = model.config
    sliding = {"sliding_window": None} if type(model).__name__ == "Qwen2ForCausalLM" else {}
    rotary = sys.modules[type(model).__module__].apply_rotary_pos_emb
    h = decoder.embed_tokens(tokens)
    cos_sin = decoder.rotary_emb(h, position_ids)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
                                                   sys.modules[type(model).__module__].eager_attention_forward)
    layers = decoder.layers[: config.num_hidden_layers]
    # a forward with prompt positions runs the modules: a program would record its passes
    programs = None if prompt_rows(h) else _layer_programs(model, layers, rotary, h, cos_sin)
    halves = programs or [  # else the same steps as Python calls
        (functools.partial(_before_attention, layer, rotary), functools.partial(_after_attention, layer))
        for layer in layers]
    for layer, (before, after) in zip(layers, halves):
        attn = layer.self_attn
        q, k, v = before(h, *cos_sin)
        k, v = append_kv(cache, k, v, attn.layer_idx)
        out, _ = attend(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, **sliding,
                        position_ids=position_ids, use_cache=True, **extra)
        h = after(h, out)
    h = decoder.norm(h)
    kept = h[:, slice(-logits_to_keep, None), :]
    return (model.lm_head if head is None else head)(kept), (h if hidden else None)


@torch.no_grad()
def forward_tokens(model, cache: DynamicCache, tokens: torch.Tensor, position_ids: torch.Tensor,
                   allowed: torch.Tensor | None, logits_to_keep: int = 0, *,
                   attention: str = "specviz", hidden: bool = False, head=None):
    """Run ``model`` on new ``tokens`` after the cached slots; the cache grows by N.

    Args:
        model: a transformers causal LM.
        cache: its ``DynamicCache`` holding ``S`` slots per row.
        tokens: ``(B, N)`` token ids.
        position_ids: ``(B, N)`` rotary positions.
        allowed: ``(B, N, S + N)`` bool, True where a query may attend; None means plain
            causal attention over the whole cache (every slot valid).
        logits_to_keep: compute logits for only the last this many tokens (0 = all);
            a prefill needs just the last.
        attention: how a masked forward attends, one of
            :data:`~specviz.attention.ATTENTION_CHOICES`: ``"specviz"`` (tree attention,
            bitwise equal to ``"sdpa"`` without its per-head K/V copy), ``"specviz-split"``
            (the slots every query sees unmasked, the rest masked, merged by log-sum-exp)
            or ``"sdpa"`` (transformers' own, the reference). The model's implementation
            is switched for this call only. A forward without a mask keeps the model's own.

        hidden: also return the model's last hidden states at every new token (the
            output of its final norm, the input of its LM head), whatever
            ``logits_to_keep`` is.
        head: what computes the logits from the last hidden states instead of the
            model's LM head (a draft's :class:`~specviz.draft.vocab.ReducedHead`). A
            forward that runs ``model(...)`` (below) computes its own head's logits for the
            kept positions as well, and returns ``head``'s.

    The inputs may be on the CPU: they go to the model's device, and the logits come back
    to the CPU (which waits for the device, so a timed forward is synchronised).

    For Qwen2 and Llama models (:data:`DIRECT_FORWARD_CLASSES`) a masked forward, or one
    new token per row, runs the decoder layer by layer here (:func:`_direct_forward`): the
    model's own modules and attention function in its own order, bitwise the logits of
    ``model(...)``, without transformers' per-call plumbing (a few milliseconds per
    forward on a CPU) and, on a CPU, with each layer's halves before and after attention
    run as TorchScript programs of the same operators (about a tenth of a forward of the
    built-in pair in ``w8a8-token``; ``SPECVIZ_NO_TRACE=1`` runs Python module calls).
    ``attention="sdpa"``, a prefill without a mask, other classes and
    models with forward hooks on the model or its decoder run ``model(...)`` itself.

    A draft opted in with :func:`~specviz.models.fused.fuse_layers` (what
    :func:`~specviz.models.loading.load_pair` does for a ``w4a8-token`` draft) runs each
    decoder layer as one compiled call (:func:`~specviz.models.fused.fused_forward`)
    wherever every new token sees its whole cache and the new tokens before it (``allowed``
    None or exactly that causal mask) and there are at most
    :data:`~specviz.models.fused.FUSED_MAX_TOKENS` of them: its logits then differ from ``model(...)``'s by
    rounding, which only moves what the draft proposes.

    A forward onto an empty cache is a prompt's: in the token modes its rows run in one
    activation pass (:mod:`specviz.quant.passes`), every later forward's in the layers'
    own passes.

    Returns:
        ``(B, N, V)`` float32 CPU logits (``(B, logits_to_keep, V)`` when it is set); with
        ``hidden``, the pair ``(logits, hidden)`` with ``hidden`` ``(B, N, E)`` float32 on
        the CPU. The logits are the same either way.
    """
    check_choice("attention", attention, ATTENTION_CHOICES)
    s = cache_length(cache)
    b, n = tokens.shape
    if position_ids.shape != (b, n):
        raise ValueError(f"position_ids must have shape {(b, n)}, got {tuple(position_ids.shape)}")
    if allowed is not None and allowed.shape != (b, n, s + n):
        raise ValueError(f"mask must have shape {(b, n, s + n)} (cache {s} + new {n}), "
                         f"got {tuple(allowed.shape)}")
    with prompt_positions(n if s == 0 else 0, s, n):  # a forward onto an empty cache is a prompt's
        return _forward_tokens(model, cache, tokens, position_ids, allowed, logits_to_keep, attention, hidden, head,
                               s, n)


def _forward_tokens(model, cache, tokens, position_ids, allowed, logits_to_keep, attention, hidden, head, s, n):
    """:func:`forward_tokens` after its checks, ``s`` cached slots and ``n`` new tokens."""
    device = model_device(model)
    if is_fused(model) and attention != "sdpa" and n <= FUSED_MAX_TOKENS and causal_over_cache(allowed, s):
        fused = fused_forward(model, cache, tokens, position_ids, logits_to_keep, hidden, head)  # None: unsupported
        if fused is not None:
            logits = fused[0].float().cpu()
            return (logits, fused[1].float().cpu()) if hidden else logits
    direct = attention != "sdpa" and (allowed is not None or n == 1) and direct_forward_supported(model)
    if head is not None and not direct:  # model(...) runs its own head; ``head`` scores its hidden states
        with _capture_hidden(model) as captured:
            forward_tokens(model, cache, tokens, position_ids, allowed, logits_to_keep or n, attention=attention)
        if len(captured) != 1:
            raise RuntimeError(f"expected one decoder forward, saw {len(captured)}")
        last = captured[0]  # (B, N, E) on the model's device
        logits = head(last[:, -(logits_to_keep or n):]).float().cpu()
        return (logits, last.float().cpu()) if hidden else logits
    if hidden and not direct:
        with _capture_hidden(model) as captured:
            logits = forward_tokens(model, cache, tokens, position_ids, allowed, logits_to_keep, attention=attention)
        if len(captured) != 1:
            raise RuntimeError(f"expected one decoder forward, saw {len(captured)}")
        return logits, captured[0].float().cpu()  # (B, N, V), (B, N, E)
    tokens, position_ids = to_device(tokens, device), to_device(position_ids, device)
    extra = {}
    if allowed is not None and attention == "specviz-split":
        # the leading cache slots that every query of every row may see (the common prefix)
        extra[SHARED_KEYS_KWARG] = int(allowed[:, :, :s].all(dim=1).all(dim=0).cumprod(0).sum())
    if direct:
        if allowed is None:
            logits, last = _direct_forward(model, cache, tokens, position_ids, None, logits_to_keep, extra, hidden,
                                           head)
        else:
            mask = additive_mask(to_device(allowed, device), model.dtype)
            with attention_implementation(model, SPECVIZ_ATTENTION):
                logits, last = _direct_forward(model, cache, tokens, position_ids, mask, logits_to_keep, extra,
                                               hidden, head)
        logits = logits.float().cpu()
        return (logits, last.float().cpu()) if hidden else logits
    inputs = dict(input_ids=tokens, position_ids=position_ids, past_key_values=cache, use_cache=True,
                  logits_to_keep=logits_to_keep, **extra)
    if allowed is None:
        return model(**inputs).logits.float().cpu()
    with attention_implementation(model, "sdpa" if attention == "sdpa" else SPECVIZ_ATTENTION):
        out = model(attention_mask=additive_mask(to_device(allowed, device), model.dtype), **inputs)
    return out.logits.float().cpu()
