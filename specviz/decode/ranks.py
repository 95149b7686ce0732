"""What a draft model would accept along a known continuation: teacher-forced ranks.

Under greedy decoding a node's child of rank ``r`` is accepted iff the target's next
token is the draft's rank-``r`` candidate there. Along the accepted path the draft only
ever reads the target's own tokens, so one teacher-forced draft forward over prompt +
continuation gives the rank of every continuation token (:func:`draft_ranks`), from
which :func:`specviz.decode.replay_shape` replays any static shape, and
:func:`positional_acceptance` gives the ``a_1..a_K`` vector Sequoia's dynamic program
needs.

Dimension legend: P = prompt tokens, T = continuation tokens, V = vocabulary, K = ranks
considered.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from specviz.models.device import model_device
from specviz.models.types import LoadedModel
from specviz.quant.passes import prompt_in_one_pass
from specviz.tree.sequoia import positional_acceptance_from_counts
from specviz.validate import check_int

__all__ = ["draft_ranks", "draft_candidates", "positional_acceptance"]


@torch.no_grad()
def draft_ranks(draft, prompt_ids: Sequence[int], continuation: Sequence[int], *, max_rank: int = 64) -> torch.Tensor:
    """Rank of every continuation token in the draft's distribution, teacher-forced.

    Rank 0 means the draft's top-1 candidate at that position is the continuation's
    token. One forward of the draft over the prompt and the continuation.

    Args:
        draft: a :class:`~specviz.models.LoadedModel` or a transformers causal LM.
        prompt_ids: the prompt's token ids.
        continuation: the tokens that followed (e.g. a greedy reference's ``output_ids``).
        max_rank: ranks at or above this are reported as ``max_rank`` ("not among the
            first ``max_rank`` candidates").

    Returns:
        ``(T,)`` long tensor.
    """
    check_int("max_rank", max_rank)
    _, ranks = _teacher_forced(draft, prompt_ids, continuation)
    return ranks.clamp(max=max_rank)


def _teacher_forced(draft, prompt_ids: Sequence[int], continuation: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T, V)`` CPU float32 draft logits at every continuation position (one forward over
    the prompt and the continuation) and the ``(T,)`` unclamped rank of each continuation token."""
    model = draft.model if isinstance(draft, LoadedModel) else draft
    cont = [int(t) for t in continuation]
    prompt = [int(t) for t in prompt_ids]
    if not cont or not prompt:
        raise ValueError(f"need a non-empty prompt and continuation, got {len(prompt)} and {len(cont)} tokens")
    ids = torch.tensor([prompt + cont[:-1]], device=model_device(model))  # (1, P + T - 1)
    with prompt_in_one_pass([model], len(prompt)):  # the prompt's rows as a live prefill computes them
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(cont)).logits[0].float().cpu()  # (T, V)
    target = torch.tensor(cont)[:, None]  # (T, 1)
    return logits, (logits > logits.gather(1, target)).sum(dim=1)  # (T, V), (T,)


@torch.no_grad()
def draft_candidates(draft, prompt_ids: Sequence[int], continuation: Sequence[int], *, k: int = 8,
                     max_rank: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's top-``k`` candidate probabilities at every continuation position, and
    the rank of the continuation's token among them, teacher-forced (one draft forward).

    Under greedy verification a draft node whose parent is on the accepted path is
    accepted iff it holds the target's token, so ``(probs[t, r], ranks[t] == r)`` pairs
    are the (confidence, accepted) outcomes of every reachable node a rank-ordered tree
    can draft at position ``t``: the data of a calibration study.

    Args:
        draft: a :class:`~specviz.models.LoadedModel` or a transformers causal LM.
        prompt_ids, continuation: as in :func:`draft_ranks`.
        k: candidates per position.
        max_rank: ranks at or above it are reported as ``max_rank``.

    Returns:
        ``(probs, ranks)``: ``(T, k)`` float32 softmax probabilities of the draft's
        top-``k`` tokens (temperature 1), ``(T,)`` long ranks.
    """
    check_int("k", k)
    check_int("max_rank", max_rank)
    logits, ranks = _teacher_forced(draft, prompt_ids, continuation)
    probs = torch.softmax(logits, dim=-1).topk(min(k, logits.shape[-1]), dim=-1).values  # (T, k)
    return probs, ranks.clamp(max=max_rank)


def positional_acceptance(ranks: torch.Tensor | Iterable[torch.Tensor], k: int = 8) -> tuple[float, ...]:
    """Sequoia's positional acceptance vector from teacher-forced ranks: ``a_j`` = share of
    positions whose target token is the draft's rank-``j - 1`` candidate, ``j = 1..k``.

    Under greedy decoding the accepted child is the one holding the target's token, so
    this is exactly "the chance that the j-th ranked child is the accepted one".

    Args:
        ranks: one ``(T,)`` tensor or several (pooled).
        k: entries of the vector (children per node considered).
    """
    parts = [ranks] if isinstance(ranks, torch.Tensor) else list(ranks)
    if not parts:
        raise ValueError("ranks must hold at least one tensor")
    pooled = torch.cat([torch.as_tensor(p).flatten() for p in parts])
    counts = torch.bincount(pooled.clamp(max=k), minlength=k + 1)[:k]  # (k,)
    return positional_acceptance_from_counts([int(c) for c in counts], int(pooled.numel()))
