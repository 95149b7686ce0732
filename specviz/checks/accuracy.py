"""How far a lossy weight mode moves a model's greedy choices from the fp32 reference.

Teacher-forced top-1 agreement: feed one token sequence (a prompt and the reference's own
greedy continuation) to both models in one forward, take the argmax at every position and
count how often they agree. With greedy speculative decoding, a mode's agreement bounds how
often its output can follow the reference's token for token.

:func:`reference_texts` runs the reference once per prompt, or on a batch of prompts at a
time (continuation and argmax); :func:`agreement_table` then needs only the model under
test, so the reference and each mode can be loaded one at a time;
:func:`agreement_by_category` sums the table up.

Dimension legend: L = tokens of prompt + continuation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import pandas as pd
import torch

from specviz.decode.engine import plain_generate, plain_generate_batch
from specviz.models.kvcache import forward_tokens, new_cache
from specviz.models.types import LoadedModel
from specviz.data.prompts import Prompt
from specviz.validate import check_int

__all__ = [
    "ReferenceText",
    "greedy_choices",
    "teacher_forced_agreement",
    "reference_texts",
    "agreement_table",
    "agreement_by_category",
    "accuracy_bar",
    "LOSSY_MARGIN",
]

LOSSY_MARGIN = 0.02  # a mode more than this below bf16's pooled agreement is lossy


@dataclass(frozen=True)
class ReferenceText:
    """A prompt, the reference model's greedy continuation, and its choices along them.

    Attributes:
        question_id, category: the prompt's id and category.
        token_ids: prompt (chat template applied) then continuation, ``L`` ids.
        prompt_len: tokens of the prompt.
        reference_choices: the reference's argmax next token at each of the ``L`` positions.
    """

    question_id: int
    category: str
    token_ids: tuple[int, ...]
    prompt_len: int
    reference_choices: tuple[int, ...]


@torch.no_grad()
def greedy_choices(model: LoadedModel, token_ids: Sequence[int], prompt_len: int | None = None,
                   chunk: int | None = None) -> torch.Tensor:
    """The argmax next token at every position of ``token_ids``: (L,).

    With ``chunk`` None, from one forward. Otherwise the first ``prompt_len`` tokens go in
    one forward (the prefill) and the rest through the KV cache ``chunk`` tokens at a time,
    as decoding (1) or verification (a few) feeds them: the way to measure a mode as
    decoding computes it (the token modes run a prompt's rows in one activation pass and
    the later rows in two, :mod:`specviz.quant.passes`).
    """
    ids = torch.tensor([list(token_ids)])  # (1, L)
    length = ids.shape[1]
    if length < 1:
        raise ValueError("token_ids is empty")
    if chunk is None:
        logits = forward_tokens(model.model, new_cache(model.model), ids, torch.arange(length)[None], None)
        return logits[0].argmax(-1)  # (L,)
    check_int("chunk", chunk)
    if prompt_len is None or not 1 <= prompt_len <= length:
        raise ValueError(f"prompt_len must be in 1..{length} when chunk is given, got {prompt_len}")
    cache = new_cache(model.model)
    bounds = [0, prompt_len, *range(prompt_len + chunk, length, chunk), length]
    choices = [forward_tokens(model.model, cache, ids[:, a:b], torch.arange(a, b)[None], None)[0].argmax(-1)
               for a, b in zip(bounds, bounds[1:]) if b > a]
    return torch.cat(choices)  # (L,)


def teacher_forced_agreement(reference_model: LoadedModel, model: LoadedModel, token_ids: Sequence[int]) -> float:
    """Fraction of the positions of ``token_ids`` where ``model``'s argmax equals
    ``reference_model``'s (both teacher-forced on the same tokens)."""
    ref = greedy_choices(reference_model, token_ids)
    return float((greedy_choices(model, token_ids) == ref).float().mean())


def reference_texts(reference: LoadedModel, prompts: Sequence[Prompt], max_new_tokens: int = 64, *,
                    batch_size: int = 1, progress: Callable[[int, int], None] | None = None) -> list[ReferenceText]:
    """Each prompt (first turn, chat template) with ``reference``'s greedy continuation of
    up to ``max_new_tokens`` tokens and its choices along prompt + continuation.

    With ``batch_size`` above 1 the continuations are decoded that many prompts together
    (:func:`~specviz.decode.plain_generate_batch`, several times the tokens per second on a
    CPU; ``progress`` as there), and the choices are read off the hidden states that decoding
    computed (the prefill's at the prompt, each step's at the token it fed), through the
    reference's LM head, instead of a second forward over every text. A batched row may break
    a near-tie of the reference's top two tokens the other way; the choices every agreement
    is scored on are the reference's own along whichever continuation it decoded, so the
    text stays a fair test.
    """
    check_int("max_new_tokens", max_new_tokens)
    check_int("batch_size", batch_size)
    texts = []
    if batch_size == 1:
        for prompt in prompts:
            run = plain_generate(reference, prompt.text, max_new_tokens=max_new_tokens)
            ids = run.prompt_ids + run.output_ids
            texts.append(ReferenceText(prompt.question_id, prompt.category, ids, len(run.prompt_ids),
                                       tuple(greedy_choices(reference, ids).tolist())))
        return texts
    runs = plain_generate_batch(reference, [p.text for p in prompts], max_new_tokens=max_new_tokens,
                                batch_size=batch_size, progress=progress, features=True)
    head = reference.model.get_output_embeddings()
    for prompt, (run, hidden) in zip(prompts, runs):  # hidden: (T, H), one row per token of the text
        ids = run.prompt_ids + run.output_ids
        with torch.no_grad():
            choices = torch.cat([head(part.to(reference.device, reference.model.dtype)).argmax(-1).cpu()
                                 for part in hidden.split(64)])  # (T,)
        texts.append(ReferenceText(prompt.question_id, prompt.category, ids, len(run.prompt_ids),
                                   tuple(choices.tolist())))
    return texts


