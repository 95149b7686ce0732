"""A cascade of drafters: the first one that proposes something drafts the step
(:class:`FallbackDrafter`).

Prompt lookup costs next to nothing but proposes only where the text repeats; a draft
model proposes everywhere at the price of its forwards. On a CPU, where a draft-model
step costs about a target step, running the model only where lookup has nothing saves its
forwards on exactly the steps where the copy is the better guess anyway. A merged tree
(:class:`~specviz.draft.merged.MergedDrafter`) pays for every part at every step; the
cascade pays for a later part only when the earlier ones stay silent.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from specviz.draft.base import Drafter, drafting_steps
from specviz.draft.composite import CompositeDrafter
from specviz.sampling import require_deterministic_siblings

__all__ = ["FallbackDrafter"]


class FallbackDrafter(CompositeDrafter):
    """Drafters tried in order; the first tree with a drafted token is the step's draft.

    Every part drafts from the same context; a part that returns the root alone ("no
    proposal") passes the step on to the next. If every part is silent the tree is the
    root alone and the engine takes one plain target step. Parts keep their own state
    (a draft model's cache catches up, in one forward, on the tokens committed while it
    was not asked). The returned tree's ``source`` is the index of the part that drafted
    it (at every node), and :attr:`last_part` says the same for the latest step.

    Every part drafts deterministically ("greedy", or "topk" under sampling: its most
    likely tokens), as in a merged tree, so the cascade verifies with a rule for
    deterministic drafts and stays lossless whichever part drafted.

    :meth:`observe` reaches only the part that drafted the step (an adaptive chain learns
    from its own drafts, not from lookup's); target hidden states reach every part that
    reads them, since each must stay in sync with the committed text.

    Args:
        drafters: at least two drafters, cheapest (or most selective) first.

    Raises:
        ValueError: fewer than two parts, or a part that guesses from the target's outputs
            of earlier steps (which it would miss on the steps it does not draft).
        TypeError: a part that is not a :class:`Drafter`.
    """

    outputs_reason = " of every step, which it would miss on the steps another part drafts"

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        drafters = list(drafters)
        if len(drafters) < 2:
            raise ValueError(f"FallbackDrafter needs at least two drafters, got {len(drafters)}")
        super().__init__(drafters)
        self.name = "fallback(" + ">".join(d.name for d in drafters) + ")"
        self.last_part: int | None = None

    def draft_steps(self, context, config, sibling_sampling, generator):
        require_deterministic_siblings("a fallback cascade", config, sibling_sampling)
        mode = "greedy" if config.greedy else "topk"
        tree = None
        for i, d in enumerate(self.drafters):
            tree = yield from drafting_steps(d, context, config, mode, generator)
            if tree.n_nodes > 1:
                self.last_part = i
                return dataclasses.replace(tree, source=torch.full((tree.n_nodes,), i, dtype=torch.long))
        self.last_part = None
        return tree

    def observes(self, part: int, step) -> bool:
        return part == self.last_part

    def reset(self) -> None:
        super().reset()
        self.last_part = None
