"""specviz's tree attention as the attention implementation of a transformers model.

transformers' models (Qwen2 here) look their attention function up by the name in
``model.config._attn_implementation`` in ``transformers.AttentionInterface`` on every
forward. This module registers :func:`specviz_attention_forward` there as ``"specviz"``,
and :func:`attention_implementation` switches a model to a registered name for the
duration of one call (the engine's verification forward) and back afterwards.

A 4D mask handed to the model travels unchanged to the attention function of every
layer (``masking_utils`` returns a 4D mask as is), and extra keyword arguments of the
model call reach it too: :data:`SHARED_KEYS_KWARG` carries, for the split variant, how
many leading keys every query may see. Choices (:data:`ATTENTION_CHOICES`):

* ``"specviz"`` - :func:`~specviz.attention.tree_attention` on the mask: one SDPA call
  that reads each key/value head once for its query group. transformers' ``sdpa`` copies
  K/V per query head first whenever a mask is given on the CPU (``repeat_kv``); the
  result is bitwise the same, the copy is saved;
* ``"specviz-split"`` - :func:`~specviz.attention.split_tree_attention`: the shared prefix
  without a mask, the rest with it, merged by log-sum-exp (equal up to float rounding;
  rows with different prefixes share only the shorter one);
* ``"sdpa"`` - transformers' own ``sdpa`` attention with the 4D mask, the reference.

Dimension legend: B = batch, Hq = query heads, Hkv = key/value heads, N = new tokens
(queries), S = cache slots plus N (keys), D = head dimension.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specviz.attention.kernels import split_tree_attention, tree_attention
from specviz.validate import check_choice

__all__ = [
    "ATTENTION_CHOICES",
    "SPECVIZ_ATTENTION",
    "SHARED_KEYS_KWARG",
    "specviz_attention_forward",
    "attention_implementation",
]

#: What :func:`specviz.models.forward_tokens` accepts as ``attention``.
ATTENTION_CHOICES: tuple[str, ...] = ("specviz", "specviz-split", "sdpa")
#: The name :func:`specviz_attention_forward` is registered under in transformers.
SPECVIZ_ATTENTION = "specviz"
#: Model-call keyword argument: keys ``[0, value)`` are seen by every query (split variant).
SHARED_KEYS_KWARG = "specviz_shared_keys"


def specviz_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None,
                              dropout: float = 0.0, scaling: float | None = None,
                              specviz_shared_keys: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls per layer under ``"specviz"``.

    Args:
        module: the attention layer (unused beyond the ``sdpa`` delegation).
        query: ``(B, Hq, N, D)``; key, value: ``(B, Hkv, S, D)`` including the cache.
        attention_mask: ``(B, 1, N, S)`` additive or bool mask. Without one (plain causal
            attention, e.g. a prefill run under this implementation), for a single query
            (N = 1) or with dropout the call is transformers' ``sdpa``.
        scaling: softmax scale.
        specviz_shared_keys: :data:`SHARED_KEYS_KWARG`; set and > 0 selects the split variant.

    Returns:
        ``((B, N, Hq, D) output, None)``, what ``sdpa_attention_forward`` returns.
    """
    # One query has no tree to attend through, and sdpa packs its query heads per K/V head
    # (rather than copying K/V), a layout whose rounding the masked call does not match.
    if attention_mask is None or attention_mask.dim() != 4 or query.shape[2] == 1 or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if specviz_shared_keys:
        out = split_tree_attention(query, key, value, attention_mask, specviz_shared_keys, scale=scaling)
    else:
        out = tree_attention(query, key, value, attention_mask, scale=scaling)  # (B, Hq, N, D)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(SPECVIZ_ATTENTION, specviz_attention_forward)
# Masks transformers builds itself (2D or none) are built as for sdpa, which the
# function above falls back to when it gets none.
AttentionMaskInterface.register(SPECVIZ_ATTENTION, sdpa_mask)


@contextmanager
def attention_implementation(model, name: str) -> Iterator[None]:
    """Run ``model`` (a transformers model whose modules share its config, as Qwen2's do)
    with attention implementation ``name`` inside the block, restoring the previous one
    afterwards, also when the block raises.

    Args:
        name: ``"specviz"`` (:data:`SPECVIZ_ATTENTION`) or a name of transformers'
            ``AttentionInterface`` such as ``"sdpa"``.
    """
    check_choice("name", name, ["eager", *AttentionInterface().valid_keys()])
    config = model.config
    previous = config._attn_implementation
    # Setting the config's attribute (which recurses into sub-configs) rather than
    # model.set_attn_implementation: the latter walks every module on each call, and
    # the modules read the shared config on every forward anyway.
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous
