"""A loaded model put into a weight mode: a cast for the float modes, a conversion of its
linear layers (:func:`specviz.quant.weights.quantize_model`) for the others, calibrated on a
fixed text where the mode needs activation statistics."""

from __future__ import annotations

import torch

from specviz.quant.weights import WeightMode, quantize_model

__all__ = ["calibration_ids", "convert_model"]


_CALIBRATION_MODULES = ("textwrap", "json", "argparse", "string")



def calibration_ids(tokenizer, max_tokens: int = 1024) -> torch.Tensor:
    """Token ids of the fixed calibration text of calibrated weight modes, (1, L), L <= max_tokens.

    The text is four chat turns asking to explain the start of a Python standard-library
    module's source (textwrap, json, argparse, string): code and English prose in the
    chat format every prompt of the study uses, and on every machine without a download.
    """
    import importlib
    import inspect

    chunks = []
    for module in _CALIBRATION_MODULES:
        source = inspect.getsource(importlib.import_module(module))[:1200]
        messages = [{"role": "user", "content": f"Explain what this Python module does:\n\n{source}"}]
        if getattr(tokenizer, "chat_template", None):
            chunks.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        else:
            chunks.append(messages[0]["content"])
    ids = tokenizer("".join(chunks), return_tensors="pt").input_ids[:, :max_tokens]  # (1, L)
    return ids



def convert_model(model, mode: WeightMode, tokenizer):
    """``model`` in ``mode``: cast, or converted by :func:`quantize_model` (calibrated on
    :func:`calibration_ids` where the mode needs it)."""
    if mode.convert is None:
        return model.to(mode.activation_dtype)
    ids = calibration_ids(tokenizer) if mode.calibrated else None
    if ids is not None:
        ids = ids.clamp(max=int(model.config.vocab_size) - 1)
    return quantize_model(model, mode, ids)
