"""Named phases of a decoding run, as ranges torch's profiler records.

The engine (:func:`~specviz.decode.speculative_generate`, :func:`~specviz.decode.plain_generate`)
wraps each part of a step in :func:`phase`; outside a profiler the ranges cost a few
microseconds a step. :func:`specviz.bench.profile.profile_method` reads them back to say
where a run's time goes.
"""

from __future__ import annotations

from torch.profiler import record_function

__all__ = ["PHASES", "PHASE_PREFIX", "phase"]

#: prefix of the profiler ranges the engine opens
PHASE_PREFIX = "specviz::"

#: the phases, in the order of a step, and what each covers
PHASES = {
    "prefill": "the target's forward over the prompt (and its hidden states for head drafters)",
    "draft": "the drafter's proposal: draft-model or head forwards, its own prefill, n-gram lookups, side branches",
    "tree": "checking and trimming the trees, and padding them into one batch with its attention mask",
    "forward": "the target's forward over the tree (one token per forward in plain decoding)",
    "verify": "the verification rule on the target's logits (and the per-node analysis when asked)",
    "update": "handing the drafter the target's logits and hidden states, committing the tokens",
    "cache": "dropping finished rows and moving the accepted nodes' keys and values into place",
}


def phase(name: str) -> record_function:
    """A context manager marking ``name`` (one of :data:`PHASES`) for the profiler."""
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; valid: {', '.join(PHASES)}")
    return record_function(PHASE_PREFIX + name)
