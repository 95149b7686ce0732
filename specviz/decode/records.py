"""What decoding records, and when a sequence stops.

* :class:`StepTrace` - one speculative step in full (tree, acceptance, target and draft
  probabilities, the exact expected acceptance, wall times), as the engine and
  :func:`~specviz.decode.replay_acceptance` record it;
* :class:`StepRecord` - the same step reduced to the counts acceptance metrics need;
  replays of static shapes and dynamic trees produce these directly, and
  :func:`records_from_steps` / :func:`records_from_result` derive them from traces, so
  every metric of :mod:`specviz.metrics` is computed from one record type;
* :class:`GenerationResult` - one generated sequence and its traces;
* :class:`StopRules` - the stopping rules every decoder and replay follows.

Dimension legend: N = tree nodes including the root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from specviz.sampling import GREEDY, SamplingConfig
from specviz.tree.core import DraftTree, children_lists
from specviz.tree.side import SideBranch
from specviz.verify.rules import Acceptance

__all__ = [
    "STOP_REASONS",
    "StopRules",
    "StepTrace",
    "StepRecord",
    "GenerationResult",
    "records_from_steps",
    "records_from_result",
    "result_from_row",
]

#: why a sequence stopped: an end-of-sequence token, the token budget, the model's context
STOP_REASONS = ("eos", "max_new_tokens", "context_limit")


@dataclass(frozen=True)
class StopRules:
    """When a sequence stops, in the order checked: an end-of-sequence token, the token
    budget, the model's context (:data:`STOP_REASONS`).

    Attributes:
        eos: end-of-sequence ids (empty: never stop on a token).
        max_new_tokens: token budget.
        max_context: most tokens (prompt included) the model handles; None for no limit.
    """

    eos: tuple[int, ...]
    max_new_tokens: int
    max_context: int | None = None

    def room(self, prompt_len: int, generated: int) -> int:
        """Tokens the next step may commit after ``generated`` new tokens."""
        room = self.max_new_tokens - generated
        if self.max_context is not None:
            room = min(room, self.max_context - (prompt_len + generated))
        return room

    def commit(self, tokens: Sequence[int], prompt_len: int, generated: int) -> tuple[list[int], str]:
        """``tokens`` up to and including the first end-of-sequence token, and why the
        sequence stops after committing them ("" when it goes on)."""
        for i, t in enumerate(tokens):
            if t in self.eos:
                return list(tokens[:i + 1]), "eos"
        new = generated + len(tokens)
        if new >= self.max_new_tokens:
            return list(tokens), "max_new_tokens"
        if self.max_context is not None and prompt_len + new >= self.max_context:
            return list(tokens), "context_limit"
        return list(tokens), ""


@dataclass(frozen=True)
class StepTrace:
    """One speculative step of one sequence.

    Attributes:
        step: 0-based step index within the sequence.
        tree: the verified draft tree (after trimming to the remaining budget), without
            its ``draft_probs`` unless the run kept them; ``tree.q`` holds the draft
            probability of every node.
        acceptance: what the verifier kept.
        target_token_probs: ``(N,)`` target probability of each node's token at its
            parent (root = 1.0; NaN in replay, which never runs the target on the tree).
        expected_accepted: exact expected accepted draft tokens of this step under
            the verifier's rule (NaN when the run skipped the analysis).
        draft_time_s: wall time of the drafting phase (in a batch, all rows draft together
            and share this time).
        verify_time_s: wall time of the target forward plus the verification rule
            (the forward is shared by all rows of a batch; 0 in replay).
        drafter: the drafter's name.
        context_len: committed tokens (prompt included) before the step.
        side: what the step fed beside the tree (a :class:`~specviz.tree.SideBranch`,
            e.g. lookahead's window), or None.
    """

    step: int
    tree: DraftTree
    acceptance: Acceptance
    target_token_probs: torch.Tensor
    expected_accepted: float
    draft_time_s: float
    verify_time_s: float
    drafter: str
    context_len: int
    side: SideBranch | None = None

    @property
    def side_tokens(self) -> int:
        """Tokens the step fed beside the tree."""
        return 0 if self.side is None else self.side.size

    @property
    def fed_tokens(self) -> int:
        """New tokens the step's target call processed (tree nodes plus side tokens)."""
        return self.tree.n_nodes + self.side_tokens


@dataclass(frozen=True)
class StepRecord:
    """One replayed (or live) speculative step, reduced to what acceptance metrics need.

    Attributes:
        step: 0-based step index within the sequence.
        position: tokens generated before the step.
        drafted: draft nodes verified (root excluded), after trimming to the room left.
        depth: depth of the verified tree.
        accepted: draft tokens accepted.
        extendable: the last node of the accepted path had children, i.e. the path was
            stopped by a rejection at depth ``accepted + 1`` rather than by a leaf (this
            decides the per-depth trials of :func:`specviz.metrics.per_depth_acceptance`).
        committed: tokens the step committed (accepted + bonus, cut at end-of-sequence).
    """

    step: int
    position: int
    drafted: int
    depth: int
    accepted: int
    extendable: bool
    committed: int


@dataclass(frozen=True)
class GenerationResult:
    """One generated sequence and how it was produced.

    Attributes:
        prompt_ids: the prompt token ids (after the chat template).
        output_ids: the new token ids (an end-of-sequence token, if any, included last).
        text: ``output_ids`` decoded without special tokens.
        steps: one :class:`StepTrace` per target call (empty for target-only decoding).
        wall_s: wall time from the start of the call until this sequence finished.
        stop_reason: one of :data:`STOP_REASONS`.
        drafter: the drafter's name ("none" for target-only decoding).
        verifier: the verification rule's name.
        config: the sampling configuration.
        max_new_tokens: the token budget the run had.
    """

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    text: str
    steps: tuple[StepTrace, ...]
    wall_s: float
    stop_reason: str
    drafter: str
    verifier: str
    config: SamplingConfig
    max_new_tokens: int

    @property
    def n_steps(self) -> int:
        """Target calls after the prompt."""
        return len(self.steps)

    @property
    def n_new_tokens(self) -> int:
        return len(self.output_ids)


def records_from_steps(steps: Sequence[StepTrace], new_tokens: int | None = None) -> tuple[StepRecord, ...]:
    """Step traces as :class:`StepRecord` objects.

    Args:
        steps: the traces of one sequence, in order.
        new_tokens: the sequence's output length; steps commit at most up to it (an
            end-of-sequence token cuts the last step). None: every step commits its
            accepted tokens plus the bonus.
    """
    out = []
    generated = 0
    for s in steps:
        acc = s.acceptance
        committed = acc.tau if new_tokens is None else min(acc.tau, new_tokens - generated)
        out.append(StepRecord(step=s.step, position=generated, drafted=s.tree.budget, depth=s.tree.depth,
                              accepted=acc.n_accepted, extendable=bool(children_lists(s.tree)[acc.last_node]),
                              committed=committed))
        generated += committed
    return tuple(out)


def records_from_result(result: GenerationResult) -> tuple[StepRecord, ...]:
    """The steps of a live run or of :func:`specviz.decode.replay_acceptance` as records."""
    if not isinstance(result, GenerationResult):
        raise TypeError(f"result must be a GenerationResult, got {type(result).__name__}")
    return records_from_steps(result.steps, len(result.output_ids))


def result_from_row(row: Mapping[str, Any], max_new_tokens: int) -> GenerationResult:
    """A stored greedy generation (a reference's row, or a timed run's row; both hold
    ``prompt_ids``, ``output_ids`` and ``wall_s``) as a :class:`~specviz.decode.GenerationResult`,
    e.g. for :func:`~specviz.study.units.rank_units`; ``text`` and ``stop_reason`` are empty where the row has none."""
    return GenerationResult(prompt_ids=tuple(int(t) for t in row["prompt_ids"]),
                            output_ids=tuple(int(t) for t in row["output_ids"]), text=str(row.get("text", "")),
                            steps=(), wall_s=float(row["wall_s"]), stop_reason=str(row.get("stop_reason", "")),
                            drafter="none", verifier="none", config=GREEDY, max_new_tokens=max_new_tokens)
