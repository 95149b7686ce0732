"""The command line's options and their checks: the parsers of ``python -m specviz.bench``
and of its ``attention`` and ``profile`` subcommands, the checks of the options, and the
environment the ``--heads`` directories set for the head strategies."""

from __future__ import annotations

import argparse
import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

from specviz.bench.e2e import DEFAULT_METHODS, LLAMA_METHODS, METHOD_GRAMMAR, parse_method
from specviz.bench.llama import LLAMA_BINARIES, find_llama_cpp
from specviz.draft.registry import MethodSpec
from specviz.models.fused import DEFAULT_DRAFT_LAYERS, DRAFT_LAYERS

__all__ = ["UsageError", "e2e_parser", "grammar_text", "check_args", "check_counts", "heads_env", "environment", "attention_parser", "profile_parser"]


class UsageError(Exception):
    """A bad command line or input file: reported in one line, exit status 2."""


def e2e_parser() -> argparse.ArgumentParser:
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
    p.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                   help=f"methods to run (default: {' '.join(DEFAULT_METHODS)}, plus llama-plain and llama-spec "
                        "when llama.cpp is found); 'plain' is always added")
    p.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help="directory of llama.cpp's llama-bench and llama-speculative-simple (or its bin/ or "
                        "build/bin/; default: found on PATH, else the llama-* methods are not available)")
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
    p.add_argument("--no-predict", dest="predict", action="store_false",
                   help="skip timing the target's cost curve and prefills (about a minute on a CPU before the "
                        "rounds and a few seconds after each) and the cost model's predicted speedup of each strategy")
    p.add_argument("--models", choices=("builtin", "tiny"), default="builtin",
                   help="builtin: --target and --draft (default); tiny: specviz's tiny random pair (tests)")
    p.add_argument("--target", default=None, help="target model (default: the built-in 1.5B)")
    p.add_argument("--draft", default=None, help="draft model (default: the built-in 0.5B)")
    p.add_argument("--dtype", default="fp32",
                   help="weight mode of both models: fp32 (default, the exactness reference), bf16, fp16, "
                        "w8a8-token, w4a8-token, or auto (the fastest mode that passes the accuracy bar on this machine, probed once and cached)")
    p.add_argument("--draft-dtype", default=None,
                   help="weight mode of the draft model alone (default: --dtype), e.g. w4a8-token: a draft's "
                        "accuracy costs acceptance, never exactness; plain decoding and the peers keep --dtype")
    p.add_argument("--draft-layers", choices=DRAFT_LAYERS, default=DEFAULT_DRAFT_LAYERS,
                   help="how a w4a8-token draft on the CPU runs its decoder layers: fused-one-pass (default: one "
                        "compiled call per layer, activations in one pass) or modules; recorded in the "
                        "draft_layers column (other drafts: modules)")
    p.add_argument("--device", default="auto",
                   help="where the models run: auto (default: CUDA, then MPS, then the CPU, among those "
                        "that run --dtype), cpu, cuda[:N] or mps")
    p.add_argument("--warmup-tokens", type=int, default=16, help="tokens of each method's warm-up run (default 16)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's own choice, left unchanged; recorded either way)")
    p.add_argument("--heads", nargs="+", default=None, metavar="DIR",
                   help="trained-heads result directories the medusa / eagle methods draft with, one per kind "
                        "(default: $SPECVIZ_HEADS, else the cached result trained on the most data)")
    return p


def grammar_text() -> str:
    from specviz.draft.registry import NAME_LETTERS

    width = max(len(r.usage) for r in METHOD_GRAMMAR)
    methods = "\n".join(f"  {r.usage:<{width}}  {r.description}" for r in METHOD_GRAMMAR)
    key = max(len(k) for k, _ in NAME_LETTERS)
    letters = "\n".join(f"  {k:<{key}}  {meaning}" for k, meaning in NAME_LETTERS)
    return f"{methods}\n\neach letter of a name, in every family:\n{letters}"


