"""Composite drafters: a drafter made of other drafters (its parts), each drafting from the
same context. :class:`CompositeDrafter` is what :mod:`~specviz.draft.merged`,
:mod:`~specviz.draft.fallback`, :mod:`~specviz.draft.switch` and :mod:`~specviz.draft.chooser`
share: the check of the parts, who observes which step, features handed to every part,
reset, spawn and tokenizers.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Sequence

from specviz.draft.base import Drafter, run_draft_steps, spawn, tokenizers_of
from specviz.tree.core import DraftTree

__all__ = ["CompositeDrafter"]


class CompositeDrafter(Drafter):
    """A drafter made of other drafters (its parts), each drafting from the same context:
    what :class:`~specviz.draft.merged.MergedDrafter` and
    :class:`~specviz.draft.fallback.FallbackDrafter` share. Parts must be drafters that do
    not guess from the target's outputs of earlier steps (:attr:`outputs_reason` says why,
    in the error); the parts that read the target's hidden states observe every step (their
    features follow the context), the others only what :meth:`observes` says;
    :meth:`reset`, :meth:`spawn` and :attr:`tokenizers` cover every part. Subclasses check
    the number of parts before calling ``__init__``, and :meth:`draft` runs
    :meth:`draft_steps`.
    """

    #: ends the error for a part that guesses from the target's outputs
    outputs_reason: str = ""

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        drafters = list(drafters)
        for i, d in enumerate(drafters):
            if not isinstance(d, Drafter):
                raise TypeError(f"drafters[{i}] must be a Drafter, got {type(d).__name__}")
            if "logits" in d.reads:
                raise ValueError(f"drafters[{i}] ({d.name}) guesses from the target's outputs{self.outputs_reason}; "
                                 "run it on its own")
        self.drafters = drafters
        # trained heads among the parts read the target's hidden states at the tree's nodes
        self.reads = frozenset().union(*(d.reads for d in drafters))

    @property
    def heads_path(self):
        """The trained heads' result directory of the first part that drafts with heads
        (None if none does): what the benchmark records beside the name."""
        return next((d.heads_path for d in self.drafters if getattr(d, "heads_path", None) is not None), None)

    def observes(self, part: int, step) -> bool:
        """Whether part ``part`` learns from ``step`` beyond the hidden states (none do here;
        a cascade's part learns from the steps it drafted)."""
        return False

    def observe(self, step, outputs=None) -> None:
        for i, d in enumerate(self.drafters):
            if "hidden" in d.reads or (step is not None and self.observes(i, step)):
                d.observe(step, outputs)

    def provide_features(self, token_ids, features) -> None:
        """Hand the target's features of a sequence to every part that drafts from them
        (trained heads: :meth:`~specviz.draft.heads._HeadDrafter.provide_features`), so
        that a replay of the composite runs no target forward of its own; parts that read
        no features ignore them."""
        for d in self.drafters:
            if hasattr(d, "provide_features"):
                d.provide_features(token_ids, features)

    def draft(self, context, config, sibling_sampling, generator) -> DraftTree:
        return run_draft_steps(self.draft_steps(context, config, sibling_sampling, generator))

    @abstractmethod
    def draft_steps(self, context, config, sibling_sampling, generator):
        """See :class:`Stepwise`."""

    def reset(self) -> None:
        for d in self.drafters:
            d.reset()

    def spawn(self) -> "CompositeDrafter":
        return type(self)([spawn(d) for d in self.drafters])

    @property
    def tokenizers(self) -> tuple:
        return tuple(t for d in self.drafters for t in tokenizers_of(d))
