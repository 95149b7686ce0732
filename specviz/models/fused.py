"""Fused decoder layers for a draft model in ``w4a8-token``: one compiled call per layer.

Outside its integer products, a forward of the built-in 0.5B draft in ``w4a8-token`` runs
the norms, the rotary embedding, the attention over the cache, the activation and the
residual additions as about 60 small operators per layer, which on a 2-core CPU cost about
as much as the 4-bit products themselves. ``torch.ops.specviz.w4a8_decoder_layer`` (in
``csrc/w8a8_token.cpp``) computes a whole Llama-style decoder layer in one call, with the
same four 4-bit products (:class:`~specviz.quant.w4a8.W4A8TokenLinear`'s operator) and its
own float code for the rest.

Its outputs differ from the modules' forward by float rounding, so it is for drafts only:
a draft's logits decide what is proposed, never what is accepted (the target verifies
with its own forward), so speculative decoding stays exactly as lossless as before, and a
draft's acceptance moves by rounding noise. Targets never run it.

A draft's activations need not be as exact as a target's: a fused draft quantizes each
product's input once per token, without ``w4a8-token``'s second int8 pass over the rounding
residual, which halves the rows of every product, in the fused calls and in the forwards that
run the modules (prefills, tree masks) alike. On a 2-core AVX-512 VNNI Xeon, the 0.5B after 200
tokens: a one-token forward 28.6 ms through the modules, 20.3 ms fused; three tokens 34.7 and
24.7 ms; its teacher-forced agreement with the ``w8a8-token`` target's continuations on the
benchmark's seven prompts 0.790 and 0.797.

The operator also takes a mask of the slots each new token sees, which is how a trained
EAGLE head in ``w4a8-token`` (:class:`~specviz.heads.EagleHead`) feeds a draft tree's nodes
through its one layer in one call each.

A model is opted in with :func:`fuse_layers` (:func:`~specviz.models.loading.load_pair`
does it for a draft loaded in ``w4a8-token``, with ``draft_layers``); then
:func:`~specviz.models.kvcache.forward_tokens` runs its forwards through
:func:`fused_forward` wherever every new token attends to its whole cache and causally to
the other new tokens (decoding, a chain's drafting, a catch-up) of a model
whose layers it supports (:func:`fused_support` says why not otherwise), for at most
:data:`FUSED_MAX_TOKENS` new tokens, and the modules for tree masks and prefills.
"""

from __future__ import annotations

import weakref

import torch

from specviz.models.decoder import DIRECT_FORWARD_CLASSES, direct_forward_supported, has_hooks, layer_modules, layers_unchanged
from specviz.models.slots import reserve_slots
from specviz.quant.extension import vnni_kernel, w8a8_token_op
from specviz.validate import check_choice

__all__ = ["DRAFT_LAYERS", "DEFAULT_DRAFT_LAYERS", "FUSED_ATTR", "FUSED_MAX_TOKENS", "fuse_layers", "layers_of",
           "is_fused", "fusable", "fused_support", "causal_over_cache", "fused_forward"]

#: how a draft's decoder layers run: its modules, or fused calls with one activation pass
DRAFT_LAYERS: tuple[str, ...] = ("modules", "fused-one-pass")
#: what :func:`~specviz.models.loading.load_pair` gives a ``w4a8-token`` draft
DEFAULT_DRAFT_LAYERS = "fused-one-pass"
#: the model attribute :func:`fuse_layers` sets
FUSED_ATTR = "_specviz_fused_layers"
_params: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def fuse_layers(model, layers: str = DEFAULT_DRAFT_LAYERS):
    """Let ``model``'s forwards run its decoder layers as fused calls where
    :func:`fused_support` allows, ``layers`` one of :data:`DRAFT_LAYERS` (``"modules"``
    turns it off again); returns ``model``.

    Only for a draft: the fused layer's rounding differs from the modules' forward.

    Raises:
        ValueError: an unknown ``layers``.
    """
    check_choice("layers", layers, DRAFT_LAYERS)
    setattr(model, FUSED_ATTR, layers)
    _set_passes(model, one_pass=layers != "modules")
    return model


#: where :func:`fuse_layers` keeps a ``w4a8-token`` layer's own choice of activation passes
_OWN_PASSES = "_specviz_own_residual"


