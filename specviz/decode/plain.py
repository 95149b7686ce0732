"""Target-only decoding: one token per target forward, the baseline of every speedup.

:func:`plain_generate` decodes one prompt with a KV cache; it is the reference of the
identity tests and, greedy and past end-of-sequence, the continuation the greedy replays
follow. :func:`plain_generate_batch` decodes many prompts at once, one forward per token
for a whole batch of rows, the fast way to record long references (and, with
``features``, the target's hidden states that draft heads learn from).
Both are re-exported by :mod:`specviz.decode.engine`.

Dimension legend: B = batch rows, L = prompt tokens, V = vocabulary, H = hidden size,
T = prompt plus continuation tokens.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from specviz.decode.phases import phase
from specviz.decode.prompts import check_prompt, encode_prompt, stop_rules
from specviz.decode.records import GenerationResult
from specviz.models.kvcache import forward_tokens, new_cache, select_rows, stack_caches
from specviz.models.types import LoadedModel
from specviz.sampling import GREEDY, SamplingConfig, make_generator, probs_from_logits, sample
from specviz.validate import check_int

__all__ = ["plain_generate", "plain_generate_batch"]


@torch.no_grad()
def plain_generate(target: LoadedModel, prompt: str | Sequence[int], *, max_new_tokens: int = 64,
                   config: SamplingConfig = GREEDY, seed: int = 0, chat: bool = True,
                   stop_at_eos: bool = True) -> GenerationResult:
    """Target-only decoding, one token per forward with a KV cache: the baseline for
    speedups and the reference for identity tests.

    Args:
        stop_at_eos: stop after an end-of-sequence token (False keeps going to
            ``max_new_tokens``, which :func:`specviz.decode.replay_acceptance` can use).
        Other arguments as in :func:`speculative_generate`.
    """
    if not isinstance(config, SamplingConfig):
        raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}")
    check_int("max_new_tokens", max_new_tokens)
    ids = encode_prompt(target.tokenizer, prompt, chat)
    check_prompt(target, ids)
    start = time.perf_counter()
    stops = stop_rules(target, max_new_tokens, stop_at_eos)
    generator = make_generator(seed)
    cache = new_cache(target.model)
    tokens = list(ids)
    feed = torch.tensor([ids])  # (1, L)
    reason = ""
    while not reason:
        pos = torch.arange(len(tokens) - feed.shape[1], len(tokens))[None]  # (1, n)
        with phase("prefill" if len(tokens) == len(ids) else "forward"):
            logits = forward_tokens(target.model, cache, feed, pos, None, logits_to_keep=1)[0, -1]  # (V,)
        nxt = _next_token(logits, config, generator)
        _, reason = stops.commit([nxt], len(ids), len(tokens) - len(ids))
        tokens.append(nxt)
        feed = torch.tensor([[nxt]])
    out = tuple(tokens[len(ids):])
    return GenerationResult(
        prompt_ids=tuple(ids), output_ids=out, text=target.tokenizer.decode(list(out), skip_special_tokens=True),
        steps=(), wall_s=time.perf_counter() - start, stop_reason=reason, drafter="none",
        verifier="none", config=config, max_new_tokens=max_new_tokens)


def _next_token(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator) -> int:
    """The token target-only decoding commits after ``logits`` ``(V,)``: the argmax, or one
    draw from ``generator`` when ``config`` samples."""
    if config.greedy:
        return int(logits.argmax())
    return int(sample(probs_from_logits(logits, config), generator)[0])


@torch.no_grad()
def plain_generate_batch(target: LoadedModel, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int = 64,
                         batch_size: int = 16, chat: bool = True, stop_at_eos: bool = True,
                         config: SamplingConfig = GREEDY, seed: int | Sequence[int] = 0,
                         features: bool = False, progress: Callable[[int, int], None] | None = None
                         ) -> list[GenerationResult] | list[tuple[GenerationResult, torch.Tensor]]:
    """Target-only decoding of many prompts, ``batch_size`` rows per forward.

    Each prompt is prefilled alone (the forward :func:`plain_generate` runs, so the first
    new token is the same); then the rows of a batch decode together, one forward per
    token for all of them, which reads the weights once for the whole batch instead of
    once per row: on a CPU, where a one-token forward is bound by the bytes of weights it
    reads, this multiplies the tokens per second. Prompts are batched in order of length
    so that rows of a batch have similar cache lengths (results come back in the order
    given). A row's cache keeps its own slots; the padding between them is masked out.

    Sampling (``config`` with a temperature) draws prompt ``i``'s tokens from its own
    generator, seeded ``seed + i`` (or ``seed[i]``), one draw per token as
    :func:`plain_generate` with that seed draws them: a row samples the same tokens
    whichever rows share its batch, as long as its logits are the same.

    Matrix products over several rows may round differently from one-row products, so a
    row can differ from :func:`plain_generate` where the target's top two tokens are
    a near-tie; in fp32 that is rare (the tests compare both).

    Args:
        prompts: the prompts (strings or token ids), at least one.
        batch_size: rows decoded together (1 decodes the prompts one by one).
        config: greedy (default) or a sampling configuration.
        seed: the first prompt's sampling seed (prompt ``i`` uses ``seed + i``), or one
            seed per prompt.
        features: also return the target's last hidden state (the input of its LM head)
            at every position of each sequence, prompt and continuation, as the decoding
            computed it: the prefill's for the prompt, each step's for the token it fed,
            and one more forward of a finished row for its last token. Draft heads learn
            from these (:func:`specviz.heads.build_corpus`), so their training data needs
            no second, teacher-forced pass over the sequences.
        progress: called as ``progress(tokens, max_new_tokens)`` after each decode forward
            of a batch, ``tokens`` the new tokens of each row so far (from 2: the prefill
            gives the first; every batch counts again), for a caller that reports the time
            left.
        Other arguments as in :func:`plain_generate`.

    Returns:
        One :class:`GenerationResult` per prompt, in order; with ``features``, pairs of it
        and a ``(T, H)`` float32 CPU tensor, ``T = len(prompt_ids) + len(output_ids)``.
    """
    if isinstance(prompts, (str, torch.Tensor)) or not len(prompts):
        raise ValueError("prompts must be a non-empty list of prompts")
    if not isinstance(config, SamplingConfig):
        raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}")
    check_int("max_new_tokens", max_new_tokens)
    check_int("batch_size", batch_size)
    if isinstance(seed, (list, tuple)):
        seeds = [check_int("seed", s, 0) for s in seed]
        if len(seeds) != len(prompts):
            raise ValueError(f"seed lists {len(seeds)} seeds for {len(prompts)} prompts; "
                             "give one per prompt or one int")
    else:
        seeds = [check_int("seed", seed, 0) + i for i in range(len(prompts))]
    encoded = [encode_prompt(target.tokenizer, p, chat) for p in prompts]
    for ids in encoded:
        check_prompt(target, ids)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    results: list = [None] * len(encoded)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        gens = [make_generator(seeds[i]) for i in chunk]
        for i, result in zip(chunk, _plain_batch(target, [encoded[i] for i in chunk], max_new_tokens, stop_at_eos,
                                                 config, gens, features, progress)):
            results[i] = result
    return results


def _plain_batch(target: LoadedModel, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool,
                 config: SamplingConfig, generators: list[torch.Generator], features: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> list:
    """One batch of :func:`plain_generate_batch` (row ``b`` samples with ``generators[b]``;
    with ``features``, a finished row stays for one more forward, which feeds its last
    token for that token's hidden state and samples nothing)."""
    start = time.perf_counter()
    stops = stop_rules(target, max_new_tokens, stop_at_eos)
    caches, tokens, reasons, walls = [], [], [], []
    states: list[list[torch.Tensor]] = [[] for _ in prompts]  # per row: (n, H) hidden states in position order
    for b, ids in enumerate(prompts):
        cache = new_cache(target.model)
        pos = torch.arange(len(ids))[None]  # (1, L)
        logits = forward_tokens(target.model, cache, torch.tensor([ids]), pos, None, logits_to_keep=1,
                                hidden=features)
        if features:
            logits, hid = logits
            states[b].append(hid[0].float().cpu())  # (L, H)
        nxt = _next_token(logits[0, -1], config, generators[b])
        _, reason = stops.commit([nxt], len(ids), 0)
        caches.append(cache)
        tokens.append(list(ids) + [nxt])
        reasons.append(reason)
        walls.append(time.perf_counter() - start if reason else 0.0)
    active = [b for b, r in enumerate(reasons) if features or not r]
    lengths = [len(prompts[b]) for b in active]  # real cache slots of each active row
    cache = stack_caches(target.model, [caches[b] for b in active]) if active else None
    del caches
    smax = max(lengths) if active else 0
    step = 0  # slots appended after the padded length smax
    while active:
        rows = len(active)
        feed = torch.tensor([[tokens[b][-1]] for b in active])  # (B, 1)
        pos = torch.tensor([[n + step] for n in lengths])  # (B, 1)
        allowed = torch.zeros(rows, 1, smax + step + 1, dtype=torch.bool)  # (B, 1, Smax + step + 1)
        for r, n in enumerate(lengths):
            allowed[r, 0, :n] = True
        allowed[:, 0, smax:] = True
        logits = forward_tokens(target.model, cache, feed, pos, allowed, hidden=features)
        if features:
            logits, hid = logits
            hid = hid[:, -1].float().cpu()  # (B, H)
        logits = logits[:, -1]  # (B, V)
        step += 1
        if progress is not None:
            progress(min(step + 1, max_new_tokens), max_new_tokens)
        keep = []
        for r, b in enumerate(active):
            if features:
                states[b].append(hid[r:r + 1])
                if reasons[b]:  # its last token's state is in: the row is done
                    continue
            nxt = _next_token(logits[r], config, generators[b])
            _, reason = stops.commit([nxt], len(prompts[b]), len(tokens[b]) - len(prompts[b]))
            tokens[b].append(nxt)
            if reason:
                reasons[b], walls[b] = reason, time.perf_counter() - start
            if features or not reason:
                keep.append(r)
        if len(keep) < rows:
            if not keep:
                break
            select_rows(cache, keep)
            active = [active[r] for r in keep]
            lengths = [lengths[r] for r in keep]
    out = []
    for b, ids in enumerate(prompts):
        new = tuple(tokens[b][len(ids):])
        result = GenerationResult(
            prompt_ids=tuple(ids), output_ids=new, text=target.tokenizer.decode(list(new), skip_special_tokens=True),
            steps=(), wall_s=walls[b], stop_reason=reasons[b], drafter="none", verifier="none", config=config,
            max_new_tokens=max_new_tokens)
        if features:
            hid = torch.cat(states[b])  # (T, H): every position fed once
            if hid.shape[0] != len(tokens[b]):
                raise RuntimeError(f"kept {hid.shape[0]} hidden states for {len(tokens[b])} positions")
            out.append((result, hid))
        else:
            out.append(result)
    return out
