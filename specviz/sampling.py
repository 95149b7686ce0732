"""Turning logits into the distributions that drafters and verifiers compare.

Lossless speculative sampling only reproduces the target's distribution if the
*same* temperature / top-k / top-p processing is applied to the draft logits and to
the target logits. Both sides therefore call :func:`probs_from_logits` with one
:class:`SamplingConfig`.

How a drafter proposes a node's siblings is set by the verifier's rule, since each
lossless rule assumes one way (:data:`SIBLING_SAMPLING`):

* ``"greedy"`` / ``"topk"`` - siblings are the draft's top-ranked tokens (deterministic);
* ``"iid"`` - siblings are drawn independently from the draft distribution;
* ``"without_replacement"`` - siblings are drawn without replacement.

Under greedy decoding (temperature 0) every mode proposes the top-ranked tokens, since
every lossless rule then reduces to greedy (:func:`siblings_sampled`).

Dimension legend: V = vocabulary size; ``...`` = any leading batch/node axes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specviz.validate import check_choice

__all__ = [
    "SamplingConfig",
    "GREEDY",
    "SIBLING_SAMPLING",
    "check_sibling_sampling",
    "siblings_sampled",
    "require_deterministic_siblings",
    "probs_from_logits",
    "sample",
    "make_generator",
]


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a sampling distribution.

    Attributes:
        temperature: 0 means greedy (argmax, one-hot distribution); > 0 divides logits.
        top_k: keep only the k most likely tokens (0 = off).
        top_p: keep the smallest set of tokens whose mass reaches top_p (1.0 = off).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingConfig()

#: the ways a drafter may propose a node's siblings (see the module docstring)
SIBLING_SAMPLING: tuple[str, ...] = ("greedy", "iid", "without_replacement", "topk")


def check_sibling_sampling(mode: str) -> str:
    """``mode`` if it is one of :data:`SIBLING_SAMPLING`; otherwise raise ValueError."""
    return check_choice("sibling_sampling", mode, SIBLING_SAMPLING)


def siblings_sampled(config: SamplingConfig, sibling_sampling: str) -> bool:
    """Whether siblings are drawn at random: only when sampling (temperature > 0) in mode
    "iid" or "without_replacement"; otherwise they are the draft's top-ranked tokens."""
    return not config.greedy and sibling_sampling not in ("greedy", "topk")


def require_deterministic_siblings(drafter: str, config: SamplingConfig, sibling_sampling: str) -> None:
    """Check ``sibling_sampling`` for a drafter whose siblings are always its top-ranked
    tokens; raise ValueError naming ``drafter`` when the verifier would assume sampled ones."""
    check_sibling_sampling(sibling_sampling)
    if siblings_sampled(config, sibling_sampling):
        raise ValueError(
            f"{drafter} drafts deterministic top-k siblings; under sampling use a verifier with "
            f"sibling_sampling 'topk' (e.g. 'topk' or 'typical'), not {sibling_sampling!r}")


def probs_from_logits(logits: torch.Tensor, config: SamplingConfig = GREEDY) -> torch.Tensor:
    """Apply ``config`` to ``logits`` and return probabilities (fp32, same shape).

    Greedy returns a one-hot distribution on the argmax (ties -> lowest id, as
    ``torch.argmax``).

    Shapes: ``(..., V) -> (..., V)``.
    """
    logits = logits.float()
    if config.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return out
    x = logits / config.temperature
    if config.top_k and config.top_k < x.shape[-1]:
        kth = torch.topk(x, config.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # mass strictly before each token; keep tokens whose preceding mass < top_p
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = before >= config.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None, num_samples: int = 1,
           replacement: bool = True) -> torch.Tensor:
    """Draw token ids from ``probs`` (``(..., V)``) with an explicit generator.

    Returns ``(..., num_samples)`` long tensor.
    """
    flat = probs.reshape(-1, probs.shape[-1]).float()
    out = torch.multinomial(flat, num_samples, replacement=replacement, generator=generator)
    return out.reshape(*probs.shape[:-1], num_samples)


def make_generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed``."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    return g