def _set_passes(model, one_pass: bool) -> None:
    """Every ``w4a8-token`` product of ``model`` (its layers and its head) in one activation
    pass, or back in the passes it was built with: a one-pass draft runs its prefills and
    tree forwards through the modules in one pass too (a 200-token prefill of the built-in
    0.5B took 333 ms against 593 ms with both passes on a 2-core AMD EPYC)."""
    from specviz.quant.w4a8 import W4A8TokenLinear

    changed = False
    for module in model.modules():
        if isinstance(module, W4A8TokenLinear):
            own = module.__dict__.setdefault(_OWN_PASSES, module.residual)
            residual = own and not one_pass
            changed |= module.residual != residual
            module.residual = residual
    if changed:
        _params.pop(model, None)  # the operator's arguments record the passes


def layers_of(model) -> str:
    """How :func:`fuse_layers` set ``model``'s layers to run (``"modules"`` if it never did)."""
    return getattr(model, FUSED_ATTR, "modules")


def is_fused(model) -> bool:
    """Whether :func:`fuse_layers` opted ``model`` in."""
    return layers_of(model) != "modules"


def _op():
    return None if w8a8_token_op() is None else torch.ops.specviz.w4a8_decoder_layer


def _w4_layer(module):
    from specviz.quant.w4a8 import W4A8TokenLinear
    return module if isinstance(module, W4A8TokenLinear) else None


def _group_layer(slices, names):
    """The fused :class:`~specviz.quant.w4a8.W4A8TokenLinear` behind the
    :class:`~specviz.quant.weights.SharedInputSlice` modules ``slices``, if they are its
    members ``names`` in that column order, else None."""
    from specviz.quant.weights import SharedInputSlice
    if not all(isinstance(s, SharedInputSlice) for s in slices):
        return None
    group = slices[0].group
    if any(s.group is not group for s in slices) or tuple(group.names) != tuple(names):
        return None
    return _w4_layer(group.layer)


