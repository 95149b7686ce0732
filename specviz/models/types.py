"""What loading returns: one model with its tokenizer and weight mode (:class:`LoadedModel`),
a target with its draft (:class:`ModelPair`), and the error for a pair that does not share a
tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specviz.models.device import model_device
from specviz.quant.weights import weight_mode_of

__all__ = ["LoadedModel", "ModelPair", "TokenizerMismatchError"]


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer.

    Attributes:
        name: registry name, Hub id or path it was loaded from.
        model: a transformers ``PreTrainedModel`` in eval mode.
        tokenizer: the matching tokenizer.
        dtype: parameter dtype (the activation dtype; float32 for the integer modes).
        weight_mode: name of its :data:`~specviz.quant.weights.WEIGHT_MODES` entry; read
            from the model's layers when not given.
    """

    name: str
    model: Any
    tokenizer: Any
    dtype: torch.dtype
    weight_mode: str | None = None

    def __post_init__(self) -> None:
        if self.weight_mode is None:
            self.weight_mode = weight_mode_of(self.model)

    @property
    def max_context(self) -> int:
        """Longest sequence the model supports (its ``max_position_embeddings``)."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def parameter_count(self) -> int:
        """The model's parameters as its float form counts them, in every weight mode: an
        integer layer (whose weights are buffers, not parameters) counts its weight matrix and
        bias, and an LM head tied to the embeddings counts once even where a mode gave it a
        converted copy."""
        from specviz.quant.weights import W4A8TokenLinear, W8A8TokenLinear

        count = sum(p.numel() for p in self.model.parameters())
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        for name, module in self.model.named_modules():
            if isinstance(module, (W8A8TokenLinear, W4A8TokenLinear)) and not (
                    tied and name == "lm_head"):
                bias = module._buffers.get("bias")
                count += module.in_features * module.out_features + (0 if bias is None else bias.numel())
        return count

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (forwards run there; specviz's bookkeeping stays on the CPU)."""
        return model_device(self.model)



@dataclass
class ModelPair:
    """A target model and a draft model that share one tokenizer."""

    target: LoadedModel
    draft: LoadedModel



class TokenizerMismatchError(ValueError):
    """Raised when a target and a draft model do not share a tokenizer."""
