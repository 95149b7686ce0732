"""End-to-end decoding speed: the methods, one timed generation, and what a benchmark CSV says.

``python -m specviz.bench`` (:mod:`specviz.bench.__main__`) decodes the same prompts with
transformers' own decoding and with specviz's strategies through :func:`run_method`, and
reports how much faster each is than plain decoding of the target (:func:`summarize`).

**Methods** (``--methods``; ``--list-methods`` prints the grammar):

* ``plain`` - transformers' ``target.generate()`` alone (greedy, or sampling at
  ``--temperature``): what a user would otherwise run, and the baseline of every
  speedup. It is always measured.
* ``plain-bf16`` - ``target.generate()`` of the target loaded in bf16 whatever the run's
  weight mode (``--dtype``) is: the everyday baseline that a faster weight mode is judged
  against (its ``speedup`` is relative to ``plain`` in the run's mode).
* ``hf-assisted`` - ``target.generate(assistant_model=draft)``, transformers' assisted
  generation with its defaults (up to 20 draft tokens per step, cut when the
  assistant's confidence falls below 0.4; transformers tunes that threshold only when
  scikit-learn is installed, which the run header reports).
* ``hf-prompt-lookup`` - ``target.generate(prompt_lookup_num_tokens=10)``, transformers'
  prompt-lookup decoding; 10 is the default of its candidate generator, matching
  n-grams of up to 2 tokens.
* ``specviz-plain`` - :func:`specviz.decode.plain_generate`, a sanity row: if specviz's
  own target-only loop were much faster than ``plain``, speedups over ``plain`` would
  flatter specviz rather than speculative decoding.
* specviz strategies, e.g. ``chain-k4``, ``tree-2x2x1``, ``dynamic``, ``adaptive``,
  ``ngram``, ``ngram-adaptive``, ``ngram-trie``, ``merged``, ``fallback``, ``switch``, ``self-spec``
  (:data:`specviz.draft.registry.STRATEGIES`),
  run by :func:`specviz.decode.speculative_generate` with the greedy verifier, or at a
  temperature with ``chain`` (chains) or ``topk`` (trees and n-gram drafts; their
  siblings are deterministic), unless ``--verifier`` says otherwise.

**Fairness.** Every method gets the same chat-templated prompt ids, the same
``max_new_tokens``, the same end-of-sequence ids (the target's, as specviz uses them)
and, at a temperature, the same sampling settings (no top-k / top-p) and seed per
prompt. Methods stop at end-of-sequence, so they may produce different numbers of
tokens; every rate is per generated token. Runs are interleaved: for each (repeat,
prompt) every method runs once, in an order rotated by one method per prompt, after
one short untimed warm-up generation per method. Torch's thread count is left at its
default unless ``--threads`` sets it, and recorded.

**Definitions** (one CSV row per method, prompt and repeat):

* ``tokens_per_s`` = generated tokens / wall time of the call (prefill included);
* ``speedup`` = ``tokens_per_s`` / plain's ``tokens_per_s`` on the same prompt and
  repeat (= plain's wall time per token / the method's); a method's *mean speedup* is
  the mean of its per-prompt speedups;
* ``target_calls`` = forwards of the target model, counted by a hook on it (specviz's
  speculative loop adds one prefill call that commits no token);
* ``steps`` = target calls that commit tokens (transformers: every call; specviz: its
  verification steps); ``tau`` = generated tokens / steps, tokens committed per target
  call (1.0 for plain decoding);
* ``drafted`` / ``accepted`` draft tokens and ``acceptance_rate`` = accepted / drafted.
  specviz reads them from its step traces (:func:`specviz.metrics.summarize_steps`);
  for transformers' methods they come from the tokens fed to the target: the first
  call feeds the prompt plus the draft, every later call the one committed token its
  cache lacks plus the draft, and every call commits its accepted tokens plus one;
* ``vs_hf_assisted`` (summary) = mean speedup / hf-assisted's mean speedup in the same CSV;
* ``matches_plain`` (greedy only) = the output ids equal plain's. In bf16 a batched
  verification and a one-token decode can round differently and flip a near-tie, so a
  mismatch is reported, not an error; ``prefix_match`` says where outputs part;
* ``draft_s`` / ``verify_s`` - specviz's drafting and target-plus-verification time;
* ``position`` - the method's place in its prompt's run order (0 = first); ``load1`` -
  the machine's 1-minute load average when the call started (timings taken on a busy
  machine show it here); ``output_ids`` - the generated ids, space-separated;
* ``device_name`` - the CPU or GPU the models ran on; ``bandwidth_gb_s`` - its memory
  bandwidth, measured once per run with a copy kernel
  (:func:`~specviz.models.device.copy_bandwidth`); ``bound_tokens_per_s`` (on the rows of
  :data:`PLAIN_METHODS`) - plain decoding's bandwidth-bound limit, the bandwidth over the
  weight bytes a decoding step reads (:func:`~specviz.bench.serving.decode_bytes`): how far
  ``tokens_per_s`` is from it says how much of a step is the weights' reading and how much
  is everything else (kernel launches, Python, compute).

Dimension legend: P = prompt tokens.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch

from specviz.models.device import synchronize
from specviz.draft.registry import STRATEGIES, Family, MethodSpec, Param, parse_name, rename_methods

__all__ = [
    "PEER_METHODS",
    "LLAMA_METHODS",
    "PEERS",
    "DEFAULT_METHODS",
    "METHOD_GRAMMAR",
    "COLUMNS",
    "PLAIN_METHODS",
    "Generation",
    "BenchSummary",
    "parse_method",
    "run_method",
    "drafter_label",
    "load_results",
    "summarize",
]

#: transformers' own decoding, the peers specviz is compared with
PEER_METHODS: tuple[str, ...] = ("plain", "plain-bf16", "hf-assisted", "hf-prompt-lookup")

#: what ``python -m specviz.bench`` runs unless ``--methods`` says otherwise
DEFAULT_METHODS: tuple[str, ...] = (
    "plain", "hf-assisted", "hf-prompt-lookup", "specviz-plain",
    "chain-k4", "tree-2x2x1", "dynamic", "adaptive", "ngram", "ngram-trie", "merged", "self-spec",
)

#: the benchmark's methods that are not drafting strategies: transformers' own decoding
#: and specviz's target-only loop, spelled in the strategies' grammar
PEERS: tuple[Family, ...] = (
    Family("plain", "plain", r"plain", (), "transformers generate() of the target alone (the baseline)"),
    Family("plain-bf16", "plain-bf16", r"plain-bf16", (),
           "transformers generate() of the target loaded in bf16, whatever --dtype is (the everyday baseline)"),
    Family("hf-assisted", "hf-assisted", r"hf-assisted", (),
           "transformers assisted generation with the draft model as assistant, its defaults"),
    Family("hf-prompt-lookup", "hf-prompt-lookup[-k<K>]", r"hf-prompt-lookup(?:-k(\d+))?", (Param("k", 10),),
           "transformers prompt-lookup decoding, K candidate tokens (default 10)"),
    Family("specviz-plain", "specviz-plain", r"specviz-plain", (),
           "specviz.decode.plain_generate, target alone (sanity row)"),
    Family("llama-plain", "llama-plain", r"llama-plain", (),
           "llama.cpp plain decoding of the target's GGUF file (llama-bench -pg; needs --llama-cpp or PATH)"),
    Family("llama-spec", "llama-spec[-k<K>]", r"llama-spec(?:-k(\d+))?", (Param("k", 3),),
           "llama.cpp speculative decoding, the draft's GGUF proposing up to K tokens (default 3, "
           "llama.cpp's own; llama-speculative-simple)"),
    Family("llama-ngram", "llama-ngram[-n<N>-k<K>]", r"llama-ngram(?:-n(\d+)-k(\d+))?", (Param("n"), Param("k")),
           "llama.cpp prompt-lookup decoding, no draft model: the last N tokens looked up in the context, up to K "
           "proposed (default: llama.cpp's own sizes; llama-speculative-simple --spec-type ngram-simple)"),
)

#: the peers run by llama.cpp's programs (:mod:`specviz.bench.llama`)
LLAMA_METHODS: tuple[str, ...] = ("llama-plain", "llama-spec", "llama-ngram")

#: the method names ``--methods`` accepts
METHOD_GRAMMAR: tuple[Family, ...] = PEERS + STRATEGIES

#: CSV columns, in order
COLUMNS: tuple[str, ...] = (
    "method", "question_id", "category", "repeat", "position", "prompt_tokens", "new_tokens", "wall_s",
    "tokens_per_s", "speedup", "target_calls", "steps", "tau", "drafted", "accepted", "acceptance_rate",
    "matches_plain", "prefix_match", "stop", "draft_s", "verify_s", "drafter", "verifier", "temperature",
    "max_new_tokens", "seed", "dtype", "draft_dtype", "draft_layers", "device", "target", "draft", "threads", "load1",
    "device_name", "bandwidth_gb_s", "bound_tokens_per_s", "output_ids",
)
#: the methods that decode the target alone in the run's weight mode: their rows carry the
#: bandwidth-bound limit of plain decoding (``bound_tokens_per_s``)
PLAIN_METHODS: tuple[str, ...] = ("plain", "specviz-plain")


def parse_method(name: str) -> MethodSpec:
    """Parse a method name of :data:`METHOD_GRAMMAR` (a peer or a drafting strategy).

    Raises:
        ValueError: an unknown name (the message lists the grammar) or a parameter < 1.
    """
    return parse_name(name, METHOD_GRAMMAR)


# -- one timed generation ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Generation:
    """One timed generation of one method on one prompt.

    Attributes:
        output_ids: generated token ids (up to and including an end-of-sequence token).
        wall_s: wall time of the call.
        target_calls: forwards of the target model.
        steps: target calls that commit tokens.
        drafted: draft tokens proposed.
        accepted: draft tokens accepted.
        stop: "eos", "max_new_tokens" or "context_limit".
        draft_s: time spent drafting (specviz strategies; NaN for the others).
        verify_s: time spent in target forwards plus verification (specviz strategies;
            NaN for the others).
        drafter: what proposed the drafts, in words.
        verifier: the specviz verification rule ("" for other methods).
        new_tokens: the number of tokens generated, where ``output_ids`` cannot hold them
            (None: ``len(output_ids)``).
    """

    output_ids: tuple[int, ...]
    wall_s: float
    target_calls: int
    steps: int
    drafted: int
    accepted: int
    stop: str
    draft_s: float
    verify_s: float
    drafter: str
    verifier: str
    new_tokens: int | None = None

    @property
    def n_tokens(self) -> int:
        """Tokens generated: ``new_tokens`` where the method reports a count but no ids
        (llama.cpp's plain decoding), else ``len(output_ids)``."""
        return len(self.output_ids) if self.new_tokens is None else self.new_tokens


class _TargetCalls:
    """Counts the target model's forwards and the tokens fed to each, with a hook on its
    input embedding (called once per forward, by transformers' own forward and by the
    engine's layer-by-layer one alike; a hook on the model itself would make the engine
    fall back to ``model(...)``)."""

    def __init__(self, model) -> None:
        self.model = model
        self.fed: list[int] = []

    def _hook(self, module, args, kwargs) -> None:
        ids = kwargs.get("input", args[0] if args else None)
        self.fed.append(0 if ids is None else int(ids.shape[-1]))

    def __enter__(self) -> "_TargetCalls":
        self._handle = self.model.get_input_embeddings().register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def _cut_at_eos(tokens: list[int], eos: Sequence[int]) -> tuple[int, ...]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tuple(tokens[:i + 1])
    return tuple(tokens)


_BF16_TWINS: dict[tuple[int, str], object] = {}


def _bf16_twin(target):
    """``target`` in bf16: a cast copy of a model in a float mode, else loaded again by name
    (kept for the next call)."""
    if target.weight_mode == "bf16":
        return target
    key = (id(target), target.name)
    if key not in _BF16_TWINS:
        from specviz.models.loading import load_model
        from specviz.quant.weights import WEIGHT_MODES

        source = target if WEIGHT_MODES[target.weight_mode].convert is None else target.name
        _BF16_TWINS.clear()  # one twin at a time: a 1.5B bf16 copy is 3 GB
        _BF16_TWINS[key] = load_model(source, "bf16", device=target.device)
    return _BF16_TWINS[key]


def _run_peer(spec: MethodSpec, pair, ids: list[int], max_new_tokens: int, temperature: float, seed: int,
              eos: tuple[int, ...]) -> Generation:
    from specviz.quant.passes import prompt_in_one_pass

    model = (_bf16_twin(pair.target) if spec.family == "plain-bf16" else pair.target).model
    pad = pair.target.tokenizer.pad_token_id
    kwargs: dict = {"max_new_tokens": max_new_tokens, "eos_token_id": list(eos),
                    "pad_token_id": eos[0] if pad is None else pad}
    if temperature == 0.0:
        kwargs["do_sample"] = False
    else:
        # no top-k / top-p, so transformers samples the same distribution as specviz
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    drafter = "none"
    if spec.family == "hf-assisted":
        kwargs["assistant_model"] = pair.draft.model
        drafter = f"assistant {pair.draft.name}"
    elif spec.family == "hf-prompt-lookup":
        kwargs["prompt_lookup_num_tokens"] = spec.arguments()["k"]
        drafter = f"prompt lookup k={kwargs['prompt_lookup_num_tokens']}"
    prompt = torch.tensor([ids], device=model.device)  # (1, P)
    # the prompt's positions in one activation pass in the token modes, as specviz's own prefills
    with _TargetCalls(model) as calls, prompt_in_one_pass([model, kwargs.get("assistant_model")], len(ids)):
        # transformers samples from torch's global generator and takes no generator argument
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)  # (1, P + new)
        synchronize(model.device)
        wall = time.perf_counter() - start
    new = _cut_at_eos(out[0, len(ids):].tolist(), eos)
    steps = len(calls.fed)
    # The first call feeds the prompt plus its draft, each later one the committed token
    # its cache lacks plus its draft (transformers crops the cache to the committed length - 1).
    drafted = sum(calls.fed) - len(ids) - (steps - 1)
    stop = "eos" if new and new[-1] in eos else "max_new_tokens"
    return Generation(new, wall, steps, steps, drafted, len(new) - steps, stop, math.nan, math.nan, drafter, "")