def _layer_params(layer, config) -> tuple | str:
    """The operator's weight arguments for one decoder layer, or why it cannot run it."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = _group_layer([attn.q_proj, attn.k_proj, attn.v_proj], ("q_proj", "k_proj", "v_proj"))
    gate_up = _group_layer([mlp.gate_proj, mlp.up_proj], ("gate_proj", "up_proj"))
    o, down = _w4_layer(attn.o_proj), _w4_layer(mlp.down_proj)
    if qkv is None or gate_up is None or o is None or down is None:
        return "its layers are not w4a8-token layers with fused query/key/value and gate/up groups"
    if len({qkv.residual, o.residual, gate_up.residual, down.residual}) != 1:
        return "its layers mix activation passes"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n).__name__ not in ("Qwen2RMSNorm", "LlamaRMSNorm") or n.weight.dtype != torch.float32
           for n in norms):
        return "its norms are not float32 RMSNorms"
    eps = norms[0].variance_epsilon
    if norms[1].variance_epsilon != eps:
        return "its two norms use different epsilons"
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    return (norms[0].weight, norms[1].weight, float(eps),
            qkv.inv_smooth, qkv.packed, qkv.bias, o.inv_smooth, o.packed, o.bias,
            gate_up.inv_smooth, gate_up.packed, gate_up.bias, down.inv_smooth, down.packed, down.bias,
            heads, kv_heads, attn.head_dim, down.in_features, float(attn.scaling), bool(qkv.residual))


def layers_params(layers, config, found=None, refuse=None) -> tuple:
    """The operator's arguments for each of ``layers``, looked up in ``found`` (a result of
    an earlier call) while the layers are the same objects with the same modules; otherwise
    ``refuse()`` (if given: why the operator may not run them, or None) and then the layers
    are read.

    Returns:
        ``(recorded, params)``: ``params`` is a list of every layer's arguments or, where the
        operator cannot run them, a string saying why; ``recorded`` is what the result
        stands for (keep ``(recorded, params)`` as the next call's ``found``), or None while
        a module inside the layers has a forward hook: that result is not to be kept, so
        that the layers run as one call again once the hook is removed.
    """
    if found is not None and layers_unchanged(found[0], layers):  # the same modules, no hook added
        return found
    recorded = (list(layers), layer_modules(layers))
    if any(has_hooks(m) for m in recorded[1][0] + [p for p, _ in recorded[1][1]]):
        return None, "a module inside its layers has a forward hook"
    reason = None if refuse is None else refuse()
    if reason is not None:
        return recorded, reason
    params = []
    for layer in layers:
        p = _layer_params(layer, config)
        if isinstance(p, str):
            return recorded, p
        params.append(p)
    return recorded, params


def _model_params(model) -> list[tuple] | str:
    """Every decoder layer's operator arguments (kept with the model while its layers are
    the same objects), or why the fused layers cannot run this model."""
    if type(model).__name__ not in DIRECT_FORWARD_CLASSES:
        return f"{type(model).__name__} is not one of {DIRECT_FORWARD_CLASSES}"
    if not direct_forward_supported(model):
        return "the model is training, has forward hooks or sliding-window layers"
    if model.dtype != torch.float32 or model.device.type != "cpu":
        return "the model is not float32 on the CPU"
    config = model.config
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"its activation is {config.hidden_act}, not silu"
    recorded, params = layers_params(list(model.model.layers[: config.num_hidden_layers]), config,
                                     _params.get(model))
    if recorded is not None and not isinstance(params, str):  # a model that cannot run fused is checked again
        _params[model] = (recorded, params)
    return params


def fusable(weight_mode: str, device) -> bool:
    """Whether a draft in ``weight_mode`` on ``device`` may run fused layers at all (a
    ``w4a8-token`` draft on the CPU, with the compiled operator), before its model is
    looked at (:func:`fused_support`)."""
    return weight_mode == "w4a8-token" and torch.device(device).type == "cpu" and _op() is not None


def fused_support(model) -> str | None:
    """None if :func:`fused_forward` can run ``model``, else why not (the compiled operator
    is missing, or the model's layers are not ``w4a8-token`` layers of a Llama-style model
    in float32 on the CPU)."""
    if _op() is None:
        return "the compiled operator is not available"
    found = _model_params(model)
    return found if isinstance(found, str) else None


#: the most new tokens a fused forward takes; longer forwards (a prompt's prefill) run the
#: modules, whose attention (PyTorch's) is faster for long ones: a prefill of 200 tokens of
#: the built-in 0.5B draft measured 608 ms through the modules against 682 ms fused
FUSED_MAX_TOKENS = 16


def causal_over_cache(allowed: torch.Tensor | None, cached: int) -> bool:
    """Whether a ``(B, N, S + N)`` mask lets every new token see all ``cached`` slots and
    the new tokens up to itself, and nothing else (None: plain causal attention)."""
    if allowed is None:
        return True
    n = allowed.shape[1]
    if allowed.shape[2] != cached + n:
        return False
    if n == 1:
        return bool(allowed.all())
    expected = torch.ones(n, cached + n, dtype=torch.bool).tril(cached)
    return bool(torch.equal(allowed, expected.expand_as(allowed)))


@torch.no_grad()
def fused_forward(model, cache, tokens: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: int,
                  hidden: bool, head=None):
    """``model``'s forward of ``tokens`` after its cache with every decoder layer one
    compiled call (activations in one pass, as :func:`fuse_layers` set its products), each
    new token seeing the whole cache and the new tokens up to itself.

    Returns:
        ``(logits, last hidden states or None)`` as :func:`~specviz.models.kvcache.forward_tokens`'
        layer-by-layer forward, or None, with nothing run, where :func:`fused_support`
        finds the model cannot run fused.
    """
    op = _op()
    params = None if op is None else _model_params(model)
    if params is None or isinstance(params, str):
        return None
    decoder = model.model
    h = decoder.embed_tokens(tokens)  # (B, N, E)
    cos, sin = decoder.rotary_emb(h, position_ids)  # (B, N, D) each
    use_vnni = vnni_kernel()
    n = tokens.shape[1]
    for index, p in enumerate(params):
        keys, values, held = reserve_slots(cache, index, n, h.shape[0], p[16], p[17], h)
        h = op(h, keys, values, held, cos, sin, *p, use_vnni)
    h = decoder.norm(h)
    kept = h[:, slice(-logits_to_keep, None), :]
    return (model.lm_head if head is None else head)(kept), (h if hidden else None)