def agreement_table(model: LoadedModel, texts: Sequence[ReferenceText], chunk: int | None = None) -> pd.DataFrame:
    """One row per text: ``model``'s teacher-forced top-1 agreement with the reference.

    ``chunk`` as in :func:`greedy_choices` (None: one forward per text; a number: the
    prompt in one forward, the continuation ``chunk`` tokens per forward).

    Returns:
        Columns ``model, weight_mode, question_id, category, positions, matches, agreement``
        (all positions) and ``continuation_positions, continuation_matches,
        continuation_agreement`` (positions from the last prompt token on, i.e. the
        predictions of the generated tokens and the one after).
    """
    rows = []
    for text in texts:
        same = greedy_choices(model, text.token_ids, text.prompt_len, chunk) == torch.tensor(
            text.reference_choices)  # (L,)
        tail = same[text.prompt_len - 1:]
        rows.append({"model": model.name, "weight_mode": model.weight_mode, "chunk": chunk or 0,
                     "question_id": text.question_id,
                     "category": text.category, "positions": len(same), "matches": int(same.sum()),
                     "agreement": float(same.float().mean()), "continuation_positions": len(tail),
                     "continuation_matches": int(tail.sum()), "continuation_agreement": float(tail.float().mean())})
    return pd.DataFrame(rows)


def agreement_by_category(table: pd.DataFrame) -> pd.DataFrame:
    """Pooled agreement per weight mode and category, plus an ``all`` row per mode, from
    one or more concatenated :func:`agreement_table` results.

    Returns:
        Columns ``weight_mode, category, prompts, positions, agreement,
        continuation_agreement`` (matches over positions, pooled over prompts).
    """
    sums = ["positions", "matches", "continuation_positions", "continuation_matches"]
    per_cat = table.groupby(["weight_mode", "category"], sort=False).agg(
        prompts=("question_id", "size"), **{c: (c, "sum") for c in sums}).reset_index()
    overall = table.groupby("weight_mode", sort=False).agg(
        prompts=("question_id", "size"), **{c: (c, "sum") for c in sums}).reset_index().assign(category="all")
    out = pd.concat([per_cat, overall], ignore_index=True).sort_values(["weight_mode", "category"], kind="stable")
    out["agreement"] = out["matches"] / out["positions"]
    out["continuation_agreement"] = out["continuation_matches"] / out["continuation_positions"]
    return out[["weight_mode", "category", "prompts", "positions", "agreement", "continuation_agreement"]].reset_index(
        drop=True)


def accuracy_bar(summary: pd.DataFrame, margin: float = LOSSY_MARGIN,
                 column: str = "continuation_agreement") -> pd.DataFrame:
    """Each weight mode's pooled agreement against the bar: bf16's pooled agreement minus
    ``margin``. A mode below it is ``lossy`` (``auto`` never picks it); fp32 is the
    reference and never lossy. Without a bf16 row the bar is 1 - ``margin``.

    Args:
        summary: :func:`agreement_by_category` output (its ``all`` rows are used).
        column: ``continuation_agreement`` (default: the predictions decoding makes, fed
            as the table was measured) or ``agreement`` (prompt positions too).

    Returns:
        Columns ``weight_mode, agreement, worst_category, worst_agreement, bar, lossy``.
    """
    overall = summary[summary.category == "all"].set_index("weight_mode")
    bf16 = overall[column].get("bf16")
    bar = (1.0 if bf16 is None else float(bf16)) - margin
    rows = []
    for mode, row in overall.iterrows():
        cats = summary[(summary.weight_mode == mode) & (summary.category != "all")]
        worst = cats.loc[cats[column].idxmin()] if len(cats) else None
        rows.append({"weight_mode": mode, "agreement": float(row[column]),
                     "worst_category": None if worst is None else worst["category"],
                     "worst_agreement": None if worst is None else float(worst[column]),
                     "bar": bar, "lossy": bool(mode != "fp32" and row[column] < bar)})
    return pd.DataFrame(rows)
