"""The explorer's settings and the strategy each names: what one explored generation is.

Holds what the explorer widget (:mod:`specviz.render.explorer`, which re-exports every
public name here) and its recordings (:mod:`specviz.render.recording`) share, none of it
needing ipywidgets:

* :class:`ExplorerSettings` - the controls' values, validated, with the canonical form
  that is the results' cache key;
* :data:`STRATEGIES` - the dropdown's strategy labels, each standing for a strategy name
  of :mod:`specviz.draft.registry` given the sliders (:func:`strategy_spec`), with
  :data:`SLIDER_LABELS`, :data:`CHAINS` and the slider ranges;
* :func:`build_drafter`, :func:`verifier_for` and :func:`run_settings` - the registry's
  drafter and lossless verifier for the settings, and one generation with them.

No tensors appear here: a generation's tensors live in its
:class:`~specviz.decode.records.GenerationResult`.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Callable, Mapping

from specviz.decode.engine import speculative_generate
from specviz.decode.records import GenerationResult, StepTrace
from specviz.draft import registry
from specviz.draft.base import Drafter, side_branch_of, tokenizers_of
from specviz.draft.registry import MethodSpec
from specviz.models.types import ModelPair
from specviz.sampling import SamplingConfig
from specviz.validate import check_choice, check_int

__all__ = [
    "STRATEGIES",
    "DESCRIPTIONS",
    "SLIDER_LABELS",
    "CHAINS",
    "DEFAULT_PROMPT",
    "WIDTH_RANGE",
    "DEPTH_RANGE",
    "BUDGET_RANGE",
    "TEMPERATURE_RANGE",
    "ExplorerSettings",
    "strategy_spec",
    "build_drafter",
    "verifier_for",
    "run_settings",
]

#: the dropdown's strategy labels and the registry name each stands for, given the sliders
_REGISTRY_NAMES: dict[str, Callable[["ExplorerSettings"], str]] = {
    "chain": lambda s: f"chain-k{s.depth}",
    "tree": lambda s: f"tree-w{s.width}-d{s.depth}-b{s.budget}",
    "dynamic": lambda s: f"dynamic-w{s.width}-d{s.depth}-b{s.budget}",
    "ngram-trie": lambda s: f"ngram-trie-n3-d{s.depth}-b{s.budget}-m{s.width}",
    "ngram-adaptive": lambda s: f"ngram-adaptive-n{s.width}-k{s.depth}",
    "fallback": lambda s: f"fallback-ngram-n{max(3, s.width)}-k{s.depth}-min{s.width}+chain-k{s.depth}",
    "switch": lambda s: f"switch-ngram-adaptive-n{s.width}-k{s.depth}+chain-k{s.depth}",
    "choose": lambda s: (f"choose-ngram-n{max(3, s.width)}-k{s.depth}-min{s.width}+suffix-n8-d{s.depth}-b{s.budget}"
                         f"+chain-k{s.depth}"),
    "lookahead": lambda s: f"lookahead-w{s.width}-n{s.depth + 1}-g{s.budget}",
    "suffix": lambda s: f"suffix-n{s.width}-d{s.depth}-b{s.budget}",
    "medusa": lambda s: f"medusa-w{s.width}-d{s.depth}-b{s.budget}",
    "eagle": lambda s: f"eagle-w{s.width}-d{s.depth}-b{s.budget}",
    "merged": lambda s: f"merged-b{s.budget}-ngram-n3-k{s.depth}+eagle-w{s.width}-d{s.depth}-b{s.budget}",
}
#: what the dropdown shows beside each family name
DESCRIPTIONS: dict[str, str] = {
    "chain": "draft-model chain", "tree": "static draft-model tree", "dynamic": "EAGLE-2 draft-model tree",
    "ngram-trie": "prompt-lookup trie", "ngram-adaptive": "prompt lookup, adaptive length",
    "fallback": "prompt lookup, else the draft model", "switch": "lookup or draft model, by throughput",
    "choose": "lookup, suffix trees or draft model, by throughput",
    "lookahead": "lookahead decoding", "suffix": "suffix decoding (suffix trees)", "medusa": "trained Medusa heads", "eagle": "trained EAGLE head",
    "merged": "prompt lookup + EAGLE head, one tree",
}
#: slider labels (width, depth, budget) per strategy, where they differ from the trees'
SLIDER_LABELS: dict[str, tuple[str, str, str]] = {
    "ngram-trie": ("matches", "depth", "budget"),
    "ngram-adaptive": ("match n", "max length", "budget"),
    "fallback": ("min match", "length", "budget"),
    "switch": ("match n", "length", "budget"),
    "choose": ("min match", "length", "suffix budget"),
    "lookahead": ("window W", "guess N-1", "guesses G"),
    "suffix": ("pattern n", "depth", "budget"),
}
#: strategies that draft one chain of at most ``depth`` tokens and ignore the budget
CHAINS = ("chain", "ngram-adaptive", "fallback", "switch")
#: the dropdown's strategies: registry family names, each standing for a name given the sliders
STRATEGIES: tuple[str, ...] = tuple(_REGISTRY_NAMES)
#: the explorer's initial prompt
DEFAULT_PROMPT = "def fibonacci(n):"

# slider ranges: (min, max)
WIDTH_RANGE = (1, 8)
DEPTH_RANGE = (1, 12)
BUDGET_RANGE = (1, 128)
TEMPERATURE_RANGE = (0.0, 1.5)


@dataclass(frozen=True)
class ExplorerSettings:
    """Everything that determines one explored generation (the cache key).

    Attributes:
        prompt: the user prompt (the chat template is applied).
        strategy: one of :data:`STRATEGIES`.
        width: children per node (tree, dynamic, medusa, eagle, merged), merged matches
            (ngram-trie), the longest match n (ngram-adaptive, switch), the shortest match
            prompt lookup drafts from (fallback, choose), the window's width W (lookahead) or the
            longest pattern suffix decoding matches (suffix).
        depth: draft depth (the chain length for "chain", and for every part of
            "fallback", "switch", "choose" and "merged"; a guess's length N - 1 for lookahead).
        budget: maximum draft nodes per step (tree, dynamic, ngram-trie, suffix, the trees of the
            heads, the suffix part of "choose", shared by both parts of "merged") or guesses
            per step G (lookahead).
        temperature: 0 = greedy; > 0 samples, verified losslessly.
        max_new_tokens: tokens to generate.
        seed: seeds drafting and verification.
    """

    prompt: str = DEFAULT_PROMPT
    strategy: str = "dynamic"
    width: int = 2
    depth: int = 3
    budget: int = 32
    temperature: float = 0.0
    max_new_tokens: int = 24
    seed: int = 0

    def __post_init__(self) -> None:
        """Validate every field.

        Raises:
            ValueError: an empty prompt, an unknown strategy or an out-of-range value.
        """
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError(f"prompt must be non-empty text, got {self.prompt!r}")
        check_choice("strategy", self.strategy, STRATEGIES)
        check_int("width", self.width, *WIDTH_RANGE)
        check_int("depth", self.depth, *DEPTH_RANGE)
        check_int("budget", self.budget, *BUDGET_RANGE)
        check_int("max_new_tokens", self.max_new_tokens, 1, 4096)
        check_int("seed", self.seed, 0, 2**63 - 1)
        lo, hi = TEMPERATURE_RANGE
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not lo <= self.temperature <= hi:
            raise ValueError(f"temperature must be a number in [{lo}, {hi}], got {self.temperature!r}")

    def canonical(self) -> "ExplorerSettings":
        """The same generation with settings the strategy ignores fixed, so that settings
        that differ only there share one cache entry: a chain ignores width and budget (the
        ngram-adaptive chain its budget), and
        a budget above the nodes a static tree or a dynamic tree can propose (``width ** 1
        + ... + width ** depth``; ``width + (depth - 1) * width ** 2`` for EAGLE-2's
        frontier of ``width`` nodes, plus the lookup chain's ``depth`` for "merged")
        keeps them all, as that number does."""
        temperature = round(float(self.temperature), 6)
        if self.strategy == "chain":
            return replace(self, width=1, budget=self.depth, temperature=temperature)
        if self.strategy in CHAINS:
            return replace(self, budget=self.depth, temperature=temperature)
        if self.strategy in ("tree", "medusa"):
            full = sum(self.width ** d for d in range(1, self.depth + 1))
            return replace(self, budget=min(self.budget, full), temperature=temperature)
        if self.strategy in ("dynamic", "eagle", "merged"):
            pool = self.width + (self.depth - 1) * self.width ** 2
            if self.strategy == "merged":  # lookup's chain of ``depth`` comes first
                pool += self.depth
            return replace(self, budget=min(self.budget, pool), temperature=temperature)
        return replace(self, temperature=temperature)

    def describe(self) -> str:
        """The settings in words, as the sliders name them."""
        width, depth, budget = SLIDER_LABELS.get(self.strategy, ("width", "depth", "budget"))
        parts = [self.strategy]
        if self.strategy != "chain":
            parts.append(f"{width} {self.width}")
        parts.append(f"{depth} {self.depth}")
        if self.strategy not in CHAINS:
            parts.append(f"{budget} {self.budget}")
        parts.append(f"temperature {self.temperature:g}")
        return " · ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain data (how a trace file stores them)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ExplorerSettings":
        """Settings from :meth:`to_dict`'s plain data; a strategy under a former label
        (``"cascade"``, ...) reads as its family name (:data:`specviz.draft.registry.OLD_NAMES`).

        Raises:
            ValueError: a missing, unknown or out-of-range field.
        """
        if not isinstance(raw, Mapping):
            raise ValueError(f"settings must be a mapping, got {type(raw).__name__}")
        names = {f.name for f in fields(cls)}
        unknown, missing = sorted(set(raw) - names), sorted(names - set(raw))
        if unknown or missing:
            raise ValueError(f"settings {dict(raw)} have unknown fields {unknown} / lack fields {missing}")
        strategy = raw["strategy"]
        current = registry.current_name(strategy) if isinstance(strategy, str) else strategy
        if current != strategy and current in STRATEGIES:
            raw = {**raw, "strategy": current}
            warnings.warn(f"explorer settings: the former strategy label {strategy!r} read as {current!r}",
                          stacklevel=2)
        return cls(**raw)


def strategy_spec(settings: ExplorerSettings) -> MethodSpec:
    """The registry strategy the settings describe (see :data:`STRATEGIES`)."""
    return registry.parse_strategy(_REGISTRY_NAMES[settings.strategy](settings))


def build_drafter(settings: ExplorerSettings, pair: ModelPair) -> Drafter:
    """The drafter the settings describe, built by the registry."""
    return registry.build_drafter(strategy_spec(settings), pair)


def verifier_for(settings: ExplorerSettings) -> str:
    """The registry's lossless verification rule for the settings' strategy: greedy at
    temperature 0, Leviathan's chain rule for chains, deterministic top-k siblings
    (rule D) for the trees."""
    return strategy_spec(settings).verifier(float(settings.temperature))


class _ReportingDrafter(Drafter):
    """Passes every call to ``inner`` and reports each finished step (for progress bars)."""

    def __init__(self, inner: Drafter, on_step: Callable[[StepTrace], None]) -> None:
        self.inner = inner
        self.name = inner.name
        self.reads = inner.reads
        self._on_step = on_step

    def draft(self, context, config, sibling_sampling, generator):
        """Passed on to ``inner``."""
        return self.inner.draft(context, config, sibling_sampling, generator)

    def observe(self, step, outputs=None) -> None:
        """Passed on to ``inner``, then a finished step (not the prefill) is reported."""
        self.inner.observe(step, outputs)
        if step is not None:
            self._on_step(step)

    def side_branch(self, context, tree):
        """``inner``'s side branch (:func:`~specviz.draft.base.side_branch_of`)."""
        return side_branch_of(self.inner, context, tree)

    def reset(self) -> None:
        """Passed on to ``inner``."""
        self.inner.reset()

    @property
    def tokenizers(self) -> tuple:
        """``inner``'s tokenizers."""
        return tokenizers_of(self.inner)


def run_settings(settings: ExplorerSettings, pair: ModelPair,
                 on_step: Callable[[StepTrace], None] | None = None) -> GenerationResult:
    """Generate with the settings' drafter and verifier; ``on_step`` sees every step."""
    drafter = build_drafter(settings, pair)
    if on_step is not None:
        drafter = _ReportingDrafter(drafter, on_step)
    return speculative_generate(pair.target, drafter, settings.prompt,
                                max_new_tokens=settings.max_new_tokens,
                                config=SamplingConfig(temperature=float(settings.temperature)),
                                verifier=verifier_for(settings), seed=settings.seed)
