"""An interactive explorer for JupyterLab: change the drafting strategy with sliders and
watch the draft trees, their acceptance and the statistics follow.

``explore()`` in a notebook cell opens it::

    from specviz.render.explorer import explore
    explore(model="tiny")          # random tiny pair: instant, for trying the controls
    explore(model="builtin")       # Qwen2.5-Coder 1.5B target + 0.5B draft

Controls: a prompt box, the strategy (chain / static shape / dynamic / n-gram), tree
width (top-k), depth and budget, temperature, and a step slider that scrubs through
the generation's steps. Everything drawn comes from :mod:`specviz.render`, the same
functions the static figures use; this module only maps settings to a strategy name of
:mod:`specviz.draft.registry` (:func:`strategy_spec`), runs
:func:`specviz.decode.speculative_generate` with the drafter and verifier the registry
gives for it, and keeps the results of settings it has seen (so going back is instant).

A change that needs new model calls runs in a background thread, so the notebook
stays responsive; a progress bar counts the generated tokens, and if settings change
again meanwhile, only the latest ones are computed next.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Callable

from specviz.decode.engine import speculative_generate
from specviz.decode.records import GenerationResult, StepTrace
from specviz.draft import registry
from specviz.draft.base import Drafter
from specviz.draft.registry import MethodSpec
from specviz.models.loading import ModelPair, load_pair, tiny_pair
from specviz.render import (
    figure_mimebundle,
    lookahead_mask_figure,
    lookahead_step_figure,
    mask_figure,
    stats_html,
    step_tree_figure,
    step_view_figure,
)
from specviz.sampling import SamplingConfig
from specviz.validate import check_choice, check_int

__all__ = [
    "STRATEGIES",
    "MODELS",
    "ExplorerSettings",
    "strategy_spec",
    "build_drafter",
    "verifier_for",
    "run_settings",
    "Explorer",
    "explore",
]

#: the dropdown's strategy labels and the registry name each stands for, given the sliders
_REGISTRY_NAMES: dict[str, Callable[["ExplorerSettings"], str]] = {
    "chain": lambda s: f"chain-k{s.depth}",
    "static shape": lambda s: f"tree-k{s.width}-d{s.depth}-n{s.budget}",
    "dynamic": lambda s: f"dynamic-k{s.width}-d{s.depth}-n{s.budget}",
    "n-gram": lambda s: f"ngram-trie-n3-d{s.depth}-b{s.budget}-m{s.width}",
    "lookahead": lambda s: f"lookahead-w{s.width}-n{s.depth + 1}-g{s.budget}",
}
#: slider labels (width, depth, budget) per strategy, where they differ from the trees'
_SLIDER_LABELS: dict[str, tuple[str, str, str]] = {
    "n-gram": ("matches", "depth", "budget"),
    "lookahead": ("window W", "guess N-1", "guesses G"),
}
#: strategy labels shown in the dropdown
STRATEGIES: tuple[str, ...] = tuple(_REGISTRY_NAMES)
#: model choices of :func:`explore`: the random tiny pair or the built-in Qwen pair
MODELS: tuple[str, ...] = ("tiny", "builtin")

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
        width: top-k, children per node (static shape, dynamic), merged matches (n-gram) or
            the window's width W (lookahead).
        depth: draft depth (the chain length for "chain"; a guess's length N - 1 for lookahead).
        budget: maximum draft nodes per step (static shape, dynamic, n-gram) or guesses
            per step G (lookahead).
        temperature: 0 = greedy; > 0 samples, verified losslessly.
        max_new_tokens: tokens to generate.
        seed: seeds drafting and verification.
    """

    prompt: str
    strategy: str = "dynamic"
    width: int = 2
    depth: int = 4
    budget: int = 16
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
        that differ only there share one cache entry (a chain ignores width and budget)."""
        temperature = round(float(self.temperature), 6)
        if self.strategy == "chain":
            return replace(self, width=1, budget=self.depth, temperature=temperature)
        if self.strategy == "static shape":
            full = sum(self.width ** d for d in range(1, self.depth + 1))
            return replace(self, budget=min(self.budget, full), temperature=temperature)
        return replace(self, temperature=temperature)


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
        self._on_step = on_step

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


class Explorer:
    """The explorer widget and its result cache.

    Args:
        pair: the target and draft models.
        settings: the initial settings (computed before the widget is shown).
        background: compute later changes in a background thread (True in notebooks;
            False makes every change synchronous, for scripts and tests).

    Attributes:
        widget: the ``ipywidgets`` box to display.
        results: generations computed so far, keyed by canonical settings.
        computations: how many generations were run (cache hits do not count).
    """

    def __init__(self, pair: ModelPair, settings: ExplorerSettings, *, background: bool = True) -> None:
        import ipywidgets as w

        self.pair = pair
        self.background = background
        self.results: dict[ExplorerSettings, GenerationResult] = {}
        self._lock = threading.Lock()
        self._pending: ExplorerSettings | None = None
        self._busy = False
        self._idle = threading.Event()
        self._idle.set()
        self._shown: ExplorerSettings | None = None
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
        self.stats = w.HTML()
        self.tree_out = w.Output(layout=w.Layout(overflow="auto", max_width="100%"))
        self.tree_out.add_class("specviz-tree")
        self.mask_out = w.Output(layout=w.Layout(overflow="auto", max_width="100%"))
        self.mask_out.add_class("specviz-mask")
        self.steps_out = w.Output(layout=w.Layout(overflow="auto", max_width="100%"))
        self.steps_out.add_class("specviz-steps")
        self._fixed = dict(max_new_tokens=settings.max_new_tokens, seed=settings.seed)

        controls = w.VBox([
            self.prompt,
            w.HBox([self.strategy, self.temperature]),
            w.HBox([self.width, self.depth, self.budget]),
            w.HBox([self.progress, self.status]),
        ])
        self.widget = w.VBox([controls, w.HBox([self.step, self.show_mask]), self.stats,
                              self.tree_out, self.mask_out, self.steps_out])
        self.widget.add_class("specviz-explorer")

        self._sync_enabled()
        self.results[settings.canonical()] = run_settings(settings, pair)
        self.computations += 1
        self._show(settings.canonical(), reset_step=True)
        for control in (self.prompt, self.strategy, self.width, self.depth, self.budget, self.temperature):
            control.observe(self._on_settings, names="value")
        self.step.observe(self._on_step, names="value")
        self.show_mask.observe(self._on_step, names="value")

    # -- settings -> result ------------------------------------------------------------------
    def settings(self) -> ExplorerSettings:
        """The settings the controls show now."""
        return ExplorerSettings(prompt=self.prompt.value, strategy=self.strategy.value,
                                width=self.width.value, depth=self.depth.value, budget=self.budget.value,
                                temperature=float(self.temperature.value), **self._fixed)

    def _sync_enabled(self) -> None:
        strategy = self.strategy.value
        self.width.disabled = strategy == "chain"
        self.budget.disabled = strategy == "chain"
        labels = _SLIDER_LABELS.get(strategy, ("width (top-k)", "depth", "budget"))
        self.width.description, self.depth.description, self.budget.description = labels

    def _on_settings(self, change) -> None:
        self._sync_enabled()
        try:
            key = self.settings().canonical()
        except ValueError as err:
            self.status.value = f"<span style='color:#D55E00'>{err}</span>"
            return
        if key in self.results:
            if not self._busy:
                self.status.value = ""
            self._show(key, reset_step=True)
            return
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
        self.status.value = "computing…"

        def advance(step: StepTrace) -> None:
            self.progress.value = min(self.progress.max, self.progress.value + step.acceptance.tau)

        try:
            result = run_settings(key, self.pair, on_step=advance)
        except Exception as err:  # shown in the widget; the explorer keeps working
            self.status.value = f"<span style='color:#D55E00'>failed: {type(err).__name__}: {err}</span>"
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
    def _show(self, key: ExplorerSettings, reset_step: bool) -> None:
        result = self.results[key]
        self._shown = key
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

    def _draw(self) -> None:
        result = self.results[self._shown]
        tokenizer = self.pair.target.tokenizer
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

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def _load(model: str | ModelPair, dtype: str | None, device: str | None) -> ModelPair:
    if isinstance(model, ModelPair):
        return model
    if model == "tiny":
        return tiny_pair(seed=0, dtype=dtype or "fp32", device=device or "cpu")
    if model == "builtin":
        return load_pair(dtype=dtype or "bf16", device=device)
    raise ValueError(f"model must be one of {MODELS} or a ModelPair, got {model!r}")


def explore(model: str | ModelPair = "tiny", prompt: str = "def fibonacci(n):", *, strategy: str = "dynamic",
            width: int = 2, depth: int = 4, budget: int = 16, temperature: float = 0.0,
            max_new_tokens: int = 24, seed: int = 0, dtype: str | None = None, device: str | None = None,
            background: bool = True) -> Explorer:
    """Open the explorer (display the returned object, e.g. as a cell's last expression).

    Args:
        model: "tiny" (random tiny pair, instant), "builtin" (Qwen2.5-Coder 1.5B target with
            the 0.5B draft) or a loaded :class:`~specviz.models.ModelPair`.
        prompt: initial prompt.
        strategy, width, depth, budget, temperature: initial control values
            (see :class:`ExplorerSettings`).
        max_new_tokens: tokens generated per setting.
        seed: random seed of drafting and verification.
        dtype: weight mode of a model given by name (``fp32``, ``bf16``, ``int8``, ``w8a8``,
            ...); None: bf16 for the builtin pair, fp32 for the tiny one.
        device: where a model given by name runs (``auto``, ``cpu``, ``cuda``, ``mps``);
            None: ``auto`` for the builtin pair, the CPU for the tiny one.
        background: compute changes in a background thread.

    Raises:
        ValueError: an unknown model, weight mode or device, or an out-of-range setting.
    """
    settings = ExplorerSettings(prompt=prompt, strategy=strategy, width=width, depth=depth, budget=budget,
                                temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    return Explorer(_load(model, dtype, device), settings, background=background)

