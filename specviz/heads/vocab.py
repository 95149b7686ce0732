"""Counting a draft vocabulary: the token ranking a reduced-vocabulary draft
(:mod:`specviz.draft.vocab`, strategy names ending in ``-v<N>``) scores from, counted from
text the draft writes itself.

Command line: ``python -m specviz.heads.vocab --draft NAME`` writes the ranking into the
specviz cache, where the ``-v<N>`` strategies look for it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Sequence

from specviz.draft.vocab import DraftVocabulary, tokenizer_hash, vocabulary_cache_path
from specviz.heads.corpus import build_corpus

__all__ = ["build_draft_vocabulary"]


def build_draft_vocabulary(draft, *, tasks: int = 256, prompts: int = 64, max_new_tokens: int = 128,
                           temperatures: Sequence[float] = (0.0, 0.7), seed: int = 0,
                           store: str | os.PathLike | None = None, batch_size: int = 16,
                           progress: bool = True) -> DraftVocabulary:
    """Count a ranking from text ``draft`` writes itself: prompts of the study's task kinds
    (:func:`~specviz.heads.corpus.task_prompts`, templates, never the evaluation prompts) and
    standard-library prompts (:func:`~specviz.heads.corpus.stdlib_prompts`), each continued
    once per temperature (:func:`~specviz.heads.corpus.build_corpus`, resumable through
    ``store``). Prompts and continuations are counted together: a draft proposes both
    what it would write and what it copies.
    """
    corpus = build_corpus(draft, prompts=prompts, tasks=tasks, max_new_tokens=max_new_tokens, seed=seed,
                          temperatures=temperatures, store=store, batch_size=batch_size, progress=progress)
    counts = Counter(t for seq in corpus.sequences for t in seq)
    ranked = tuple(sorted(counts, key=lambda t: (-counts[t], t)))  # the heads' reduced_vocab's order
    described = corpus.summary() | {
        "writer": draft.name, "weight_mode": draft.weight_mode, "tasks": tasks, "stdlib_prompts": prompts,
        "max_new_tokens": max_new_tokens, "temperatures": [float(t) for t in temperatures], "seed": seed,
        "distinct": len(ranked)}
    return DraftVocabulary(ranked, draft.vocab_size, tokenizer_hash(draft.tokenizer), described)



def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specviz.heads.vocab",
        description="Count the token ranking a draft model's reduced vocabulary (strategies ending in -v<N>) "
                    "scores from, from answers the draft writes to template prompts of the study's task kinds.")
    parser.add_argument("--draft", default=None, help="draft model (registry name, Hub id or path; default: the "
                                                     "built-in draft)")
    parser.add_argument("--dtype", default="fp32", help="weight mode the draft writes in (default fp32)")
    parser.add_argument("--tasks", type=int, default=256, help="task-kind prompts (default 256)")
    parser.add_argument("--prompts", type=int, default=64, help="standard-library prompts (default 64)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=None, help="file to write (default: the specviz cache, where "
                                                   "strategies ending in -v<N> look for it)")
    parser.add_argument("--store", default=None, help="where the draft's answers are kept as they are written, "
                                                     "so that an interrupted run resumes (default: next to the "
                                                     "ranking in the specviz cache)")
    args = parser.parse_args(argv)
    from specviz.models.builtin import DEFAULT_DRAFT
    from specviz.models.loading import load_model

    for name in ("tasks", "prompts", "max_new_tokens"):
        if getattr(args, name) < 0 or (name == "max_new_tokens" and args.max_new_tokens < 1):
            parser.error(f"--{name.replace('_', '-')} must be {'>= 1' if name == 'max_new_tokens' else '>= 0'}")
    draft = load_model(args.draft or DEFAULT_DRAFT, dtype=args.dtype)
    tok_hash = tokenizer_hash(draft.tokenizer)
    out = Path(args.out) if args.out else vocabulary_cache_path(tok_hash)
    store = Path(args.store) if args.store else vocabulary_cache_path(tok_hash).with_suffix(".corpus.jsonl")
    vocab = build_draft_vocabulary(draft, tasks=args.tasks, prompts=args.prompts,
                                   max_new_tokens=args.max_new_tokens, store=store)
    vocab.save(out)
    print(f"{out}: {len(vocab.ranked)} distinct tokens ranked from {vocab.corpus['tokens']} "
          f"(corpus sha256 {vocab.corpus['sha256'][:12]})", file=sys.stderr)
    return 0



if __name__ == "__main__":
    sys.exit(main())