def check_args(args: argparse.Namespace) -> list[MethodSpec]:
    check_counts(args)
    if not (args.temperature >= 0.0 and math.isfinite(args.temperature)):
        raise UsageError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.warmup_tokens < 0:
        raise UsageError(f"--warmup-tokens must be >= 0, got {args.warmup_tokens}")
    if args.verifier is not None:
        from specviz.verify.rules import VERIFIERS

        if args.verifier not in VERIFIERS:
            raise UsageError(f"unknown --verifier {args.verifier!r}; valid: {', '.join(VERIFIERS)}")
    try:
        args.llama_cpp_dir = find_llama_cpp(args.llama_cpp)
    except FileNotFoundError as exc:
        raise UsageError(f"--llama-cpp: {exc}") from None
    if args.methods is None:
        args.methods = list(DEFAULT_METHODS) + (["llama-plain", "llama-spec"] if args.llama_cpp_dir else [])
    names = list(dict.fromkeys(["plain", *args.methods]))
    try:
        specs = [parse_method(n) for n in names]
    except ValueError as exc:
        raise UsageError(f"{exc}\nmethod grammar:\n{grammar_text()}") from None
    llama = [s.name for s in specs if s.family in LLAMA_METHODS]
    if llama and args.llama_cpp_dir is None:
        raise UsageError(f"methods {llama} need llama.cpp's {' and '.join(LLAMA_BINARIES)}: none on PATH; "
                          "pass --llama-cpp DIR (specviz never downloads them; see python -m specviz.bench "
                          "--list-methods and the specviz.bench.llama docstring for the build commands)")
    if llama and args.models == "tiny":
        raise UsageError(f"methods {llama} run the built-in pair's GGUF files, not --models tiny")
    args.heads_env = heads_env(args.heads)
    return specs


def check_counts(args: argparse.Namespace) -> None:
    """The checks of ``--limit``, ``--max-new-tokens`` and ``--threads`` both commands share."""
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")


def heads_env(entries: Sequence[str] | None) -> tuple[str, str] | None:
    """The environment variable (name, value) that makes the head strategies draft with the
    ``--heads`` result directories, checked (trained heads there, one per kind); None without any."""
    if not entries:
        return None
    from specviz.models.saved_heads import HEADS_ENV, read_result_meta

    kinds = {}
    for entry in entries:
        try:
            kind = read_result_meta(entry)[1]["kind"]
        except FileNotFoundError as exc:
            raise UsageError(f"--heads: {entry} holds no trained heads ({exc})") from None
        if kind in kinds:
            raise UsageError(f"--heads: {kinds[kind]} and {entry} are both {kind} heads; give one per kind")
        kinds[kind] = entry
    return HEADS_ENV, os.pathsep.join(str(Path(e).expanduser().resolve()) for e in entries)


@contextmanager
def environment(setting: tuple[str, str] | None):
    """``os.environ[name] = value`` for the duration (nothing for None), the old value restored."""
    if setting is None:
        yield
        return
    name, value = setting
    before = os.environ.get(name)
    os.environ[name] = value  # read by the head strategies' builders (specviz.heads.find_heads)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def attention_parser() -> argparse.ArgumentParser:
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

def profile_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m specviz.bench profile",
        description="Where a decoding run's time goes: each method's greedy generation under torch's profiler, "
                    "split by phase of the engine (prefill, draft, tree, forward, verify, update, cache, other) "
                    "and by kind of work (integer products, float products, attention, other operators, "
                    "Python), in milliseconds per generated token.")
    p.add_argument("--methods", nargs="+", default=["specviz-plain", "chain-k2", "ngram-n3-k8"], metavar="METHOD",
                   help="methods in the benchmark's grammar (default: specviz-plain chain-k2 ngram-n3-k8); "
                        "transformers' own (plain, hf-*) show as one 'other' phase")
    p.add_argument("--prompts", type=Path, default=None,
                   help="Spec-Bench-format JSON Lines question file (default: the shipped data/prompts.jsonl)")
    p.add_argument("--limit", type=int, default=1,
                   help="first N prompts, taken round-robin over categories (default 1); totals are over all")
    p.add_argument("--max-new-tokens", type=int, default=64, help="token budget per generation (default 64)")
    p.add_argument("--models", choices=("builtin", "tiny"), default="builtin",
                   help="builtin: --target and --draft (default); tiny: specviz's tiny random pair (tests)")
    p.add_argument("--target", default=None, help="target model (default: the built-in 1.5B)")
    p.add_argument("--draft", default=None, help="draft model (default: the built-in 0.5B)")
    p.add_argument("--dtype", default="fp32", help="weight mode of both models, as for the benchmark (default fp32)")
    p.add_argument("--draft-dtype", default=None, help="weight mode of the draft alone (default: --dtype)")
    p.add_argument("--draft-layers", choices=DRAFT_LAYERS, default=DEFAULT_DRAFT_LAYERS,
                   help="how a w4a8-token draft runs its decoder layers (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda[:N] or mps")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    p.add_argument("--heads", nargs="+", default=None, metavar="DIR",
                   help="trained-heads result directories the medusa / eagle methods draft with, one per kind")
    p.add_argument("--out", default="profile.csv",
                   help="CSV file of the per-prompt rows; a relative name lands under outputs/ (default %(default)s)")
    return p
