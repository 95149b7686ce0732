"""An interactive explorer for JupyterLab: change the drafting strategy with sliders and
watch the draft trees, their acceptance and the statistics follow.

``explore()`` in a notebook cell opens it::

    from specviz.render.explorer import explore
    explore()                      # replay: recorded steps of the built-in pair, instant
    explore(model="builtin")       # live: Qwen2.5-Coder 1.5B target + 0.5B draft
    explore(model="tiny")          # live on a random tiny pair: instant, gibberish text

Controls: a prompt box, the strategy (a family of :mod:`specviz.draft.registry`, shown with a
description: chain / tree / dynamic / ngram-trie / ngram-adaptive (prompt lookup whose chain
length is chosen every step for expected throughput) / fallback (prompt lookup where it finds
a match, else the draft model's chain) / switch (each step the lookup's or the draft model's
chain, whichever promises more tokens per second) / lookahead, and the trained heads: a
Medusa tree, an EAGLE-2 tree, and merged (prompt lookup's chain of up to ``depth`` tokens and
the EAGLE-2 tree in one budget), which draft with the heads ``python -m specviz.heads train``
left in the specviz cache, or those
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

This module holds the widget (:class:`Explorer`) and :func:`explore`; the settings and
the strategy each names live in :mod:`specviz.render.explorer_settings`, recordings and
their replay in :mod:`specviz.render.recording`. Their public names are re-exported
here, so they import from this module as before.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import replace
from html import escape as _escape
from pathlib import Path
from typing import Any, Callable

from specviz.decode.records import GenerationResult, StepTrace
from specviz.models.loading import load_pair
from specviz.models.tiny import tiny_pair
from specviz.models.types import ModelPair
from specviz.render import (
    drafter_strip_figure,
    drafting_parts,
    figure_mimebundle,
    lookahead_mask_figure,
    lookahead_step_figure,
    mask_figure,
    stats_html,
    step_tree_figure,
    step_view_figure,
)
from specviz.render.explorer_settings import (
    BUDGET_RANGE,
    CHAINS,
    DEFAULT_PROMPT,
    DEPTH_RANGE,
    DESCRIPTIONS,
    SLIDER_LABELS,
    STRATEGIES,
    TEMPERATURE_RANGE,
    WIDTH_RANGE,
    ExplorerSettings,
    build_drafter,
    run_settings,
    strategy_spec,
    verifier_for,
)
from specviz.render.recording import (
    DEFAULT_TRACES,
    Recording,
    load_recording,
    main,
    record_traces,
    recording_settings,
    replay_models,
)

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

#: model choices of :func:`explore`: recorded traces of the built-in pair, the random tiny
#: pair, or the built-in Qwen pair live
MODELS: tuple[str, ...] = ("replay", "tiny", "builtin")


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
        self._fixed = dict(max_new_tokens=settings.max_new_tokens, seed=settings.seed)

        self._build_controls(w, settings)
        self._build_outputs(w)
        self._build_layout(w, recording)
        self._sync_enabled()
        self._show_first(settings)
        self._connect()

    # -- building ------------------------------------------------------------------------------
    def _build_controls(self, w: Any, settings: ExplorerSettings) -> None:
        """The input controls (prompt, strategy, sliders, mask checkbox) at ``settings``,
        and the progress bar; ``w`` is the ``ipywidgets`` module."""
        self.prompt = w.Textarea(value=settings.prompt, description="prompt", continuous_update=False,
                                 layout=w.Layout(width="100%", height="4em"))
        self.strategy = w.Dropdown(options=[(f"{name}: {DESCRIPTIONS[name]}", name) for name in STRATEGIES],
                                   value=settings.strategy, description="strategy")
        slider = dict(continuous_update=False, style={"description_width": "7em"})
        self.width = w.IntSlider(value=settings.width, min=WIDTH_RANGE[0], max=WIDTH_RANGE[1],
                                 description="width (top-k)", **slider)
        self.depth = w.IntSlider(value=settings.depth, min=DEPTH_RANGE[0], max=DEPTH_RANGE[1],
                                 description="depth", **slider)
        self.budget = w.IntSlider(value=settings.budget, min=BUDGET_RANGE[0], max=BUDGET_RANGE[1],
                                  description="budget", **slider)
        self.temperature = w.FloatSlider(value=settings.temperature, min=TEMPERATURE_RANGE[0],
                                         max=TEMPERATURE_RANGE[1], step=0.1, readout_format=".1f",
                                         description="temperature", **slider)
        self.step = w.IntSlider(value=0, min=0, max=0, description="step",
                                layout=w.Layout(width="60%"), **slider)
        self.show_mask = w.Checkbox(value=False, description="show attention mask")
        self.progress = w.IntProgress(value=0, min=0, max=settings.max_new_tokens, description="tokens",
                                      layout=w.Layout(visibility="hidden"))

    def _build_outputs(self, w: Any) -> None:
        """The status lines, the "not recorded" box with its two buttons, the statistics and
        the three figure outputs; ``w`` is the ``ipywidgets`` module."""
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

    def _build_layout(self, w: Any, recording: Recording | None) -> None:
        """The replay banner (with a ``recording``) and :attr:`widget`, the box holding
        every control and output; ``w`` is the ``ipywidgets`` module."""
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

    def _show_first(self, settings: ExplorerSettings) -> None:
        """Draw the initial ``settings``: recorded or cached, computed now in live mode
        (synchronously), or else the "not recorded" box."""
        key = settings.canonical()
        if key not in self.results and self.live:
            self.results[key] = run_settings(key, self._models())
            self.computations += 1
        if key in self.results:
            self._show(key, reset_step=True)
        else:
            self._show_missing(settings)

    def _connect(self) -> None:
        """Make the controls and buttons call their handlers."""
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
        """The pair to compute with, loaded by ``live_pair`` the first time in replay mode."""
        if self.pair is None:
            if self._live_pair is None:
                raise RuntimeError("this explorer has no models to compute with")
            self.pair = self._live_pair()
        return self.pair

    def _sync_enabled(self) -> None:
        """Enable the sliders the strategy uses and name them as it does."""
        strategy = self.strategy.value
        self.width.disabled = strategy == "chain"
        self.budget.disabled = strategy in CHAINS
        labels = SLIDER_LABELS.get(strategy, ("width (top-k)", "depth", "budget"))
        self.width.description, self.depth.description, self.budget.description = labels

    def _on_settings(self, change) -> None:
        """A control changed: draw the settings' result, say they are not recorded, or compute
        them."""
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
        """Compute ``key``: now, or in the background thread (only the latest request waits
        there)."""
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
        """Move the controls to the nearest recorded setting."""
        if self._nearest is not None:
            self.apply(self._nearest)

    def _worker(self) -> None:
        """The background thread: compute the latest pending request until none is left."""
        while True:
            with self._lock:
                key, self._pending = self._pending, None
                if key is None:
                    self._busy = False
                    self._idle.set()
                    return
            self._compute(key)

    def _compute(self, key: ExplorerSettings) -> None:
        """Run ``key``'s generation with a progress bar, cache it, and draw it if the controls
        still show it."""
        self.progress.max = key.max_new_tokens
        self.progress.value = 0
        self.progress.layout.visibility = "visible"

        def advance(step: StepTrace) -> None:
            """Count one finished step's tokens on the progress bar."""
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
        """Draw ``key``'s cached result (with ``reset_step``, fit the step slider to its steps)."""
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
        """The step slider or the mask checkbox changed: draw again."""
        if self._shown is not None:
            self._draw()

    def tokenizer_for(self, key: ExplorerSettings) -> Any:
        """What decodes the tokens of ``key``'s result: the recording's token table for a
        recorded setting, the target's tokenizer for a computed one."""
        if key in self.recorded and self.recording is not None:
            return self.recording.tokenizer
        return self.pair.target.tokenizer

    def _draw(self) -> None:
        """Draw the shown result's statistics and figures at the step slider's step."""
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
        views = [step_view_figure(result, tokenizer=tokenizer, highlight_step=s)]
        if drafting_parts(result) is not None:  # a chooser's or cascade's choices, one cell per step
            views.insert(0, drafter_strip_figure(result, highlight_step=s))
        self._display(self.steps_out, *views)

    @staticmethod
    def _display(out, *figs) -> None:
        """Show ``figs`` in the widget output ``out``."""
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
        """The widget view, with :meth:`describe` as its plain text."""
        # the widget view, with a short stable text for front ends (and notebook checks) without widgets
        bundle = self.widget._repr_mimebundle_(**kwargs)
        if isinstance(bundle, dict):
            bundle = {**bundle, "text/plain": self.describe()}
        return bundle


def _load(model: str | ModelPair, dtype: str | None, device: str | None,
          draft_dtype: str | None = None) -> ModelPair:
    """A model given to :func:`explore` by name (``tiny`` or ``builtin``, in ``dtype``, on
    ``device``), or a loaded pair as it is."""
    if isinstance(model, ModelPair):
        if draft_dtype is not None:
            raise ValueError("draft_dtype applies to a model given by name; a loaded ModelPair keeps its weights")
        return model
    if model == "tiny":
        return tiny_pair(seed=0, dtype=dtype or "fp32", device=device or "cpu", draft_dtype=draft_dtype)
    if model == "builtin":
        return load_pair(dtype=dtype or "fp32", device=device, draft_dtype=draft_dtype)
    raise ValueError(f"model must be one of {MODELS} or a ModelPair, got {model!r}")


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
        dtype: weight mode of a model given by name (``fp32``, ``bf16``, ``w8a8-token``,
            ...); None: fp32 (the recording's, in replay mode, which accepts no other).
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
                        live_pair=replay_models(recording, device))
    return Explorer(_load(model, dtype, device, draft_dtype), settings, background=background)


if __name__ == "__main__":
    sys.exit(main())
