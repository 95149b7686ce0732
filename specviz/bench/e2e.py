"""Benchmarks on this machine: end-to-end decoding speed, and tree attention alone.

``python -m specviz.bench`` decodes the same prompts with transformers' own decoding
and with specviz's strategies, and reports how much faster each is than plain decoding
of the target. ``python -m specviz.bench attention`` times tree attention against
per-path and causal attention (:mod:`specviz.timing`).

**Methods** (``--methods``; ``--list-methods`` prints the grammar):

* ``plain`` - transformers' ``target.generate()`` alone (greedy, or sampling at
  ``--temperature``): what a user would otherwise run, and the baseline of every
  speedup. It is always measured.
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
  ``ngram``, ``ngram-trie``, ``merged``, ``self-spec``, run by
  :func:`specviz.decode.speculative_generate` with the greedy verifier, or at a
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
  machine show it here); ``output_ids`` - the generated ids, space-separated.

Dimension legend: P = prompt tokens.

Rows are appended to the CSV as each (repeat, prompt) finishes; running the same
command again skips the rows already there (``--fresh`` starts over). The last printed
line is the one-line summary of the best specviz strategy.

Usage::

    python -m specviz.bench --limit 7 --max-new-tokens 128                   # one prompt per category
    python -m specviz.bench --limit 7 --max-new-tokens 128 --temperature 0.7
    python -m specviz.bench --methods hf-assisted dynamic-k8-d6-n32 ngram-n4-k10 --out tuning.csv
    python -m specviz.bench attention --budgets 8 16 32 64 --batch-sizes 1 4 --prefix-lens 128 512 2048
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch

from specviz.locations import output_path

__all__ = [
    "PEER_METHODS",
    "DEFAULT_METHODS",
    "METHOD_GRAMMAR",
    "COLUMNS",
    "MethodSpec",
    "Generation",
    "BenchSummary",
    "parse_method",
    "build_drafter",
    "run_method",
    "load_results",
    "summarize",
    "main",
]

#: transformers' own decoding, the peers specviz is compared with
PEER_METHODS: tuple[str, ...] = ("plain", "hf-assisted", "hf-prompt-lookup")

DEFAULT_METHODS: tuple[str, ...] = (
    "plain", "hf-assisted", "hf-prompt-lookup", "specviz-plain",
    "chain-k4", "tree-2x2x1", "dynamic", "adaptive", "ngram", "ngram-trie", "merged", "self-spec",
)


@dataclass(frozen=True)
class _Rule:
    """One line of the method grammar: a pattern whose groups are the family's parameters
    (an absent optional group keeps the constructor's default)."""

    usage: str
    pattern: str
    family: str
    params: tuple[str, ...]
    help: str


#: the method names ``--methods`` accepts, as (usage, regex, family, parameters, help)
METHOD_GRAMMAR: tuple[_Rule, ...] = (
    _Rule("plain", r"plain", "plain", (), "transformers generate() of the target alone (the baseline)"),
    _Rule("hf-assisted", r"hf-assisted", "hf-assisted", (),
          "transformers assisted generation with the draft model as assistant, its defaults"),
    _Rule("hf-prompt-lookup[-k<K>]", r"hf-prompt-lookup(?:-k(\d+))?", "hf-prompt-lookup", ("k",),
          "transformers prompt-lookup decoding, K candidate tokens (default 10)"),
    _Rule("specviz-plain", r"specviz-plain", "specviz-plain", (),
          "specviz.decode.plain_generate, target alone (sanity row)"),
    _Rule("chain-k<K>", r"chain-k(\d+)", "chain", ("k",), "draft-model chain of K tokens"),
    _Rule("tree-<B1>x<B2>x...", r"tree-(\d+(?:x\d+)*)", "tree", ("branching",),
          "static draft-model tree, branching B1 at depth 1, B2 at depth 2, ..."),
    _Rule("dynamic[-k<TOPK>-d<DEPTH>-n<BUDGET>]", r"dynamic(?:-k(\d+)-d(\d+)-n(\d+))?", "dynamic",
          ("topk", "depth", "budget"), "EAGLE-2 dynamic tree (default k4-d5-n16)"),
    _Rule("adaptive[-throughput|-heuristic]", r"adaptive(?:-(throughput|heuristic))?", "adaptive",
          ("schedule",), "draft-model chain of adaptive length (default throughput rule)"),
    _Rule("ngram[-n<N>-k<K>]", r"ngram(?:-n(\d+)-k(\d+))?", "ngram", ("n", "k"),
          "prompt lookup chain, n-grams up to N, K tokens (default n3-k5)"),
    _Rule("ngram-trie[-n<N>-d<DEPTH>-b<BUDGET>]", r"ngram-trie(?:-n(\d+)-d(\d+)-b(\d+))?", "ngram-trie",
          ("n", "depth", "budget"), "trie of several prompt-lookup matches (default n3-d5-b16)"),
    _Rule("merged", r"merged", "merged", (), "SpecInfer merge of a draft-model chain of 4 and an n-gram chain"),
    _Rule("self-spec[-L<LAYERS>][-k<K>]", r"self-spec(?:-L(\d+))?(?:-k(\d+))?", "self-spec", ("n_layers", "k"),
          "target's first LAYERS layers draft a chain of K (default half the layers, k4)"),
)

# Families whose drafts are chains drawn from a draft distribution: Leviathan's rule is
# exact for them under sampling; every other family drafts deterministic siblings.
_CHAIN_FAMILIES = ("chain", "adaptive", "self-spec")

#: CSV columns, in order
COLUMNS: tuple[str, ...] = (
    "method", "question_id", "category", "repeat", "position", "prompt_tokens", "new_tokens", "wall_s",
    "tokens_per_s", "speedup", "target_calls", "steps", "tau", "drafted", "accepted", "acceptance_rate",
    "matches_plain", "prefix_match", "stop", "draft_s", "verify_s", "drafter", "verifier", "temperature",
    "max_new_tokens", "seed", "dtype", "target", "draft", "threads", "load1", "output_ids",
)


@dataclass(frozen=True)
class MethodSpec:
    """A parsed method name.

    Attributes:
        name: the name as given, e.g. ``"tree-2x2x1"``.
        family: the grammar family, e.g. ``"tree"`` (see :data:`METHOD_GRAMMAR`).
        params: ``(parameter, value)`` pairs given in the name; absent ones keep the
            constructor's default.
    """

    name: str
    family: str
    params: tuple[tuple[str, int | str | tuple[int, ...]], ...] = ()

    @property
    def is_peer(self) -> bool:
        """One of transformers' own decoding methods."""
        return self.family in PEER_METHODS

    @property
    def is_strategy(self) -> bool:
        """A specviz speculative strategy (not a peer, not the sanity row)."""
        return not self.is_peer and self.family != "specviz-plain"

    def param(self, key: str, default=None):
        return dict(self.params).get(key, default)

    def verifier(self, temperature: float, override: str | None = None) -> str:
        """The verification rule a specviz strategy runs with ("" for the others)."""
        if not self.is_strategy:
            return ""
        if temperature == 0.0:
            return "greedy"
        if override:
            return override
        return "chain" if self.family in _CHAIN_FAMILIES else "topk"


def parse_method(name: str) -> MethodSpec:
    """Parse a method name of :data:`METHOD_GRAMMAR`.

    Raises:
        ValueError: an unknown name (the message lists the grammar) or a parameter < 1.
    """
    if not isinstance(name, str):
        raise TypeError(f"a method name must be a str, got {type(name).__name__}")
    for rule in METHOD_GRAMMAR:
        match = re.fullmatch(rule.pattern, name)
        if match is None:
            continue
        params = []
        for key, raw in zip(rule.params, match.groups()):
            if raw is None:
                continue
            if key == "schedule":
                params.append((key, raw))
                continue
            numbers = tuple(int(b) for b in raw.split("x"))
            if min(numbers) < 1:
                raise ValueError(f"method {name!r}: {key} must be >= 1, got {raw}")
            params.append((key, numbers if key == "branching" else numbers[0]))
        return MethodSpec(name, rule.family, tuple(params))
    valid = "; ".join(rule.usage for rule in METHOD_GRAMMAR)
    raise ValueError(f"unknown method {name!r}; valid methods: {valid}")


def build_drafter(spec: MethodSpec, pair):
    """The specviz :class:`~specviz.drafters.Drafter` of a strategy, for a
    :class:`~specviz.models.ModelPair`.

    Raises:
        ValueError: ``spec`` is not a specviz strategy, or its parameters are invalid
            for the models (e.g. more self-speculative layers than the target has).
    """
    from specviz.draft.base import make_drafter
    from specviz.tree.shapes import chain, expansion

    if not spec.is_strategy:
        raise ValueError(f"method {spec.name!r} is not a specviz strategy")
    p = dict(spec.params)
    family, draft = spec.family, pair.draft
    if family == "chain":
        return make_drafter("chain", draft=draft, k=p["k"])
    if family == "tree":
        return make_drafter("tree", draft=draft, shape=expansion(list(p["branching"])))
    if family in ("dynamic", "adaptive"):
        return make_drafter(family, draft=draft, **p)
    if family == "ngram":
        return make_drafter("ngram", **p)
    if family == "ngram-trie":
        return make_drafter("ngram_trie", **p)
    if family == "merged":
        return make_drafter("merged", drafters=[make_drafter("chain", draft=draft, k=4), make_drafter("ngram")])
    n_layers = p.get("n_layers", pair.target.model.config.num_hidden_layers // 2)
    return make_drafter("self", target=pair.target, n_layers=n_layers, shape=chain(p.get("k", 4)))


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


class _TargetCalls:
    """Counts the target model's forwards and the tokens fed to each, with a hook."""

    def __init__(self, model) -> None:
        self.model = model
        self.fed: list[int] = []

    def _hook(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.fed.append(0 if ids is None else int(ids.shape[-1]))

    def __enter__(self) -> "_TargetCalls":
        self._handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def _cut_at_eos(tokens: list[int], eos: Sequence[int]) -> tuple[int, ...]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tuple(tokens[:i + 1])
    return tuple(tokens)


def _run_peer(spec: MethodSpec, pair, ids: list[int], max_new_tokens: int, temperature: float, seed: int,
              eos: tuple[int, ...]) -> Generation:
    model = pair.target.model
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
        kwargs["prompt_lookup_num_tokens"] = spec.param("k", 10)
        drafter = f"prompt lookup k={kwargs['prompt_lookup_num_tokens']}"
    prompt = torch.tensor([ids])  # (1, P)
    with _TargetCalls(model) as calls:
        # transformers samples from torch's global generator and takes no generator argument
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)  # (1, P + new)
        wall = time.perf_counter() - start
    new = _cut_at_eos(out[0, len(ids):].tolist(), eos)
    steps = len(calls.fed)
    # The first call feeds the prompt plus its draft, each later one the committed token
    # its cache lacks plus its draft (transformers crops the cache to the committed length - 1).
    drafted = sum(calls.fed) - len(ids) - (steps - 1)
    stop = "eos" if new and new[-1] in eos else "max_new_tokens"
    return Generation(new, wall, steps, steps, drafted, len(new) - steps, stop, math.nan, math.nan, drafter, "")


def run_method(spec: MethodSpec, pair, ids: list[int], *, max_new_tokens: int, temperature: float = 0.0,
               seed: int = 0, drafter=None, verifier: str = "") -> Generation:
    """Time one generation of ``spec`` on the prompt ids ``ids``.

    Args:
        spec: the method.
        pair: the :class:`~specviz.models.ModelPair`.
        ids: prompt token ids (already chat-templated).
        max_new_tokens: token budget.
        temperature: 0 for greedy decoding.
        seed: seeds the sampling (specviz's generator, torch's global one for transformers).
        drafter: the strategy's drafter (from :func:`build_drafter`; built once, reused).
        verifier: the strategy's verification rule (:meth:`MethodSpec.verifier`).
    """
    from specviz.decode.engine import eos_token_ids, plain_generate, speculative_generate
    from specviz.metrics.acceptance import summarize_steps
    from specviz.sampling import SamplingConfig

    eos = eos_token_ids(pair.target)
    if spec.is_peer:
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
                      drafter.name, verifier)


# -- results --------------------------------------------------------------------------------------

def load_results(path: str | os.PathLike) -> pd.DataFrame:
    """Read a benchmark CSV (``output_ids`` stay space-separated strings).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file lacks columns of :data:`COLUMNS`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"benchmark results not found: {path}")
    df = pd.read_csv(path, dtype={"output_ids": str, "method": str, "category": str})
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"{path} is not a specviz benchmark CSV (missing columns {missing})")
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
            (accepted / drafted), ``vs_hf_assisted``, ``matches_plain`` (fraction).
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


def summarize(rows: pd.DataFrame, methods: Sequence[str] | None = None) -> BenchSummary:
    """Aggregate benchmark rows (:func:`load_results`) per method and per category.

    Args:
        rows: the CSV's rows.
        methods: methods to report, in this order (default: as they first appear).
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
    present = [m for m in order if m in speed]
    per_category = (rows[rows["method"].isin(present)]
                    .pivot_table(index="method", columns="category", values="speedup", aggfunc="mean", sort=False)
                    .reindex(present))
    per_category.columns.name = None
    strategies = [m for m in present if parse_method(m).is_strategy]
    best = max(strategies, key=lambda m: speed[m]) if strategies else None
    return BenchSummary(per_method, per_category, best, speed[best] if best else math.nan, assisted)


def _format(df: pd.DataFrame, index: bool = False) -> str:
    fmt = {c: "{:.3f}".format for c in df.columns if c in ("acceptance_rate", "matches_plain")}
    fmt |= {c: "{:.2f}".format for c in df.columns if c not in fmt and pd.api.types.is_float_dtype(df[c])}
    return df.to_string(index=index, formatters=fmt, na_rep="-")


# -- the end-to-end command -----------------------------------------------------------------------

class _UsageError(Exception):
    """A bad command line or input file: reported in one line, exit status 2."""


def _e2e_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m specviz.bench",
        description="End-to-end decoding speed: transformers' plain, assisted and prompt-lookup "
                    "decoding against specviz's strategies, on the same prompts. "
                    "'python -m specviz.bench attention --help' times tree attention instead.")
    p.add_argument("--prompts", type=Path, default=None,
                   help="Spec-Bench-format JSON Lines question file (default: the shipped data/prompts.jsonl)")
    p.add_argument("--limit", type=int, default=None,
                   help="first N prompts, taken round-robin over categories (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="token budget per generation (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), metavar="METHOD",
                   help=f"methods to run (default: {' '.join(DEFAULT_METHODS)}); 'plain' is always added")
    p.add_argument("--list-methods", action="store_true", help="print the method grammar and exit")
    p.add_argument("--verifier", default=None,
                   help="verification rule of specviz strategies at a temperature (default: chain for "
                        "chains, topk otherwise)")
    p.add_argument("--repeats", type=int, default=1, help="runs of every (method, prompt) (default 1)")
    p.add_argument("--seed", type=int, default=0, help="base sampling seed (default 0)")
    p.add_argument("--out", default=None,
                   help="CSV file; a relative name lands under outputs/ (default bench-greedy.csv or "
                        "bench-t<T>.csv)")
    p.add_argument("--fresh", action="store_true", help="discard rows already in --out instead of resuming")
    p.add_argument("--models", choices=("builtin", "tiny"), default="builtin",
                   help="builtin: --target and --draft (default); tiny: specviz's tiny random pair (tests)")
    p.add_argument("--target", default=None, help="target model (default: the built-in 1.5B)")
    p.add_argument("--draft", default=None, help="draft model (default: the built-in 0.5B)")
    p.add_argument("--dtype", default="bf16", help="bf16 (default) or fp32")
    p.add_argument("--warmup-tokens", type=int, default=16, help="tokens of each method's warm-up run (default 16)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's own choice, left unchanged; recorded either way)")
    return p


