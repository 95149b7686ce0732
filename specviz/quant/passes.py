"""The prompt in one activation pass: how the token modes prefill.

``w8a8-token`` and ``w4a8-token`` quantize each token's activations to int8 and, by default,
run a second int8 pass over the rounding residual (:class:`~specviz.quant.weights.W8A8TokenLinear`,
:class:`~specviz.quant.w4a8.W4A8TokenLinear`). The second pass is what makes decoding
accurate; over a prompt it mostly costs time. A prefill is compute-bound (every weight is
used by every prompt token), and the second pass doubles the rows of every product: on a
2-core AMD EPYC (AVX512-BF16 and AVX-512 VNNI), the 1.5B target prefilled 227 tokens in
2.6-3.0 s with both passes and in 1.22-1.23 s with one (43 tokens: 436-451 against 258-277
ms; fbgemm's integer product, three rounds alternated). Its teacher-forced greedy agreement with fp32 over the generated positions stayed the same
(0.979 on the project's 7 prompts x 64 tokens, fed 4 per forward, either way): the
prompt's keys and values are rounded a little more, and every generated token is still
computed in both passes.

So in the token modes the **prompt's positions run in one pass and every later position in
the layer's own passes**. A forward tells its layers where it stands with
:func:`prompt_positions` (:func:`~specviz.models.kvcache.forward_tokens` does for every
forward: a forward onto an empty cache is all prompt, any later one none of it), and a
layer computes the rows of prompt positions in one pass and the others in its own passes,
each row on its own, so the result does not depend on how a sequence is cut into forwards
as long as the prompt is the same. transformers' ``generate()`` (plain, assisted, prompt
lookup) gets the same rule from :func:`prompt_in_one_pass`, which tells it the prompt's
length: assisted generation's first forward holds the prompt and the first drafted tokens,
and only the prompt's rows go in one pass. A forward outside both runs every row in the
layer's own passes.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterable

import torch

__all__ = ["prompt_positions", "prompt_rows", "whole_forward_in_prompt", "by_position", "prompt_in_one_pass"]

#: (prompt length, the forward's first position, its new tokens) while a forward runs under
#: :func:`prompt_positions` with prompt positions in it; None otherwise
_PROMPT: contextvars.ContextVar = contextvars.ContextVar("specviz_prompt_positions", default=None)


def _state(prompt_len: int, start: int, new: int):
    """What :data:`_PROMPT` holds for a forward of ``new`` tokens from position ``start``."""
    return (int(prompt_len), int(start), int(new)) if prompt_len > start else None


@contextlib.contextmanager
def prompt_positions(prompt_len: int, start: int, new: int):
    """Within the block, a forward of ``new`` tokens at positions ``start ..
    start + new - 1`` of a sequence whose first ``prompt_len`` positions are its prompt:
    the token modes' layers compute the rows of prompt positions in one activation pass.
    ``prompt_len <= start`` (no prompt position in the forward) runs every row in the
    layers' own passes, also inside an outer block."""
    token = _PROMPT.set(_state(prompt_len, start, new))
    try:
        yield
    finally:
        _PROMPT.reset(token)


def prompt_rows(x: torch.Tensor) -> int:
    """How many leading rows of a layer's input ``x`` (rows along its next-to-last
    dimension; they are the forward's last rows: all of them in a decoder layer, the kept
    ones in an LM head) are prompt positions under :func:`prompt_positions` (0 outside it)."""
    state = _PROMPT.get()
    if state is None:
        return 0
    prompt_len, start, new = state
    rows = x.shape[-2] if x.dim() >= 2 else 1
    first = start + new - rows  # the position of x's first row
    return max(0, min(rows, prompt_len - first))


def whole_forward_in_prompt() -> bool:
    """Whether every position of the running forward is a prompt position."""
    state = _PROMPT.get()
    return state is not None and state[0] >= state[1] + state[2]


def by_position(layer, x: torch.Tensor, run: Callable[[torch.Tensor, bool], torch.Tensor]) -> torch.Tensor:
    """``layer``'s output for ``x`` with ``run(rows, residual)``: prompt rows in one pass
    (``residual=False``), the rest in ``layer.residual``'s passes."""
    k = prompt_rows(x) if layer.residual else 0
    if k == 0:
        return run(x, layer.residual)
    if x.dim() < 2 or k == x.shape[-2]:
        return run(x, False)
    return torch.cat([run(x[..., :k, :], False), run(x[..., k:, :], True)], dim=-2)


@contextlib.contextmanager
def prompt_in_one_pass(models: Iterable, prompt_len: int):
    """transformers' forwards of ``models`` (``model(...)``, as ``generate()`` calls them)
    follow :func:`prompt_positions` for a prompt of ``prompt_len`` tokens within the block:
    each forward's position comes from its cache's length (``past_key_values``), its new
    tokens from ``input_ids`` (or ``inputs_embeds``)."""
    handles = []
    stack: list = []

    def before(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        start = 0 if cache is None else int(cache.get_seq_length())
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = args[0] if args else kwargs.get("inputs_embeds")
        # a call without new tokens this rule can place runs in the layers' own passes
        placed = ids is not None and ids.dim() >= 2
        stack.append(_PROMPT.set(_state(prompt_len, start, ids.shape[1]) if placed else None))

    def after(module, args, kwargs, output):
        if stack:
            _PROMPT.reset(stack.pop())

    try:
        for model in {id(m): m for m in models if m is not None}.values():
            handles.append(model.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(model.register_forward_hook(after, with_kwargs=True, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
