"""What the fast forward paths need to know about a decoder stack: which model classes
specviz runs layer by layer itself, and whether a model's modules are still the ones a
recorded program or a fused layer was built from (no hook added, no module swapped in).

Shared by the direct forward (:mod:`specviz.models.kvcache`) and the fused layers
(:mod:`specviz.models.fused`).
"""

from __future__ import annotations

import torch

__all__ = ["DIRECT_FORWARD_CLASSES", "has_hooks", "direct_forward_supported", "layer_modules", "layers_unchanged"]


#: causal LM classes whose decoder :func:`forward_tokens` runs layer by layer itself
#: (:func:`_direct_forward`): the same modules and operators as their own forward, in the
#: same order, without its per-call plumbing
DIRECT_FORWARD_CLASSES = ("Qwen2ForCausalLM", "LlamaForCausalLM")



def has_hooks(module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)



def direct_forward_supported(model) -> bool:
    """Whether :func:`_direct_forward` may run ``model``: a class of
    :data:`DIRECT_FORWARD_CLASSES` in inference mode, full attention in every layer, and no
    forward hook on the model or its decoder (which the direct loop would not call; hooks
    on the layers' linear modules and norms do run)."""
    if type(model).__name__ not in DIRECT_FORWARD_CLASSES or model.training:
        return False
    decoder = getattr(model, "model", None)
    if decoder is None or has_hooks(model) or has_hooks(decoder):
        return False
    types = getattr(model.config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        return False
    return not (torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks)



def layer_modules(layers) -> tuple[list, list]:
    """What traced programs are recorded from: every module of ``layers`` without children,
    and every one with children, with its children."""
    modules = [m for layer in layers for m in layer.modules()]
    return ([m for m in modules if not m._modules],
            [(m, list(m._modules.values())) for m in modules if m._modules])



def layers_unchanged(recorded, layers) -> bool:
    """Whether the programs recorded from ``recorded`` still stand for ``layers``: the same
    layer objects, no module swapped in below them and no forward hook added since."""
    layer_list, (leaves, parents) = recorded
    if list(layers) != layer_list:
        return False
    for m in leaves:
        if has_hooks(m) or m._modules:
            return False
    for m, children in parents:
        if has_hooks(m) or list(m._modules.values()) != children:
            return False
    return True