def _grammar_text() -> str:
    width = max(len(r.usage) for r in METHOD_GRAMMAR)
    return "\n".join(f"  {r.usage:<{width}}  {r.help}" for r in METHOD_GRAMMAR)


def _check_args(args: argparse.Namespace) -> list[MethodSpec]:
    if args.limit is not None and args.limit < 1:
        raise _UsageError(f"--limit must be >= 1, got {args.limit}")
    if args.max_new_tokens < 1:
        raise _UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not (args.temperature >= 0.0 and math.isfinite(args.temperature)):
        raise _UsageError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.repeats < 1:
        raise _UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.warmup_tokens < 0:
        raise _UsageError(f"--warmup-tokens must be >= 0, got {args.warmup_tokens}")
    if args.threads is not None and args.threads < 1:
        raise _UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.verifier is not None:
        from specviz.verify.rules import VERIFIERS

        if args.verifier not in VERIFIERS:
            raise _UsageError(f"unknown --verifier {args.verifier!r}; valid: {', '.join(VERIFIERS)}")
    names = list(dict.fromkeys(["plain", *args.methods]))
    try:
        return [parse_method(n) for n in names]
    except ValueError as exc:
        raise _UsageError(f"{exc}\nmethod grammar:\n{_grammar_text()}") from None