def _run_llama(spec: MethodSpec, pair, ids: list[int], max_new_tokens: int, temperature: float, seed: int,
               llama_cpp, eos: tuple[int, ...]) -> Generation:
    import torch

    from specviz.bench.llama import llama_ngram, llama_plain, llama_speculative
    from specviz.models.builtin import BUILTIN_MODELS, builtin_gguf

    if llama_cpp is None:
        raise ValueError(f"method {spec.name!r} needs llama.cpp's programs (--llama-cpp DIR, or on PATH)")
    for m in (pair.target, pair.draft):
        if m.name.lower() not in BUILTIN_MODELS:
            raise ValueError(f"method {spec.name!r} runs llama.cpp on the built-in pair's GGUF files; "
                             f"{m.name!r} is not a built-in model")
    threads = torch.get_num_threads()
    target = builtin_gguf(pair.target.name)
    if spec.family == "llama-plain":
        run = llama_plain(Path(llama_cpp), target, len(ids), max_new_tokens, threads)
        return Generation((), run.wall_s, run.steps, run.steps, 0, 0, "max_new_tokens", math.nan, math.nan,
                          "none", "", new_tokens=run.new_tokens)
    k = spec.arguments()["k"]
    tok = pair.target.tokenizer
    if spec.family == "llama-ngram":
        n = spec.arguments()["n"]
        run = llama_ngram(Path(llama_cpp), target, tok.decode(ids), max_new_tokens, threads, n, k, temperature, seed)
        drafter = "llama.cpp ngram-simple" + (f" n={n} k={k}" if n is not None else " (its default sizes)")
    else:
        run = llama_speculative(Path(llama_cpp), target, builtin_gguf(pair.draft.name), tok.decode(ids),
                                max_new_tokens, k, threads, temperature, seed)
        drafter = f"llama.cpp draft {pair.draft.name} k={k}"
    out = _cut_at_eos(tok(run.text, add_special_tokens=False).input_ids[:max_new_tokens], eos)
    stop = "eos" if run.new_tokens < max_new_tokens else "max_new_tokens"
    return Generation(out, run.wall_s, run.steps, run.steps, run.drafted, run.accepted, stop, math.nan, math.nan,
                      drafter, "", new_tokens=run.new_tokens)


