"""An interactive explorer for JupyterLab: change the drafting strategy with sliders and
watch the draft trees, their acceptance and the statistics follow.

``explore()`` in a notebook cell opens it::

    from specviz.render.explorer import explore
    explore()                      # replay: recorded steps of the built-in pair, instant
    explore(model="builtin")       # live: Qwen2.5-Coder 1.5B target + 0.5B draft
    explore(model="tiny")          # live on a random tiny pair: instant, gibberish text

Controls: a prompt box, the strategy (chain / static shape / dynamic / n-gram / adaptive
n-gram (prompt lookup whose chain length is chosen every step for expected throughput) /
cascade (prompt lookup where it finds a match, else the draft model's chain: ``fallback``) /
switch (each step the lookup's or the draft model's chain, whichever promises more tokens
per second) / lookahead, and the trained heads: a Medusa tree, an EAGLE-2 tree, and "eagle + lookup"
(prompt lookup's chain of up to ``depth`` tokens and the EAGLE-2 tree in one budget: ``merged-b<N>``),
which draft with the heads ``python -m specviz.heads train`` left in the specviz cache, or those
``$SPECVIZ_HEADS`` names), tree width (top-k), depth and budget, temperature, and a step slider
that scrubs through the generation's steps. Everything drawn comes from :mod:`specviz.render`, the same
functions the static figures use; this module only maps settings to a strategy name of
:mod:`specviz.draft.registry` (:func:`strategy_spec`), runs
:func:`specviz.decode.speculative_generate` with the drafter and verifier the registry
gives for it, and keeps the results of settings it has seen (so going back is instant).

A change that needs new model calls runs in a background thread, so the notebook
stays responsive; a progress bar counts the generated tokens, and if settings change
again meanwhile, only the latest ones are computed next.

**Replay mode** (``model="replay"``, the default) opens at once: it draws generations of
the built-in pair recorded in ``data/explorer_traces.json.gz`` (fp32 weights, 24 new
tokens, the default prompt and a grid of settings around the defaults; the file format is
:mod:`specviz.render.traces`). Recorded settings are drawn exactly as live mode draws them,
with the recorded token texts and times. A setting that was not recorded draws nothing
and says so, offering to go to the nearest recorded setting or to compute it live (the
built-in pair is then loaded in the background thread in the recording's weights, and
later unrecorded settings are computed as in live mode). ``python -m
specviz.render.explorer --record`` records the file again (:func:`record_traces`;
resumable: each finished setting is stored as it completes).
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from html import escape as _escape
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from specviz.decode.engine import speculative_generate
from specviz.decode.records import GenerationResult, StepTrace
from specviz.draft import registry
from specviz.draft.base import Drafter
from specviz.draft.registry import MethodSpec
from specviz.locations import DATA_DIR
from specviz.models.loading import BUILTIN_MODELS, ModelPair, load_pair, tiny_pair
from specviz.render import (
    figure_mimebundle,
    lookahead_mask_figure,
    lookahead_step_figure,
    mask_figure,
    stats_html,
    step_tree_figure,
    step_view_figure,
)
from specviz.render.traces import (
    RecordedTokenizer,
    TraceFile,
    TraceFileError,
    read_traces,
    result_token_ids,
    token_texts,
    write_traces,
)
from specviz.sampling import SamplingConfig
from specviz.validate import check_choice, check_int

__all__ = [
    "STRATEGIES",
    "MODELS",
    "DEFAULT_PROMPT",
    "DEFAULT_TRACES",
    "ExplorerSettings",
    "strategy_spec",
    "build_drafter",
    "verifier_for",
    "run_settings",
    "Recording",
    "load_recording",
    "recording_settings",
    "record_traces",
    "Explorer",
    "explore",
]

#: the dropdown's strategy labels and the registry name each stands for, given the sliders
_REGISTRY_NAMES: dict[str, Callable[["ExplorerSettings"], str]] = {
    "chain": lambda s: f"chain-k{s.depth}",
    "static shape": lambda s: f"tree-k{s.width}-d{s.depth}-n{s.budget}",
    "dynamic": lambda s: f"dynamic-k{s.width}-d{s.depth}-n{s.budget}",
    "n-gram": lambda s: f"ngram-trie-n3-d{s.depth}-b{s.budget}-m{s.width}",
    "adaptive n-gram": lambda s: f"ngram-adaptive-n{s.width}-k{s.depth}",
    "cascade": lambda s: f"fallback-ngram-n{max(3, s.width)}-k{s.depth}-min{s.width}+chain-k{s.depth}",
    "switch": lambda s: f"switch-ngram-adaptive-n{s.width}-k{s.depth}+chain-k{s.depth}",
    "lookahead": lambda s: f"lookahead-w{s.width}-n{s.depth + 1}-g{s.budget}",
    "medusa": lambda s: f"medusa-k{s.width}-d{s.depth}-n{s.budget}",
    "eagle": lambda s: f"eagle-k{s.width}-d{s.depth}-n{s.budget}",
    "eagle + lookup": lambda s: f"merged-b{s.budget}-ngram-n3-k{s.depth}+eagle-k{s.width}-d{s.depth}-n{s.budget}",
}
#: slider labels (width, depth, budget) per strategy, where they differ from the trees'
_SLIDER_LABELS: dict[str, tuple[str, str, str]] = {
    "n-gram": ("matches", "depth", "budget"),
    "adaptive n-gram": ("match n", "max length", "budget"),
    "cascade": ("min match", "length", "budget"),
    "switch": ("match n", "length", "budget"),
    "lookahead": ("window W", "guess N-1", "guesses G"),
}
#: strategies that draft one chain of at most ``depth`` tokens and ignore the budget
_CHAINS = ("chain", "adaptive n-gram", "cascade", "switch")
#: strategy labels shown in the dropdown
STRATEGIES: tuple[str, ...] = tuple(_REGISTRY_NAMES)
#: model choices of :func:`explore`: recorded traces of the built-in pair, the random tiny
#: pair, or the built-in Qwen pair live
MODELS: tuple[str, ...] = ("replay", "tiny", "builtin")
#: the explorer's initial prompt
DEFAULT_PROMPT = "def fibonacci(n):"
#: the recorded traces replay mode reads
DEFAULT_TRACES = DATA_DIR / "explorer_traces.json.gz"

# slider ranges: (min, max)
_WIDTH_RANGE = (1, 8)
_DEPTH_RANGE = (1, 12)
_BUDGET_RANGE = (1, 128)
_TEMPERATURE_RANGE = (0.0, 1.5)


@dataclass(frozen=True)
class ExplorerSettings:
    """Everything that determines one explored generation (the cache key).

    Attributes:
        prompt: the user prompt (the chat template is applied).
        strategy: one of :data:`STRATEGIES`.
        width: top-k, children per node (static shape, dynamic, medusa, eagle, eagle +
            lookup), merged matches (n-gram), the longest match n (adaptive n-gram,
            switch), the shortest match prompt lookup drafts from (cascade) or the
            window's width W (lookahead).
        depth: draft depth (the chain length for "chain", and for both parts of "cascade",
            "switch" and "eagle + lookup"; a guess's length N - 1 for lookahead).
        budget: maximum draft nodes per step (static shape, dynamic, n-gram, the trees of
            the heads, shared by both parts of "eagle + lookup") or guesses per step G
            (lookahead).
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
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError(f"prompt must be non-empty text, got {self.prompt!r}")
        check_choice("strategy", self.strategy, STRATEGIES)
        check_int("width", self.width, *_WIDTH_RANGE)
        check_int("depth", self.depth, *_DEPTH_RANGE)
        check_int("budget", self.budget, *_BUDGET_RANGE)
        check_int("max_new_tokens", self.max_new_tokens, 1, 4096)
        check_int("seed", self.seed, 0, 2**63 - 1)
        lo, hi = _TEMPERATURE_RANGE
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not lo <= self.temperature <= hi:
            raise ValueError(f"temperature must be a number in [{lo}, {hi}], got {self.temperature!r}")

    def canonical(self) -> "ExplorerSettings":
        """The same generation with settings the strategy ignores fixed, so that settings
        that differ only there share one cache entry: a chain ignores width and budget (the
        adaptive n-gram chain its budget), and
        a budget above the nodes a static shape or a dynamic tree can propose (``width ** 1
        + ... + width ** depth``; ``width + (depth - 1) * width ** 2`` for EAGLE-2's
        frontier of ``width`` nodes, plus the lookup chain's ``depth`` for "eagle +
        lookup") keeps them all, as that number does."""
        temperature = round(float(self.temperature), 6)
        if self.strategy == "chain":
            return replace(self, width=1, budget=self.depth, temperature=temperature)
        if self.strategy in _CHAINS:
            return replace(self, budget=self.depth, temperature=temperature)
        if self.strategy in ("static shape", "medusa"):
            full = sum(self.width ** d for d in range(1, self.depth + 1))
            return replace(self, budget=min(self.budget, full), temperature=temperature)
        if self.strategy in ("dynamic", "eagle", "eagle + lookup"):
            pool = self.width + (self.depth - 1) * self.width ** 2
            if self.strategy == "eagle + lookup":  # lookup's chain of ``depth`` comes first
                pool += self.depth
            return replace(self, budget=min(self.budget, pool), temperature=temperature)
        return replace(self, temperature=temperature)

    def describe(self) -> str:
        """The settings in words, as the sliders name them."""
        width, depth, budget = _SLIDER_LABELS.get(self.strategy, ("width", "depth", "budget"))
        parts = [self.strategy]
        if self.strategy != "chain":
            parts.append(f"{width} {self.width}")
        parts.append(f"{depth} {self.depth}")
        if self.strategy not in _CHAINS:
            parts.append(f"{budget} {self.budget}")
        parts.append(f"temperature {self.temperature:g}")
        return " · ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain data (how a trace file stores them)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ExplorerSettings":
        """Settings from :meth:`to_dict`'s plain data.

        Raises:
            ValueError: a missing, unknown or out-of-range field.
        """
        if not isinstance(raw, Mapping):
            raise ValueError(f"settings must be a mapping, got {type(raw).__name__}")
        names = {f.name for f in fields(cls)}
        unknown, missing = sorted(set(raw) - names), sorted(names - set(raw))
        if unknown or missing:
            raise ValueError(f"settings {dict(raw)} have unknown fields {unknown} / lack fields {missing}")
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
        self.needs_target_outputs = inner.needs_target_outputs
        self.needs_target_hidden = inner.needs_target_hidden
        self._on_step = on_step

    def observe_hidden(self, step, hidden) -> None:
        self.inner.observe_hidden(step, hidden)

    def draft(self, context, config, sibling_sampling, generator):
        return self.inner.draft(context, config, sibling_sampling, generator)

    def observe(self, step) -> None:
        self.inner.observe(step)
        self._on_step(step)

    def side_branch(self, context, tree):
        return self.inner.side_branch(context, tree)

    def observe_target(self, step, logits, side_logits) -> None:
        self.inner.observe_target(step, logits, side_logits)

    def reset(self) -> None:
        self.inner.reset()

    @property
    def tokenizers(self) -> tuple:
        return self.inner.tokenizers


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


# -- recordings ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Recording:
    """Recorded explorer generations, ready to replay without a model.

    Attributes:
        info: what recorded them: ``target`` and ``draft`` model names, ``weights`` (the
            weight mode), ``device``, ``max_new_tokens``, ``seed``, ``threads`` and library
            versions.
        results: the generations, keyed by canonical settings (:meth:`ExplorerSettings.canonical`).
        tokenizer: decodes every recorded token for the labels.
        path: the file it was read from (None for one built in memory).
    """

    info: Mapping[str, Any]
    results: Mapping[ExplorerSettings, GenerationResult]
    tokenizer: RecordedTokenizer
    path: Path | None = None

    @property
    def weights(self) -> str:
        return str(self.info.get("weights", "?"))

    @property
    def max_new_tokens(self) -> int:
        return int(self.info.get("max_new_tokens", 0))

    @property
    def prompts(self) -> tuple[str, ...]:
        """The recorded prompts, in first-recorded order."""
        return tuple(dict.fromkeys(k.prompt for k in self.results))

    def describe(self) -> str:
        """One line: models, weights, tokens per generation, settings recorded."""
        return (f"{self.info.get('target', '?')} (target) with {self.info.get('draft', '?')} (draft), "
                f"{self.weights} weights on {self.info.get('device', '?')}, {self.max_new_tokens} new tokens "
                f"per setting, {len(self.results)} settings recorded")

    def nearest(self, settings: ExplorerSettings) -> ExplorerSettings | None:
        """The recorded settings closest to ``settings``: the same prompt, token count and
        seed first, then the same strategy, then the nearest temperature, then the fewest
        slider steps (budget steps counted in powers of two)."""
        key = settings.canonical()

        def distance(k: ExplorerSettings) -> tuple:
            return (k.prompt != key.prompt, (k.max_new_tokens, k.seed) != (key.max_new_tokens, key.seed),
                    k.strategy != key.strategy, abs(k.temperature - key.temperature),
                    abs(k.width - key.width) + abs(k.depth - key.depth) + abs(math.log2(k.budget / key.budget)),
                    STRATEGIES.index(k.strategy), k.depth, k.width, k.budget)

        return min(self.results, key=distance, default=None)


def _recording(traces: TraceFile, path: Path | None) -> Recording:
    results: dict[ExplorerSettings, GenerationResult] = {}
    for i, (raw, result) in enumerate(traces.entries):
        try:
            key = ExplorerSettings.from_dict(raw).canonical()
        except (TypeError, ValueError) as err:
            raise TraceFileError(f"{path or 'recording'}: traces[{i}].settings: {err}") from None
        results.setdefault(key, result)
    return Recording(info=dict(traces.info), results=results, tokenizer=traces.tokenizer, path=path)


def load_recording(path: str | Path | None = None) -> Recording:
    """Read recorded explorer traces (default :data:`DEFAULT_TRACES`).

    Raises:
        FileNotFoundError: no file at ``path`` (record one with ``python -m specviz.render.explorer --record``).
        specviz.render.traces.TraceFileError: a corrupt file, another format or version, or
            settings the explorer does not accept.
    """
    path = Path(path) if path is not None else DEFAULT_TRACES
    if not path.is_file():
        raise FileNotFoundError(f"no recorded explorer traces at {path}; record them with "
                                f"python -m specviz.render.explorer --record {path}")
    return _recording(read_traces(path), path)


def recording_settings(prompt: str = DEFAULT_PROMPT, max_new_tokens: int = 24,
                       seed: int = 0) -> tuple[ExplorerSettings, ...]:
    """The settings the committed recording holds, in canonical form: every strategy at the
    explorer's default sliders, the dynamic tree one slider step either way (depth 2 and 4,
    width 3) and at budgets 4 and 8, chains of depth 2 and 4, and the default dynamic tree
    and chain at temperature 1.0."""
    base = ExplorerSettings(prompt=prompt, max_new_tokens=max_new_tokens, seed=seed)
    grid = [replace(base, strategy=s) for s in STRATEGIES]
    grid += [replace(base, depth=2), replace(base, depth=4), replace(base, width=3),
             replace(base, budget=4), replace(base, budget=8)]
    grid += [replace(base, strategy="chain", depth=2), replace(base, strategy="chain", depth=4)]
    grid += [replace(base, temperature=1.0), replace(base, strategy="chain", temperature=1.0)]
    return tuple(dict.fromkeys(s.canonical() for s in grid))


def _pair_info(pair: ModelPair) -> dict[str, Any]:
    import transformers

    return {"target": pair.target.name, "draft": pair.draft.name, "weights": pair.target.weight_mode,
            "device": str(pair.target.device), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__}


def record_traces(path: str | Path = DEFAULT_TRACES, settings: Iterable[ExplorerSettings] | None = None,
                  pair: ModelPair | Callable[[], ModelPair] | None = None, *, weights: str = "fp32",
                  log: Callable[[str], None] | None = None) -> Recording:
    """Record the generations of ``settings`` into the trace file ``path``, resumably.

    Settings already in the file are kept and not run again, and the file is rewritten
    (atomically) after every finished setting, so an interrupted recording resumes where it
    stopped. The pair is loaded only when something is left to record.

    Args:
        path: the gzip'd JSON trace file (:mod:`specviz.render.traces`).
        settings: what to record (default :func:`recording_settings`); every setting must
            share one ``max_new_tokens`` and ``seed``.
        pair: the models, or a function that loads them; None loads the built-in pair in
            ``weights`` on the CPU.
        weights: weight mode of the built-in pair when ``pair`` is None.
        log: where progress lines go (default: stdout).

    Returns:
        The whole recording, as :func:`load_recording` reads it.

    Raises:
        TypeError: a setting that is not an :class:`ExplorerSettings`.
        ValueError: settings with different token counts or seeds, or an existing file that
            was recorded with other models, weights, token count or seed.
        specviz.render.traces.TraceFileError: an existing file that cannot be read.
    """
    log = log or (lambda line: print(line, flush=True))
    path = Path(path)
    asked = list(recording_settings() if settings is None else settings)
    wrong = [s for s in asked if not isinstance(s, ExplorerSettings)]
    if wrong:
        raise TypeError(f"settings must be ExplorerSettings, got {type(wrong[0]).__name__}")
    todo = list(dict.fromkeys(s.canonical() for s in asked))
    if not todo:
        raise ValueError("no settings to record")
    if len({(s.max_new_tokens, s.seed) for s in todo}) != 1:
        raise ValueError("every recorded setting must share one max_new_tokens and one seed")
    fixed = {"max_new_tokens": todo[0].max_new_tokens, "seed": todo[0].seed}
    traces = read_traces(path) if path.exists() else TraceFile(info={})
    entries = list(traces.entries)
    tokens = dict(traces.tokens)
    done = set(_recording(traces, path).results)
    if traces.info:
        clash = {k: (traces.info.get(k), v) for k, v in fixed.items() if traces.info.get(k) != v}
        if clash:
            raise ValueError(f"{path} was recorded with other settings {clash} (file, asked); "
                             "record into another file")
    todo = [s for s in todo if s not in done]
    log(f"[record] {path}: {len(done)} setting(s) recorded, {len(todo)} to record")
    loaded: ModelPair | None = None
    for i, key in enumerate(todo, 1):
        if loaded is None:
            if isinstance(pair, ModelPair):
                loaded = pair
            elif pair is not None:
                loaded = pair()
            else:
                log(f"[record] loading the built-in pair in {weights} on the CPU")
                loaded = load_pair(dtype=weights, device="cpu")
            info = {**_pair_info(loaded), **fixed}
            if traces.info:
                clash = {k: (traces.info.get(k), info[k]) for k in ("target", "draft", "weights")
                         if traces.info.get(k) != info[k]}
                if clash:
                    raise ValueError(f"{path} was recorded with other models or weights {clash} (file, now); "
                                     "record into another file")
                info = dict(traces.info)
        start = time.perf_counter()
        result = run_settings(key, loaded)
        entries.append((key.to_dict(), result))
        tokens.update(token_texts(loaded.target.tokenizer, result_token_ids(result) - set(tokens)))
        write_traces(path, TraceFile(info=info, entries=tuple(entries), tokens=tokens))
        log(f"[record {i}/{len(todo)}] {key.describe()}: {len(result.steps)} steps, "
            f"{result.n_new_tokens} tokens in {time.perf_counter() - start:.1f} s")
    return load_recording(path)


# -- the widget -----------------------------------------------------------------------------------

_ERROR = "color:#D55E00"


class Explorer:
    """The explorer widget and its result cache.

    Live mode (a ``pair``) computes every setting with the models. Replay mode (a
    ``recording`` and no ``pair``) draws recorded settings at once; a setting that was not
    recorded draws nothing, says so, and offers the nearest recorded setting or a live
    computation, which loads the models with ``live_pair`` (in the background thread when
    ``background``). After the first live computation, later unrecorded settings are
    computed as in live mode.

    Args:
        pair: the target and draft models (None in replay mode until they are needed).
        settings: the initial settings (computed, or looked up, before the widget is shown).
        background: compute later changes in a background thread (True in notebooks;
            False makes every change synchronous, for scripts and tests).
        recording: recorded generations to replay.
        live_pair: loads the models for live computation in replay mode.

    Attributes:
        widget: the ``ipywidgets`` box to display.
        results: generations drawn so far (recorded ones included), keyed by canonical settings.
        recorded: the canonical settings the recording holds.
        computations: how many generations were run (recorded and cached ones do not count).
        live: whether settings missing from the results are computed (always in live mode;
            in replay mode once "compute live" was pressed).
    """

    def __init__(self, pair: ModelPair | None, settings: ExplorerSettings, *, background: bool = True,
                 recording: Recording | None = None, live_pair: Callable[[], ModelPair] | None = None) -> None:
        import ipywidgets as w

        if pair is None and recording is None:
            raise ValueError("the explorer needs a model pair (live mode) or a recording (replay mode)")
        self.pair = pair
        self.recording = recording
        self._live_pair = live_pair
        self.background = background
        self.results: dict[ExplorerSettings, GenerationResult] = dict(recording.results) if recording else {}
        self.recorded: frozenset[ExplorerSettings] = frozenset(self.results)
        self.live = pair is not None
        self._lock = threading.Lock()
        self._pending: ExplorerSettings | None = None
        self._busy = False
        self._idle = threading.Event()
        self._idle.set()
        self._shown: ExplorerSettings | None = None
        self._applying = False
        self._nearest: ExplorerSettings | None = None
        self.computations = 0

        self.prompt = w.Textarea(value=settings.prompt, description="prompt", continuous_update=False,
                                 layout=w.Layout(width="100%", height="4em"))
        self.strategy = w.Dropdown(options=STRATEGIES, value=settings.strategy, description="strategy")
        slider = dict(continuous_update=False, style={"description_width": "7em"})
        self.width = w.IntSlider(value=settings.width, min=_WIDTH_RANGE[0], max=_WIDTH_RANGE[1],
                                 description="width (top-k)", **slider)
        self.depth = w.IntSlider(value=settings.depth, min=_DEPTH_RANGE[0], max=_DEPTH_RANGE[1],
                                 description="depth", **slider)
        self.budget = w.IntSlider(value=settings.budget, min=_BUDGET_RANGE[0], max=_BUDGET_RANGE[1],
                                  description="budget", **slider)
        self.temperature = w.FloatSlider(value=settings.temperature, min=_TEMPERATURE_RANGE[0],
                                         max=_TEMPERATURE_RANGE[1], step=0.1, readout_format=".1f",
                                         description="temperature", **slider)
        self.step = w.IntSlider(value=0, min=0, max=0, description="step",
                                layout=w.Layout(width="60%"), **slider)
        self.show_mask = w.Checkbox(value=False, description="show attention mask")
        self.progress = w.IntProgress(value=0, min=0, max=settings.max_new_tokens, description="tokens",
                                      layout=w.Layout(visibility="hidden"))
        self.status = w.HTML()
        self.banner = w.HTML()
        self.source = w.HTML()
        self.missing = w.HTML()
        self.live_button = w.Button(description="compute live", icon="play", button_style="warning",
                                    tooltip="load the models and compute this setting")
        self.nearest_button = w.Button(description="nearest recorded", icon="fast-forward",
                                       layout=w.Layout(width="auto"))
        self.missing_box = w.VBox([self.missing, w.HBox([self.nearest_button, self.live_button])],
                                  layout=w.Layout(display="none"))
        self.missing_box.add_class("specviz-missing")
        self.stats = w.HTML()
        self.tree_out = w.Output(layout=w.Layout(overflow="auto", max_width="100%"))
        self.tree_out.add_class("specviz-tree")
        self.mask_out = w.Output(layout=w.Layout(overflow="auto", max_width="100%"))
        self.mask_out.add_class("specviz-mask")
        self.steps_out = w.Output(layout=w.Layout(overflow="auto", max_width="100%"))
        self.steps_out.add_class("specviz-steps")
        self._fixed = dict(max_new_tokens=settings.max_new_tokens, seed=settings.seed)

        if recording is not None:
            self.banner.value = (f"<div style='padding:4px 8px;background:#E8F4FA;border-left:4px solid #0072B2'>"
                                 f"<b>Replaying a recording:</b> {_escape(recording.describe())}. "
                                 f"Recorded settings are drawn as recorded (wall times are those of the "
                                 f"recording); others can be computed live.</div>")
        controls = w.VBox([
            self.banner,
            self.prompt,
            w.HBox([self.strategy, self.temperature]),
            w.HBox([self.width, self.depth, self.budget]),
            w.HBox([self.progress, self.status]),
            self.missing_box,
        ])
        self.widget = w.VBox([controls, w.HBox([self.step, self.show_mask, self.source]), self.stats,
                              self.tree_out, self.mask_out, self.steps_out])
        self.widget.add_class("specviz-explorer")

        self._sync_enabled()
        key = settings.canonical()
        if key not in self.results and self.live:
            self.results[key] = run_settings(key, self._models())
            self.computations += 1
        if key in self.results:
            self._show(key, reset_step=True)
        else:
            self._show_missing(settings)
        for control in (self.prompt, self.strategy, self.width, self.depth, self.budget, self.temperature):
            control.observe(self._on_settings, names="value")
        self.step.observe(self._on_step, names="value")
        self.show_mask.observe(self._on_step, names="value")
        self.live_button.on_click(self._on_live)
        self.nearest_button.on_click(self._on_nearest)

    # -- settings -> result ------------------------------------------------------------------
    def settings(self) -> ExplorerSettings:
        """The settings the controls show now."""
        return ExplorerSettings(prompt=self.prompt.value, strategy=self.strategy.value,
                                width=self.width.value, depth=self.depth.value, budget=self.budget.value,
                                temperature=float(self.temperature.value), **self._fixed)

    def apply(self, settings: ExplorerSettings) -> None:
        """Move the controls to ``settings`` (then draw, look up or compute them once)."""
        self._applying = True
        try:
            self.prompt.value = settings.prompt
            self.strategy.value = settings.strategy
            self.width.value = settings.width
            self.depth.value = settings.depth
            self.budget.value = settings.budget
            self.temperature.value = settings.temperature
        finally:
            self._applying = False
        self._on_settings(None)

    def _models(self) -> ModelPair:
        if self.pair is None:
            if self._live_pair is None:
                raise RuntimeError("this explorer has no models to compute with")
            self.pair = self._live_pair()
        return self.pair

    def _sync_enabled(self) -> None:
        strategy = self.strategy.value
        self.width.disabled = strategy == "chain"
        self.budget.disabled = strategy in _CHAINS
        labels = _SLIDER_LABELS.get(strategy, ("width (top-k)", "depth", "budget"))
        self.width.description, self.depth.description, self.budget.description = labels

    def _on_settings(self, change) -> None:
        if self._applying:
            return
        self._sync_enabled()
        try:
            settings = self.settings()
        except ValueError as err:
            self.status.value = f"<span style='{_ERROR}'>{_escape(str(err))}</span>"
            return
        key = settings.canonical()
        if key in self.results:
            if not self._busy:
                self.status.value = ""
            self._show(key, reset_step=True)
            return
        if not self.live:
            self._show_missing(settings)
            return
        self._request(key)

    def _request(self, key: ExplorerSettings) -> None:
        self._clear()
        if not self.background:
            self._compute(key)
            return
        with self._lock:
            self._pending = key
            start = not self._busy
            self._busy = True
            self._idle.clear()
        if start:
            threading.Thread(target=self._worker, name="specviz-explorer", daemon=True).start()

    def _on_live(self, button=None) -> None:
        """Compute the shown (unrecorded) setting live, and every later one."""
        self.live = True
        self.live_button.disabled = True
        self._on_settings(None)

    def _on_nearest(self, button=None) -> None:
        if self._nearest is not None:
            self.apply(self._nearest)

    def _worker(self) -> None:
        while True:
            with self._lock:
                key, self._pending = self._pending, None
                if key is None:
                    self._busy = False
                    self._idle.set()
                    return
            self._compute(key)

    def _compute(self, key: ExplorerSettings) -> None:
        self.progress.max = key.max_new_tokens
        self.progress.value = 0
        self.progress.layout.visibility = "visible"

        def advance(step: StepTrace) -> None:
            self.progress.value = min(self.progress.max, self.progress.value + step.acceptance.tau)

        try:
            if self.pair is None:
                self.status.value = ("loading the models for live computation (seconds when cached; the first "
                                     "time converts them, about 3 minutes on a 2-core CPU)…")
            pair = self._models()
            self.status.value = "computing…"
            result = run_settings(key, pair, on_step=advance)
        except Exception as err:  # shown in the widget; the explorer keeps working
            self.status.value = (f"<span style='{_ERROR}'>failed: {type(err).__name__}: "
                                 f"{_escape(str(err))}</span>")
            self.progress.layout.visibility = "hidden"
            return
        self.results[key] = result
        self.computations += 1
        self.progress.layout.visibility = "hidden"
        self.status.value = ""
        # show it unless the controls have already moved on to other settings
        try:
            current = self.settings().canonical()
        except ValueError:
            current = None
        if current == key:
            self._show(key, reset_step=True)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until background computations are done; False if ``timeout`` (s) ran out."""
        return self._idle.wait(timeout)

    # -- drawing --------------------------------------------------------------------------------
    def _clear(self) -> None:
        """Draw nothing: the controls show settings without a result (yet)."""
        self._shown = None
        self.stats.value = ""
        self.source.value = ""
        for out in (self.tree_out, self.mask_out, self.steps_out):
            out.outputs = ()
        self.step.unobserve(self._on_step, names="value")
        self.step.max = 0
        self.step.value = 0
        self.step.observe(self._on_step, names="value")
        self.step.disabled = True

    def _show_missing(self, settings: ExplorerSettings) -> None:
        """Draw nothing for ``settings`` (not recorded) and say why, with the way on."""
        self._clear()
        key = settings.canonical()
        rec = self.recording
        self._nearest = rec.nearest(key) if rec is not None else None
        if self._nearest is not None:
            # keep the sliders the strategy saturates where they give the same generation
            for name in ("budget", "width"):
                kept = replace(self._nearest, **{name: getattr(settings, name)})
                if kept.canonical() == self._nearest.canonical():
                    self._nearest = kept
        notes = []
        if rec is not None and key.prompt not in rec.prompts:
            shown = ", ".join(repr(p) for p in rec.prompts)
            notes.append(f"The recording holds the prompt {shown} only.")
        if rec is not None and (key.max_new_tokens, key.seed) != (rec.max_new_tokens, rec.info.get("seed", 0)):
            notes.append(f"It was recorded with {rec.max_new_tokens} new tokens and seed {rec.info.get('seed', 0)}.")
        self.missing.value = (
            f"<div style='padding:4px 8px;border-left:4px solid #D55E00'><b>Not recorded:</b> "
            f"{_escape(settings.describe())} is not in the recording, so nothing is drawn for it. "
            f"{_escape(' '.join(notes))} Go to the nearest recorded setting, or compute it live "
            f"(loads the models in {_escape(rec.weights if rec else '?')} in the background: seconds when "
            f"cached, about 3 minutes the first time; then tens of seconds per setting on a 2-core CPU; "
            f"later unrecorded settings are then computed too).</div>")
        if self._nearest is not None:
            self.nearest_button.description = f"nearest recorded: {self._nearest.describe()}"
            self.nearest_button.disabled = False
        else:
            self.nearest_button.description = "nearest recorded: none"
            self.nearest_button.disabled = True
        self.live_button.disabled = self._live_pair is None and self.pair is None
        self.missing_box.layout.display = "flex"

    def _show(self, key: ExplorerSettings, reset_step: bool) -> None:
        result = self.results[key]
        self._shown = key
        self.missing_box.layout.display = "none"
        self.step.disabled = False
        if self.recording is not None:
            self.source.value = ("<b>recorded</b>" if key in self.recorded
                                 else "<b style='color:#D55E00'>computed live</b>")
        last = max(len(result.steps) - 1, 0)
        if reset_step:
            # hold the step handler while the slider range changes, then draw once
            self.step.unobserve(self._on_step, names="value")
            self.step.max = last
            self.step.value = min(self.step.value, last)
            self.step.observe(self._on_step, names="value")
        self._draw()

    def _on_step(self, change) -> None:
        if self._shown is not None:
            self._draw()

    def tokenizer_for(self, key: ExplorerSettings) -> Any:
        """What decodes the tokens of ``key``'s result: the recording's token table for a
        recorded setting, the target's tokenizer for a computed one."""
        if key in self.recorded and self.recording is not None:
            return self.recording.tokenizer
        return self.pair.target.tokenizer

    def _draw(self) -> None:
        result = self.results[self._shown]
        tokenizer = self.tokenizer_for(self._shown)
        if not result.steps:
            self.stats.value = stats_html(result)
            return
        s = min(self.step.value, len(result.steps) - 1)
        step = result.steps[s]
        self.stats.value = stats_html(result, s)
        figures = [step_tree_figure(step, tokenizer=tokenizer)]
        if step.side is not None:
            figures.append(lookahead_step_figure(step, tokenizer=tokenizer))
        self._display(self.tree_out, *figures)
        if self.show_mask.value:
            mask = (lookahead_mask_figure(step, tokenizer=tokenizer) if step.side is not None
                    else mask_figure(step.tree, tokenizer=tokenizer))
            self._display(self.mask_out, mask)
        else:
            self.mask_out.outputs = ()
        self._display(self.steps_out, step_view_figure(result, tokenizer=tokenizer, highlight_step=s))

    @staticmethod
    def _display(out, *figs) -> None:
        # Assigning the outputs (rather than `with out: display(fig)`) works from any thread.
        out.outputs = tuple({"output_type": "display_data", "data": figure_mimebundle(fig), "metadata": {}}
                            for fig in figs)

    def describe(self) -> str:
        """One line: which models (or which recording) the explorer shows."""
        if self.recording is not None:
            return f"specviz explorer, replaying {self.recording.describe()}"
        t, d = self.pair.target, self.pair.draft
        weights = (f"{t.weight_mode} weights" if d.weight_mode == t.weight_mode
                   else f"{t.weight_mode} target weights, {d.weight_mode} draft weights")
        return f"specviz explorer, live on {t.name} (target) with {d.name} (draft), {weights}"

    def _repr_mimebundle_(self, **kwargs):
        # the widget view, with a short stable text for front ends (and notebook checks) without widgets
        bundle = self.widget._repr_mimebundle_(**kwargs)
        if isinstance(bundle, dict):
            bundle = {**bundle, "text/plain": self.describe()}
        return bundle


def _load(model: str | ModelPair, dtype: str | None, device: str | None,
          draft_dtype: str | None = None) -> ModelPair:
    if isinstance(model, ModelPair):
        if draft_dtype is not None:
            raise ValueError("draft_dtype applies to a model given by name; a loaded ModelPair keeps its weights")
        return model
    if model == "tiny":
        return tiny_pair(seed=0, dtype=dtype or "fp32", device=device or "cpu", draft_dtype=draft_dtype)
    if model == "builtin":
        return load_pair(dtype=dtype or "bf16", device=device, draft_dtype=draft_dtype)
    raise ValueError(f"model must be one of {MODELS} or a ModelPair, got {model!r}")


def _replay_models(recording: Recording, device: str | None) -> Callable[[], ModelPair]:
    """A loader of the pair that made ``recording``, in its weights (on its device unless
    ``device`` says otherwise)."""
    target, draft = str(recording.info.get("target", "")), str(recording.info.get("draft", ""))
    weights = recording.weights
    where = device or str(recording.info.get("device", "cpu"))

    def load() -> ModelPair:
        if target.lower() in BUILTIN_MODELS and draft.lower() in BUILTIN_MODELS:
            return load_pair(target, draft, dtype=weights, device=where)
        prefix = "tiny-qwen2-seed"
        if target.startswith(prefix) and target[len(prefix):].isdigit():
            return tiny_pair(seed=int(target[len(prefix):]), dtype=weights, device=where)
        raise ValueError(f"the recording's models {target!r} / {draft!r} cannot be loaded by name; "
                         "pass a ModelPair to explore() to compute live")

    return load


def explore(model: str | ModelPair = "replay", prompt: str = DEFAULT_PROMPT, *, strategy: str = "dynamic",
            width: int = 2, depth: int = 3, budget: int = 32, temperature: float = 0.0,
            max_new_tokens: int = 24, seed: int = 0, dtype: str | None = None, device: str | None = None,
            background: bool = True, traces: str | Path | None = None,
            draft_dtype: str | None = None) -> Explorer:
    """Open the explorer (display the returned object, e.g. as a cell's last expression).

    Args:
        model: "replay" (recorded generations of the built-in pair: instant, real tokens;
            unrecorded settings can be computed live), "builtin" (Qwen2.5-Coder 1.5B target
            with the 0.5B draft, live), "tiny" (random tiny pair, live and instant) or a
            loaded :class:`~specviz.models.ModelPair`.
        prompt: initial prompt.
        strategy, width, depth, budget, temperature: initial control values
            (see :class:`ExplorerSettings`).
        max_new_tokens: tokens generated per setting (replay: the recording's, 24).
        seed: random seed of drafting and verification.
        dtype: weight mode of a model given by name (``fp32``, ``bf16``, ``int8``, ``w8a8``,
            ...); None: bf16 for the builtin pair, fp32 for the tiny one, the recording's
            (fp32) in replay mode, which accepts no other.
        draft_dtype: the draft's weight mode when it differs from ``dtype`` (e.g.
            ``w4a8-token``: a 4-bit draft, with fused layers on the CPU; what it proposes
            changes, what is accepted does not); None: ``dtype``. Not in replay mode.
        device: where a model given by name runs (``auto``, ``cpu``, ``cuda``, ``mps``);
            None: ``auto`` for the builtin pair, the CPU for the tiny one and for replay
            mode's live computations.
        background: compute changes in a background thread.
        traces: the recording replay mode reads (default :data:`DEFAULT_TRACES`).

    Raises:
        ValueError: an unknown model, weight mode or device, an out-of-range setting, or in
            replay mode a weight mode other than the recording's.
        FileNotFoundError: replay mode without a recording.
        specviz.render.traces.TraceFileError: a corrupt recording.
    """
    settings = ExplorerSettings(prompt=prompt, strategy=strategy, width=width, depth=depth, budget=budget,
                                temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    if isinstance(model, str) and model == "replay":
        recording = load_recording(traces)
        if dtype is not None and dtype != recording.weights:
            raise ValueError(f"replay mode shows and computes {recording.weights} weights (the recording's), "
                             f"got dtype={dtype!r}; use model='builtin' for other weight modes")
        if draft_dtype is not None and draft_dtype != recording.weights:
            raise ValueError(f"replay mode's draft runs in {recording.weights} (the recording's), got "
                             f"draft_dtype={draft_dtype!r}; use model='builtin' for a draft in another mode")
        return Explorer(None, settings, background=background, recording=recording,
                        live_pair=_replay_models(recording, device))
    return Explorer(_load(model, dtype, device, draft_dtype), settings, background=background)


# -- command line ----------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specviz.render.explorer --record [PATH]``: record the replay traces."""
    parser = argparse.ArgumentParser(prog="python -m specviz.render.explorer", description=(
        "Record the explorer's replay traces: the built-in pair's generations for the settings of "
        "recording_settings(), stored after each one, so an interrupted run resumes."))
    parser.add_argument("--record", metavar="PATH", nargs="?", const=str(DEFAULT_TRACES), required=True,
                        help=f"the trace file to write or complete (default {DEFAULT_TRACES})")
    parser.add_argument("--weights", default="fp32", help="weight mode of the built-in pair (default fp32)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens per generation (default 24)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"the prompt (default {DEFAULT_PROMPT!r})")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    try:
        settings = recording_settings(args.prompt, args.max_new_tokens)
        start = time.perf_counter()
        recording = record_traces(args.record, settings, weights=args.weights)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    size = Path(args.record).stat().st_size
    print(f"[record] {recording.describe()}; {size / 1024:.0f} KiB in {args.record} "
          f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
