"""One sequence of a speculative run, and the checks every step of it makes.

:class:`Row` is the per-sequence state of a running batch (the speculative engine) or of
one replay (:func:`~specviz.decode.replay.replay_acceptance`); :func:`check_drafter`,
:func:`checked_tree` and :func:`limit_depth` check a drafter and the tree it proposes, and
trim the tree to the room left (both at once: :func:`step_tree`); :func:`finish_row` turns a finished row into its
:class:`~specviz.decode.records.GenerationResult`.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from specviz.decode.records import GenerationResult, StepTrace, StopRules
from specviz.draft.base import TARGET_OUTPUTS, Drafter, tokenizers_of
from specviz.models.loading import check_same_tokenizer
from specviz.models.types import LoadedModel
from specviz.sampling import SamplingConfig
from specviz.tree.core import DraftTree, depths

__all__ = ["Row", "check_drafter", "checked_tree", "limit_depth", "step_tree", "finish_row"]


class Row:
    """Per-sequence state of a running batch (or of one replay): the prompt, the committed
    tokens, the row's drafter and generator, its step traces, and why and when it stopped."""

    def __init__(self, prompt: list[int], drafter: Drafter, generator: torch.Generator) -> None:
        """A row that has committed nothing beyond ``prompt`` yet."""
        self.prompt = prompt
        self.tokens = list(prompt)  # committed: prompt + generated
        self.drafter = drafter
        self.generator = generator
        self.steps: list[StepTrace] = []
        self.stop_reason = ""
        self.wall_s = 0.0

    @property
    def generated(self) -> int:
        """Tokens committed after the prompt."""
        return len(self.tokens) - len(self.prompt)

    def commit(self, tokens: Sequence[int], stops: StopRules) -> None:
        """Append a step's tokens (cut at end-of-sequence) and note why the row stops."""
        committed, self.stop_reason = stops.commit(tokens, len(self.prompt), self.generated)
        self.tokens.extend(committed)


def check_drafter(target: LoadedModel, drafter: Drafter) -> None:
    """Check that ``drafter`` is a specviz Drafter whose tokenizers match ``target``'s.

    Raises:
        TypeError: not a :class:`~specviz.draft.base.Drafter`.
        ValueError: a drafter whose ``reads`` names an output the target does not give.
        TokenizerMismatchError: a tokenizer that differs from the target's
            (:func:`~specviz.models.loading.check_same_tokenizer`).
    """
    if not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a specviz Drafter, got {type(drafter).__name__}")
    unknown = sorted(set(drafter.reads) - TARGET_OUTPUTS)
    if unknown:
        raise ValueError(f"drafter {drafter.name!r} reads {unknown}, which the target does not output; "
                         f"a drafter reads some of {sorted(TARGET_OUTPUTS)}")
    for tok in tokenizers_of(drafter):
        if tok is not target.tokenizer:
            check_same_tokenizer(target.tokenizer, tok)


def checked_tree(tree, drafter: Drafter, context: list[int], vocab: int) -> DraftTree:
    """The drafter's tree, validated; None (no proposal) becomes a root-only tree."""
    if tree is None:
        return DraftTree.from_lists([context[-1]], [-1])
    if not isinstance(tree, DraftTree):
        raise TypeError(f"drafter {drafter.name!r} returned {type(tree).__name__}, expected a DraftTree")
    if int(tree.tokens[0]) != context[-1]:
        raise ValueError(f"drafter {drafter.name!r} returned a tree rooted at token {int(tree.tokens[0])}; "
                         f"the root must be the last committed token {context[-1]}")
    top = int(tree.tokens.max())
    if top >= vocab:
        raise ValueError(f"drafter {drafter.name!r} proposed token id {top}, outside the target's vocabulary ({vocab})")
    return tree


def limit_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """``tree`` without nodes deeper than ``max_depth``."""
    d = depths(tree)
    if int(d.max()) <= max_depth:
        return tree
    return tree.subtree(torch.nonzero(d <= max_depth).flatten().tolist())


def step_tree(row: Row, tree, stops: StopRules, vocab: int) -> DraftTree:
    """The tree ``row``'s drafter proposed (:func:`checked_tree`), trimmed to the room the
    row has left (:func:`limit_depth`: one token of it goes to the bonus)."""
    tree = checked_tree(tree, row.drafter, row.tokens, vocab)
    room = stops.room(len(row.prompt), row.generated)
    return limit_depth(tree, room - 1)


def finish_row(target: LoadedModel, row: Row, start: float, drafter_name: str, verifier: str,
               config: SamplingConfig, max_new_tokens: int) -> GenerationResult:
    """The :class:`~specviz.decode.records.GenerationResult` of a finished ``row``; its wall
    time is the one noted when it stopped, else the time since ``start``."""
    out = tuple(row.tokens[len(row.prompt):])
    return GenerationResult(
        prompt_ids=tuple(row.prompt), output_ids=out,
        text=target.tokenizer.decode(list(out), skip_special_tokens=True),
        steps=tuple(row.steps), wall_s=row.wall_s or time.perf_counter() - start,
        stop_reason=row.stop_reason, drafter=drafter_name, verifier=verifier, config=config,
        max_new_tokens=max_new_tokens)
