"""What a run starts from and stops by: prompt token ids and the stopping rules.

:func:`encode_prompt` turns text (chat template applied) or token ids into the ids a run
feeds, :func:`check_prompt` checks that they fit the target, and :func:`stop_rules` gives
the :class:`~specviz.decode.records.StopRules` of a run on a target (its end-of-sequence
ids, :func:`eos_token_ids`, the budget and its context limit). The speculative engine, the
target-only baseline and the greedy replays all use them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specviz.decode.records import StopRules
from specviz.models.types import LoadedModel

__all__ = ["encode_prompt", "eos_token_ids", "stop_rules", "check_prompt"]


def encode_prompt(tokenizer, prompt: str | Sequence[int] | torch.Tensor, chat: bool = True) -> list[int]:
    """Token ids of ``prompt``.

    A string is wrapped in the tokenizer's chat template as one user turn (with the
    assistant generation prompt) when ``chat`` is True and the tokenizer has a
    template, and tokenized plainly otherwise; token ids are used as given.

    Raises:
        ValueError: an empty prompt, or ids that are not a flat sequence of
            non-negative integers.
        TypeError: a prompt that is neither text nor token ids.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt is empty; give some text or token ids")
        if chat and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
            raise ValueError(f"prompt ids must be a 1-D integer tensor, got {prompt.dtype} {tuple(prompt.shape)}")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"prompt must be text or a sequence of token ids, got {type(prompt).__name__}")
    ids = list(prompt)
    if not ids:
        raise ValueError("prompt is empty; give some text or token ids")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"prompt ids must be non-negative ints, position {i} holds {t!r}")
    return ids


def eos_token_ids(target: LoadedModel) -> tuple[int, ...]:
    """End-of-sequence ids of ``target``: its generation config's plus its tokenizer's."""
    found: list[int] = []
    gen_config = getattr(target.model, "generation_config", None)
    for source in (getattr(gen_config, "eos_token_id", None), getattr(target.tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        for t in ([source] if isinstance(source, int) else list(source)):
            if int(t) not in found:
                found.append(int(t))
    return tuple(found)


def stop_rules(target: LoadedModel, max_new_tokens: int, stop_at_eos: bool = True) -> StopRules:
    """The rules a run on ``target`` stops by: its end-of-sequence ids (when
    ``stop_at_eos``), the budget and its context limit."""
    return StopRules(eos_token_ids(target) if stop_at_eos else (), max_new_tokens, target.max_context)


def check_prompt(target: LoadedModel, ids: list[int]) -> None:
    """Check that the prompt ``ids`` leave room for a new token in ``target``'s context
    and lie inside its vocabulary.

    Raises:
        ValueError: a prompt that fills the context, or a token id outside the vocabulary.
    """
    limit = target.max_context
    if len(ids) >= limit:
        raise ValueError(
            f"the prompt has {len(ids)} tokens but {target.name} handles at most {limit}; "
            "shorten it to leave room for at least one new token")
    top = max(ids)
    if top >= target.vocab_size:
        raise ValueError(f"prompt token id {top} is outside the vocabulary of {target.name} ({target.vocab_size})")