def run_method(spec: MethodSpec, pair, ids: list[int], *, max_new_tokens: int, temperature: float = 0.0,
               seed: int = 0, drafter=None, verifier: str = "", llama_cpp=None) -> Generation:
    """Time one generation of ``spec`` on the prompt ids ``ids``.

    Args:
        spec: the method.
        pair: the :class:`~specviz.models.ModelPair`.
        ids: prompt token ids (already chat-templated).
        max_new_tokens: token budget.
        temperature: 0 for greedy decoding.
        seed: seeds the sampling (specviz's generator, torch's global one for transformers).
        drafter: the strategy's drafter (:func:`specviz.draft.registry.build_drafter`; built once, reused).
        verifier: the strategy's verification rule (:meth:`MethodSpec.verifier`).
        llama_cpp: the directory of llama.cpp's programs, for the ``llama-*`` peers
            (:func:`specviz.bench.llama.find_llama_cpp`).
    """
    from specviz.decode.engine import (
        eos_token_ids,
        plain_generate,
        speculative_generate,
    )
    from specviz.metrics.acceptance import summarize_steps
    from specviz.sampling import SamplingConfig

    eos = eos_token_ids(pair.target)
    if spec.family in LLAMA_METHODS:
        return _run_llama(spec, pair, ids, max_new_tokens, temperature, seed, llama_cpp, eos)
    if spec.family in PEER_METHODS:
        return _run_peer(spec, pair, ids, max_new_tokens, temperature, seed, eos)
    config = SamplingConfig(temperature=temperature)
    target = pair.target
    if spec.family == "specviz-plain":
        with _TargetCalls(target.model) as calls:
            start = time.perf_counter()
            res = plain_generate(target, ids, max_new_tokens=max_new_tokens, config=config, seed=seed, chat=False)
            wall = time.perf_counter() - start
        n = len(calls.fed)
        return Generation(res.output_ids, wall, n, n, 0, 0, res.stop_reason, math.nan, math.nan, "none", "")
    if drafter is None:
        raise ValueError(f"method {spec.name!r} needs its drafter (build_drafter)")
    with _TargetCalls(target.model) as calls:
        start = time.perf_counter()
        res = speculative_generate(target, drafter, ids, max_new_tokens=max_new_tokens, config=config,
                                   verifier=verifier, seed=seed, chat=False, analyze=False)
        wall = time.perf_counter() - start
    stats = summarize_steps(res.steps, new_tokens=res.n_new_tokens)
    return Generation(res.output_ids, wall, len(calls.fed), stats.n_steps, stats.drafted_tokens,
                      stats.accepted_tokens, res.stop_reason, stats.draft_time_s, stats.verify_time_s,
                      drafter_label(drafter), verifier)


