"""Self-speculative drafting with no extra weights: the target's own first layers, final
norm and LM head draft (:class:`SelfSpeculativeDrafter`, built on :func:`truncated_model`)."""

from __future__ import annotations

import copy

import torch

from specviz.draft.model import TreeDrafter
from specviz.models.types import LoadedModel
from specviz.tree.shapes import TreeShape, chain
from specviz.validate import check_int

__all__ = ["truncated_model", "SelfSpeculativeDrafter", "self_speculative_model"]


def truncated_model(model, n_layers: int):
    """A causal LM that runs only the first ``n_layers`` decoder layers of ``model``, then
    its final norm and LM head, sharing every weight with ``model`` (no copy).

    Built with ``model``'s own class from a config with fewer layers; transformers'
    forward then iterates over exactly those layers.
    """
    inner = model.model
    total = len(inner.layers)
    check_int("n_layers", n_layers, 1, total - 1, note=f"for a {total}-layer model")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:n_layers]
    with torch.device("meta"):
        small = type(model)(config)
    small.model.embed_tokens = inner.embed_tokens
    small.model.layers = torch.nn.ModuleList(list(inner.layers)[:n_layers])
    small.model.norm = inner.norm
    small.model.rotary_emb = inner.rotary_emb
    small.lm_head = model.lm_head
    small.config._attn_implementation = model.config._attn_implementation
    small.eval()
    left = [name for name, t in list(small.named_parameters()) + list(small.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"cannot share these tensors of {type(model).__name__} with a truncated copy: {left[:5]}")
    return small


class SelfSpeculativeDrafter(TreeDrafter):
    """Self-speculative drafting with no extra weights: the target's first ``n_layers``
    layers plus its final norm and LM head draft a tree of the given shape.

    Args:
        target: the target :class:`~specviz.models.LoadedModel`.
        n_layers: decoder layers the draft runs.
        shape: tree shape (default a chain of 4).
    """

    def __init__(self, target, n_layers: int, shape: TreeShape | None = None) -> None:
        super().__init__(self_speculative_model(target, n_layers), shape if shape is not None else chain(4))
        self.n_layers = n_layers
        self.name = f"self(L={n_layers},n={self.shape.budget},d={self.shape.depth})"


def self_speculative_model(target: LoadedModel, n_layers: int) -> LoadedModel:
    """The target's first ``n_layers`` decoder layers, final norm and LM head as a draft
    model named ``<target>[:<n_layers>]`` (:func:`truncated_model`: weights shared)."""
    return LoadedModel(name=f"{target.name}[:{n_layers}]", model=truncated_model(target.model, n_layers),
                       tokenizer=target.tokenizer, dtype=target.dtype)