def _load_models(args: argparse.Namespace):
    from specviz.models.loading import DEFAULT_DRAFT, DEFAULT_TARGET, load_pair, parse_dtype, tiny_pair

    dtype = parse_dtype(args.dtype)
    if args.models == "tiny":
        return tiny_pair(dtype=dtype)
    return load_pair(args.target or DEFAULT_TARGET, args.draft or DEFAULT_DRAFT, dtype=dtype)


def _existing_rows(out: Path, fresh: bool) -> pd.DataFrame:
    if fresh or not out.exists() or out.stat().st_size == 0:
        return pd.DataFrame(columns=list(COLUMNS))
    try:
        df = load_results(out)
    except (ValueError, pd.errors.ParserError) as exc:
        raise _UsageError(f"cannot resume from {out}: {exc}; pass --fresh or another --out") from None
    if list(df.columns) != list(COLUMNS):
        raise _UsageError(f"{out} has columns of another version of the benchmark; pass --fresh or another --out")
    return df


def _check_resumable(existing: pd.DataFrame, expected: dict, out: Path, verifiers: dict[str, str]) -> None:
    """Refuse to mix rows measured under other settings into one CSV: ``expected`` maps the
    run-wide columns (temperature, budget, seed, dtype, models, threads) to this run's
    values, ``verifiers`` each method to its verification rule."""
    for col, want in expected.items():
        have = set(existing[col].dropna().unique())
        if have and have != {want}:
            raise _UsageError(f"{out} holds rows with {col}={sorted(map(str, have))}, this run has {col}={want}; "
                              "pass --fresh or another --out")
    for method, want in verifiers.items():
        have = set(existing.loc[existing["method"] == method, "verifier"].fillna("").astype(str))
        if have and have != {want}:
            raise _UsageError(f"{out} holds {method} rows verified with {sorted(have)}, this run uses "
                              f"{want!r}; pass --fresh or another --out")