def drafter_label(drafter) -> str:
    """The benchmark's ``drafter`` column for a strategy's drafter: its name, plus the
    trained heads' result directory for head drafters (``medusa(n=4,d=3)
    heads=medusa-bf16-...``), so that rows of other heads are told apart."""
    path = getattr(drafter, "heads_path", None)
    return drafter.name if path is None else f"{drafter.name} heads={Path(path).name}"


# -- results --------------------------------------------------------------------------------------

def load_results(path: str | os.PathLike) -> pd.DataFrame:
    """Read a benchmark CSV (``output_ids`` stay space-separated strings).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file lacks columns of :data:`COLUMNS`.

    Methods stored under an older spelling of their name read as the current one
    (:func:`~specviz.draft.registry.rename_methods`); ``df.attrs["renamed_methods"]`` maps
    each old name read to its current name. Files written before the ``device`` column
    existed were measured on the CPU and read with ``device`` "cpu"; before
    ``draft_dtype``, both models ran in ``dtype``; before ``draft_layers``, the draft ran
    its modules' forward ("modules"); files without the device's name and bandwidth read
    them as unknown ("" and NaN).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"benchmark results not found: {path}")
    df = pd.read_csv(path, dtype={"output_ids": str, "method": str, "category": str})
    missing = [c for c in COLUMNS if c not in df.columns]
    if "draft_dtype" in missing and "dtype" in df.columns:
        df.insert(list(df.columns).index("dtype") + 1, "draft_dtype", df["dtype"])
        missing.remove("draft_dtype")
    if "draft_layers" in missing and "draft_dtype" in df.columns:
        df.insert(list(df.columns).index("draft_dtype") + 1, "draft_layers", "modules")
        missing.remove("draft_layers")
    for col in ("device_name", "bandwidth_gb_s", "bound_tokens_per_s"):
        if col in missing:
            df.insert(list(df.columns).index("output_ids") if "output_ids" in df.columns else len(df.columns), col,
                      "" if col == "device_name" else math.nan)
            missing.remove(col)
    if missing == ["device"]:
        df.insert(COLUMNS.index("device"), "device", "cpu")
        missing = []
    if missing:
        raise ValueError(f"{path} is not a specviz benchmark CSV (missing columns {missing})")
    df.attrs["renamed_methods"] = rename_methods(df, ("method",))
    return df


def _as_fraction(values: pd.Series) -> float:
    """Mean of a True/False column read from CSV (NaN when empty)."""
    known = values.dropna().map(lambda v: str(v) == "True")
    return float(known.mean()) if len(known) else math.nan


@dataclass(frozen=True)
class BenchSummary:
    """What a benchmark CSV says, per method and per category.

    Attributes:
        per_method: one row per method: ``prompts``, mean ``tokens_per_s``, mean
            ``speedup``, pooled ``tau`` (tokens / steps) and ``acceptance_rate``
            (accepted / drafted), ``vs_hf_assisted``, ``matches_plain`` (fraction); given
            the cost model's wall times, also ``predicted`` (the mean over prompts of the
            speedup those times give against the same plain run) and ``error``
            (measured / predicted - 1).
        per_category: mean speedup, one row per method, one column per category.
        best_method: the specviz strategy with the highest mean speedup (None if none).
        best_speedup: its mean speedup.
        assisted_speedup: hf-assisted's mean speedup (NaN if not measured).
    """

    per_method: pd.DataFrame
    per_category: pd.DataFrame
    best_method: str | None
    best_speedup: float
    assisted_speedup: float

    @property
    def ratio_to_assisted(self) -> float:
        """The best strategy's mean speedup / hf-assisted's."""
        return self.best_speedup / self.assisted_speedup if self.assisted_speedup > 0 else math.nan

    @property
    def line(self) -> str:
        """The one-line summary the CLI prints last."""
        if self.best_method is None:
            return "best specviz strategy: none measured"
        head = f"best specviz strategy: {self.best_method} | mean speedup {self.best_speedup:.2f}x over plain decoding"
        if math.isnan(self.assisted_speedup):
            return head + " | hf-assisted not measured"
        return head + f" | {self.ratio_to_assisted:.2f}x hf-assisted's speedup ({self.assisted_speedup:.2f}x)"


def summarize(rows: pd.DataFrame, methods: Sequence[str] | None = None,
              predicted_wall: pd.Series | None = None) -> BenchSummary:
    """Aggregate benchmark rows (:func:`load_results`) per method and per category.

    Args:
        rows: the CSV's rows.
        methods: methods to report, in this order (default: as they first appear).
        predicted_wall: the cost model's wall time of each row, aligned with ``rows``
            (:func:`specviz.bench.cost.predicted_wall_s`; NaN for rows it does not model).
    """
    order = list(dict.fromkeys(rows["method"])) if methods is None else list(methods)
    records = []
    for method in order:
        r = rows[rows["method"] == method]
        if r.empty:
            continue
        drafted = r["drafted"].sum()
        records.append({
            "method": method, "prompts": len(r), "tokens_per_s": r["tokens_per_s"].mean(),
            "speedup": r["speedup"].mean(), "tau": r["new_tokens"].sum() / r["steps"].sum(),
            "acceptance_rate": r["accepted"].sum() / drafted if drafted > 0 else math.nan,
            "matches_plain": _as_fraction(r["matches_plain"]),
        })
    per_method = pd.DataFrame.from_records(
        records, columns=["method", "prompts", "tokens_per_s", "speedup", "tau", "acceptance_rate", "matches_plain"])
    speed = dict(zip(per_method["method"], per_method["speedup"]))
    assisted = speed.get("hf-assisted", math.nan)
    per_method.insert(4, "vs_hf_assisted", per_method["speedup"] / assisted)
    if predicted_wall is not None:
        # the speedup the modelled wall time gives against the same prompt's plain run
        modelled = rows["speedup"] * rows["wall_s"] / predicted_wall.reindex(rows.index)
        mean = modelled.groupby(rows["method"]).mean()
        per_method.insert(5, "predicted", [float(mean.get(m, math.nan)) for m in per_method["method"]])
        per_method.insert(6, "error", per_method["speedup"] / per_method["predicted"] - 1)
    present = [m for m in order if m in speed]
    per_category = (rows[rows["method"].isin(present)]
                    .pivot_table(index="method", columns="category", values="speedup", aggfunc="mean", sort=False)
                    .reindex(present))
    per_category.columns.name = None
    strategies = [m for m in present if parse_method(m).is_strategy]
    best = max(strategies, key=lambda m: speed[m]) if strategies else None
    return BenchSummary(per_method, per_category, best, speed[best] if best else math.nan, assisted)
