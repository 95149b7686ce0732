"""Recorded explorer generations: replaying them without a model, and recording them.

The explorer's replay mode (:func:`specviz.render.explorer.explore` with
``model="replay"``) draws generations of the built-in pair read from a trace file
(:data:`DEFAULT_TRACES`; the file format is :mod:`specviz.render.traces`). This module
holds that side of the explorer (:mod:`specviz.render.explorer` re-exports every public
name here):

* :class:`Recording` and :func:`load_recording` - a trace file read into generations
  keyed by canonical :class:`~specviz.render.explorer_settings.ExplorerSettings`, with
  the nearest recorded setting to any other;
* :func:`recording_settings` - the grid of settings the committed recording holds;
* :func:`record_traces` - records settings into a trace file, resumably;
* :func:`replay_models` - loads the pair a recording was made with, for live computation;
* :func:`main` - the command ``python -m specviz.render.explorer --record [PATH]``.

No tensors appear here: a generation's tensors live in its
:class:`~specviz.decode.records.GenerationResult`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from specviz.decode.records import GenerationResult
from specviz.locations import DATA_DIR
from specviz.models.builtin import BUILTIN_MODELS
from specviz.models.loading import load_pair
from specviz.models.tiny import tiny_pair
from specviz.models.types import ModelPair
from specviz.render.explorer_settings import DEFAULT_PROMPT, STRATEGIES, ExplorerSettings, run_settings
from specviz.render.traces import (
    RecordedTokenizer,
    TraceFile,
    TraceFileError,
    read_traces,
    result_token_ids,
    token_texts,
    write_traces,
)

__all__ = [
    "DEFAULT_TRACES",
    "Recording",
    "load_recording",
    "recording_settings",
    "record_traces",
    "replay_models",
    "main",
]

#: the recorded traces replay mode reads
DEFAULT_TRACES = DATA_DIR / "explorer_traces.json.gz"


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
        """The weight mode the generations were recorded in ("?" if unknown)."""
        return str(self.info.get("weights", "?"))

    @property
    def max_new_tokens(self) -> int:
        """Tokens generated per recorded setting (0 if unknown)."""
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
            """Sort key: how far recorded settings ``k`` are from ``key``."""
            return (k.prompt != key.prompt, (k.max_new_tokens, k.seed) != (key.max_new_tokens, key.seed),
                    k.strategy != key.strategy, abs(k.temperature - key.temperature),
                    abs(k.width - key.width) + abs(k.depth - key.depth) + abs(math.log2(k.budget / key.budget)),
                    STRATEGIES.index(k.strategy), k.depth, k.width, k.budget)

        return min(self.results, key=distance, default=None)


def _recording(traces: TraceFile, path: Path | None) -> Recording:
    """The :class:`Recording` of a read trace file: its generations keyed by canonical
    settings (the first of equal keys kept).

    Raises:
        specviz.render.traces.TraceFileError: settings the explorer does not accept.
    """
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
    """What a recording stores about the pair that made it: model names, weights, device,
    threads and library versions."""
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


def replay_models(recording: Recording, device: str | None) -> Callable[[], ModelPair]:
    """A loader of the pair that made ``recording``, in its weights (on its device unless
    ``device`` says otherwise)."""
    target, draft = str(recording.info.get("target", "")), str(recording.info.get("draft", ""))
    weights = recording.weights
    where = device or str(recording.info.get("device", "cpu"))

    def load() -> ModelPair:
        """Load the built-in pair, or a tiny one, by the recording's model names."""
        if target.lower() in BUILTIN_MODELS and draft.lower() in BUILTIN_MODELS:
            return load_pair(target, draft, dtype=weights, device=where)
        prefix = "tiny-qwen2-seed"
        if target.startswith(prefix) and target[len(prefix):].isdigit():
            return tiny_pair(seed=int(target[len(prefix):]), dtype=weights, device=where)
        raise ValueError(f"the recording's models {target!r} / {draft!r} cannot be loaded by name; "
                         "pass a ModelPair to explore() to compute live")

    return load


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specviz.render.explorer --record [PATH]``: record the replay traces."""
    parser = argparse.ArgumentParser(prog="python -m specviz.render.explorer", description=(
        "Record the explorer's replay traces: the built-in pair's generations for the settings of "
        "recording_settings(), stored after each one, so an interrupted run resumes."))
    parser.add_argument("--record", metavar="PATH", nargs="?", const=str(DEFAULT_TRACES), required=True,
                        help=f"the trace file to write or complete (default {DEFAULT_TRACES})")
    parser.add_argument("--dtype", default="fp32", help="weight mode of the built-in pair (default fp32: a "
                                                     "recording is replayed as the exact reference)")
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
        recording = record_traces(args.record, settings, weights=args.dtype)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    size = Path(args.record).stat().st_size
    print(f"[record] {recording.describe()}; {size / 1024:.0f} KiB in {args.record} "
          f"({time.perf_counter() - start:.0f} s)")
    return 0