def _prefix_match(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _ids_text(ids: Sequence[int]) -> str:
    return " ".join(map(str, ids))


def _row(spec: MethodSpec, gen: Generation, prompt, repeat: int, position: int, n_prompt: int, plain_tps: float,
         plain_ids: tuple[int, ...] | None, run: dict, load1: float) -> dict:
    n = len(gen.output_ids)
    tps = n / gen.wall_s
    greedy = run["temperature"] == 0.0
    return {
        "method": spec.name, "question_id": prompt.question_id, "category": prompt.category, "repeat": repeat,
        "position": position, "prompt_tokens": n_prompt, "new_tokens": n, "wall_s": gen.wall_s,
        "tokens_per_s": tps, "speedup": tps / plain_tps, "target_calls": gen.target_calls, "steps": gen.steps,
        "tau": n / gen.steps if gen.steps else math.nan, "drafted": gen.drafted, "accepted": gen.accepted,
        "acceptance_rate": gen.accepted / gen.drafted if gen.drafted else math.nan,
        "matches_plain": (gen.output_ids == plain_ids) if greedy and plain_ids is not None else None,
        "prefix_match": _prefix_match(gen.output_ids, plain_ids) if greedy and plain_ids is not None else None,
        "stop": gen.stop, "draft_s": gen.draft_s, "verify_s": gen.verify_s, "drafter": gen.drafter,
        "verifier": gen.verifier, **run,
        "load1": load1, "output_ids": _ids_text(gen.output_ids),
    }


def _print_summary(rows: pd.DataFrame, methods: list[str]) -> BenchSummary:
    summary = summarize(rows, methods)
    print("\nper method (speedup = mean over prompts of plain's time per token / the method's; "
          "tau = tokens per target call):")
    print(_format(summary.per_method))
    print("\nmean speedup per category:")
    print(_format(summary.per_category.reset_index()))
    print()
    print(summary.line)
    return summary


def _e2e(argv: list[str]) -> int:
    parser = _e2e_parser()
    args = parser.parse_args(argv)
    if args.list_methods:
        print("methods:\n" + _grammar_text())
        return 0
    specs = _check_args(args)
    from specviz.study.prompts import load_prompts

    try:
        prompts = load_prompts(args.prompts, limit=args.limit)
    except (OSError, ValueError) as exc:
        raise _UsageError(str(exc)) from None
    default_out = "bench-greedy.csv" if args.temperature == 0.0 else f"bench-t{args.temperature:g}.csv"
    out = output_path(args.out or default_out)
    existing = _existing_rows(out, args.fresh)
    if args.fresh and out.exists():
        out.unlink()

    from specviz.models.loading import DEFAULT_DRAFT, DEFAULT_TARGET, parse_dtype

    if args.models == "tiny":
        names = ("tiny-qwen2-seed0", "tiny-qwen2-seed0-draft")
    else:
        names = (args.target or DEFAULT_TARGET, args.draft or DEFAULT_DRAFT)
    dtype = str(parse_dtype(args.dtype)).removeprefix("torch.")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    run = {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
           "dtype": dtype, "target": names[0], "draft": names[1], "threads": torch.get_num_threads()}
    verifiers = {s.name: s.verifier(args.temperature, args.verifier) for s in specs}
    _check_resumable(existing, run, out, verifiers)

    done = set(zip(existing["method"], existing["question_id"].astype(int), existing["repeat"].astype(int)))
    rounds = []  # (repeat, prompt index, methods still to run)
    for repeat in range(args.repeats):
        for i, prompt in enumerate(prompts):
            todo = [s for s in specs if (s.name, prompt.question_id, repeat) not in done]
            if todo:
                rounds.append((repeat, i, todo))
    method_names = [s.name for s in specs]
    threads = f"{torch.get_num_threads()} (--threads)" if args.threads else f"{torch.get_num_threads()} (default)"
    print(f"specviz.bench: {len(prompts)} prompts x {len(specs)} methods x {args.repeats} repeats, "
          f"max_new_tokens={args.max_new_tokens}, temperature={args.temperature:g}, {dtype}, "
          f"torch threads {threads}, load average {os.getloadavg()[0]:.2f}")
    print(f"rows: {out} ({len(existing)} already there, {sum(len(t) for *_, t in rounds)} to run)")
    if rounds:
        _measure(args, specs, prompts, rounds, existing, out, run)
    rows = load_results(out) if out.exists() else existing
    keep = rows["method"].isin(method_names) & rows["question_id"].isin([p.question_id for p in prompts]) \
        & (rows["repeat"] < args.repeats)
    _print_summary(rows[keep], method_names)
    return 0


def _measure(args, specs: list[MethodSpec], prompts, rounds, existing: pd.DataFrame, out: Path, run: dict) -> None:
    """Load the models, warm every method up, then run the rounds, appending each to ``out``."""
    import transformers

    from specviz.decode.engine import encode_prompt

    sklearn = importlib.util.find_spec("sklearn") is not None
    print("transformers " + transformers.__version__ + ("" if sklearn else
          "; scikit-learn not installed: hf-assisted keeps its confidence threshold at 0.4"))
    verbosity = transformers.logging.get_verbosity()
    # generate() warns about its own internal calls of the assistant; they say nothing about the run
    transformers.logging.set_verbosity_error()
    try:
        t0 = time.perf_counter()
        pair = _load_models(args)
        print(f"models: {pair.target.name} (target), {pair.draft.name} (draft), loaded in "
              f"{time.perf_counter() - t0:.1f}s")
        try:
            drafters = {s.name: build_drafter(s, pair) for s in specs if s.is_strategy}
        except (ValueError, TypeError) as exc:
            raise _UsageError(str(exc)) from None
        ids = {p.question_id: encode_prompt(pair.target.tokenizer, p.text, chat=True) for p in prompts}
        pending = {s.name for *_, todo in rounds for s in todo}
        if args.warmup_tokens:
            first = ids[prompts[rounds[0][1]].question_id]
            for s in specs:
                if s.name in pending:
                    run_method(s, pair, first, max_new_tokens=args.warmup_tokens, temperature=args.temperature,
                               seed=args.seed, drafter=drafters.get(s.name),
                               verifier=s.verifier(args.temperature, args.verifier))
            print(f"warm-up: {len(pending)} methods x {args.warmup_tokens} tokens (not timed)")
        total = sum(len(t) for *_, t in rounds)
        count = 0
        for repeat, i, todo in rounds:
            prompt = prompts[i]
            qid = prompt.question_id
            seed = args.seed + 100_003 * repeat + qid
            k = (repeat * len(prompts) + i) % len(todo)
            order = todo[k:] + todo[:k]
            gens: dict[str, tuple[int, Generation, float]] = {}
            for position, spec in enumerate(order):
                gc.collect()
                load1 = os.getloadavg()[0]
                gen = run_method(spec, pair, ids[qid], max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature, seed=seed, drafter=drafters.get(spec.name),
                                 verifier=spec.verifier(args.temperature, args.verifier))
                gens[spec.name] = (position, gen, load1)
                count += 1
                print(f"[{count:>4}/{total}] q{qid} {prompt.category:<15} {spec.name:<18} "
                      f"{len(gen.output_ids) / gen.wall_s:7.2f} tok/s  tau {len(gen.output_ids) / gen.steps:5.2f}  "
                      f"{len(gen.output_ids):>4} tokens ({gen.stop})", flush=True)
            if "plain" in gens:
                plain = gens["plain"][1]
                plain_tps, plain_ids = len(plain.output_ids) / plain.wall_s, plain.output_ids
            else:
                ref = existing[(existing["method"] == "plain") & (existing["question_id"] == qid)
                               & (existing["repeat"] == repeat)].iloc[0]
                plain_tps = float(ref["tokens_per_s"])
                plain_ids = tuple(int(t) for t in str(ref["output_ids"]).split())
            rows = [_row(spec, gens[spec.name][1], prompt, repeat, gens[spec.name][0], len(ids[qid]), plain_tps,
                         plain_ids, run, gens[spec.name][2]) for spec in todo]
            pd.DataFrame(rows, columns=list(COLUMNS)).to_csv(out, mode="a", header=not out.exists(), index=False)
            best = max(rows, key=lambda r: r["speedup"])
            print(f"       q{qid}: plain {plain_tps:.2f} tok/s; fastest {best['method']} {best['speedup']:.2f}x")
    finally:
        transformers.logging.set_verbosity(verbosity)


# -- the tree attention microbenchmark ----------------------------------------------------------------

def _attention_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m specviz.bench attention",
        description="Time tree attention (one SDPA call with the tree mask) against per-path attention "
                    "(one causal call per root-to-leaf path) and causal attention over the same number of "
                    "tokens, on random tensors with a real model's head layout.")
    p.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64],
                   help="draft-node budgets of Sequoia-shaped trees (default: 8 16 32 64)")
    p.add_argument("--shapes", nargs="*", default=[], metavar="B1xB2x...",
                   help="extra trees by branching per depth, e.g. 2x2x1 4x2x2x1")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4], help="default: 1 4")
    p.add_argument("--prefix-lens", type=int, nargs="+", default=[128, 512, 2048], help="default: 128 512 2048")
    p.add_argument("--layout", choices=("1.5b", "0.5b"), default="1.5b",
                   help="head layout of the built-in target (1.5b, default) or draft (0.5b)")
    p.add_argument("--dtype", default="fp32", help="fp32 (default) or bf16")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per call (default 5)")
    p.add_argument("--out", default="attention-timing.csv",
                   help="CSV file; a relative name lands under outputs/ (default %(default)s)")
    return p


def _attention(argv: list[str]) -> int:
    import specviz.bench.attention as timing
    from specviz.tree.shapes import expansion

    args = _attention_parser().parse_args(argv)
    try:
        shapes = timing.default_timing_shapes(args.budgets)
        for text in args.shapes:
            if not re.fullmatch(r"\d+(?:x\d+)*", text):
                raise ValueError(f"--shapes entries look like 2x2x1 (branching per depth), got {text!r}")
            shapes[f"tree-{text}"] = expansion([int(b) for b in text.split("x")])
        dims = timing.QWEN25_1_5B if args.layout == "1.5b" else timing.QWEN25_0_5B

        def progress(row: dict) -> None:
            print(f"{row['shape']:<14} B={row['batch_size']:<3} P={row['prefix_len']:<5} tree {row['tree_ms']:8.3f} ms"
                  f"  per-path {row['per_path_ms']:8.3f} ms  causal {row['causal_ms']:8.3f} ms", flush=True)

        table = timing.time_tree_attention(shapes, batch_sizes=args.batch_sizes, prefix_lens=args.prefix_lens,
                                           dims=dims, dtype=args.dtype, repeats=args.repeats, on_row=progress)
    except (ValueError, TypeError) as exc:
        raise _UsageError(str(exc)) from None
    out = output_path(args.out)
    table.to_csv(out, index=False)
    cols = ["shape", "budget", "batch_size", "prefix_len", "tree_ms", "per_path_ms", "causal_ms",
            "tree_vs_causal", "per_path_vs_tree"]
    print(f"\n{_format(table[cols])}\n\nrows: {out}")
    print(f"tree attention: per-path attention takes {table['per_path_vs_tree'].mean():.2f}x its time and "
          f"causal attention over the same tokens {1 / table['tree_vs_causal'].mean():.2f}x "
          f"(means over {len(table)} settings, {table['dtype'].iloc[0]}, {torch.get_num_threads()} threads)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a bad command line or input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            if argv[:1] == ["attention"]:
                return _attention(argv[1:])
            return _e2e(argv)
        except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
            return exc.code if isinstance(exc.code, int) else 2
    except _UsageError as exc:
        print(f"specviz.bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted; finished rounds are in the CSV: run the same command again to resume",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
