"""Training data for draft heads without a download: prompts from the Python standard
library, continued by the target itself (self-distillation).

* :func:`stdlib_prompts` - "explain this function", "summarise this docstring" and
  "complete this function" prompts built from the source and docstrings of standard
  library modules (every Python installation has them), chosen deterministically by a
  seed;
* :func:`spec_bench_prompts` - prompts of a Spec-Bench-format file minus held-out
  categories (by default every category of the shipped evaluation set, so
  ``data/prompts.jsonl`` never leaks into training);
* :func:`build_corpus` - each prompt continued by the target, greedily and sampled
  (temperature 0.7 with a seed), as a :class:`Corpus` of token sequences with its size
  in tokens and a sha256 of its token ids. With a ``store`` path, finished
  continuations are kept on disk and a rerun resumes.

The standard library's text differs between Python versions, so the prompts (and the
corpus hash) are deterministic for one Python version.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import os
import random
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from specviz.models.loading import LoadedModel
from specviz.sampling import SamplingConfig
from specviz.validate import check_int

__all__ = [
    "Corpus",
    "STDLIB_MODULES",
    "stdlib_prompts",
    "spec_bench_prompts",
    "build_corpus",
]

#: pure-Python standard library modules whose functions the prompts quote
STDLIB_MODULES: tuple[str, ...] = (
    "argparse", "base64", "bisect", "calendar", "colorsys", "configparser", "csv", "dataclasses", "difflib",
    "email.utils", "fnmatch", "fractions", "functools", "glob", "gzip", "heapq", "html", "ipaddress",
    "json.decoder", "json.encoder", "locale", "mimetypes", "ntpath", "pathlib", "posixpath", "pprint", "queue",
    "quopri", "random", "reprlib", "shlex", "shutil", "statistics", "string", "tempfile", "textwrap", "tokenize",
    "urllib.parse", "uuid", "zipfile",
)

_TEMPLATES: dict[str, str] = {
    "explain": "Explain what this Python function does, step by step:\n\n```python\n{source}\n```",
    "summarise": "Summarise this docstring of `{name}` in two sentences:\n\n{doc}",
    "complete": "Complete this Python function:\n\n```python\n{head}\n```",
}


@dataclass(frozen=True)
class Corpus:
    """Token sequences to train draft heads on: each a prompt followed by the target's
    own continuation.

    Attributes:
        sequences: token ids of every sequence (prompt + continuation).
        prompt_lengths: how many leading tokens of each sequence are the prompt.
        tokens: the data set's size in tokens (all sequences together).
        sha256: hex sha256 of the token ids and prompt boundaries; training results
            are keyed by it.
    """

    sequences: tuple[tuple[int, ...], ...]
    prompt_lengths: tuple[int, ...]
    tokens: int
    sha256: str

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int] | None = None
                       ) -> "Corpus":
        """A corpus of ``sequences`` (prompt lengths default to 0: every token is a
        training target); size and hash computed.

        Raises:
            ValueError: no sequences, a sequence shorter than 2 tokens, mismatched
                lengths, or a prompt length outside its sequence.
        """
        seqs = tuple(tuple(int(t) for t in s) for s in sequences)
        if not seqs:
            raise ValueError("a corpus needs at least one sequence")
        lens = tuple(int(n) for n in (prompt_lengths if prompt_lengths is not None else [0] * len(seqs)))
        if len(lens) != len(seqs):
            raise ValueError(f"got {len(lens)} prompt lengths for {len(seqs)} sequences")
        for i, (s, n) in enumerate(zip(seqs, lens)):
            if len(s) < 2:
                raise ValueError(f"sequence {i} has {len(s)} tokens; training needs at least 2")
            if not 0 <= n <= len(s):
                raise ValueError(f"prompt length {n} of sequence {i} is outside its {len(s)} tokens")
        digest = hashlib.sha256()
        for s, n in zip(seqs, lens):
            digest.update(torch.tensor([len(s), n, *s], dtype=torch.int64).numpy().tobytes())
        return cls(seqs, lens, sum(len(s) for s in seqs), digest.hexdigest())

    def __len__(self) -> int:
        return len(self.sequences)

    def summary(self) -> dict:
        """``{"tokens", "sequences", "sha256"}`` for records and reports."""
        return {"tokens": self.tokens, "sequences": len(self.sequences), "sha256": self.sha256}


def _functions(module_name: str) -> list[tuple[str, object]]:
    """``(qualified name, function)`` of the module's own public top-level functions, sorted."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return []
    out = []
    for name, obj in inspect.getmembers(module, inspect.isfunction):
        if getattr(obj, "__module__", None) == module.__name__ and not name.startswith("_"):
            out.append((f"{module_name}.{name}", obj))
    return sorted(out, key=lambda x: x[0])


def _cut(text: str, limit: int) -> str:
    """``text`` cut at a line boundary to at most ``limit`` characters (at least one line)."""
    if len(text) <= limit:
        return text
    lines, size, kept = text.splitlines(), 0, []
    for line in lines:
        if kept and size + len(line) + 1 > limit:
            break
        kept.append(line[:limit])
        size += len(line) + 1
    return "\n".join(kept)


def _head(source: str) -> str:
    """The decorators, signature and docstring of a function's source: what a "complete
    this function" prompt shows."""
    lines = source.splitlines()
    try:
        fn = ast.parse(source).body[0]
    except (SyntaxError, IndexError):
        return "\n".join(lines[:3])
    first = fn.body[0]
    has_doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
        and isinstance(first.value.value, str)
    end = first.end_lineno if has_doc else first.lineno - 1
    return "\n".join(lines[:max(end, 1)])


def stdlib_prompts(n: int, *, seed: int = 0, modules: Sequence[str] = STDLIB_MODULES,
                   max_chars: int = 1500) -> list[str]:
    """``n`` prompts about functions of standard library ``modules``.

    Every function with source code yields up to three candidates ("explain" its source,
    "summarise" its docstring, "complete" its signature and docstring); ``n`` of them
    are drawn without replacement by ``random.Random(seed)`` from the sorted candidate
    list, so the choice depends only on ``seed``, ``modules`` and the Python version.

    Args:
        n: prompts wanted.
        seed: which prompts.
        modules: module names to quote (missing modules are skipped).
        max_chars: longest quoted source or docstring, cut at a line boundary.

    Raises:
        ValueError: ``n`` is larger than the number of candidates.
    """
    check_int("n", n)
    check_int("max_chars", max_chars, 20)
    candidates: list[str] = []
    for module_name in modules:
        for name, fn in _functions(module_name):
            try:
                source = textwrap.dedent(inspect.getsource(fn))
            except (OSError, TypeError):
                continue
            doc = inspect.getdoc(fn)
            candidates.append(_TEMPLATES["explain"].format(source=_cut(source, max_chars)))
            if doc and len(doc) > 40:
                candidates.append(_TEMPLATES["summarise"].format(name=name, doc=_cut(doc, max_chars)))
            candidates.append(_TEMPLATES["complete"].format(head=_cut(_head(source), max_chars)))
    if n > len(candidates):
        raise ValueError(f"asked for {n} prompts but the modules give only {len(candidates)}")
    return random.Random(seed).sample(candidates, n)


def spec_bench_prompts(path: str | os.PathLike, exclude_categories: Sequence[str] | None = None) -> list[str]:
    """The first turn of every prompt of a Spec-Bench-format file whose category is not
    held out.

    Args:
        path: a Spec-Bench-format ``.jsonl`` question file.
        exclude_categories: categories to hold out; None means the evaluation categories
            of the shipped set (:data:`specviz.study.prompts.CATEGORIES`).

    Raises:
        ValueError: every prompt of the file is held out, or the file is not valid.
        FileNotFoundError: the file does not exist.
    """
    from specviz.study.prompts import CATEGORIES, load_prompts

    held_out = set(CATEGORIES if exclude_categories is None else exclude_categories)
    prompts = [p for p in load_prompts(Path(path)) if p.category not in held_out]
    if not prompts:
        raise ValueError(f"every prompt of {path} is in a held-out category ({', '.join(sorted(held_out))}); "
                         "evaluation prompts are not used for training")
    return [p.turns[0] for p in prompts]


def build_corpus(target: LoadedModel, *, prompts: int = 256, max_new_tokens: int = 256, seed: int = 0,
                 temperatures: Sequence[float] = (0.0, 0.7), spec_bench: str | os.PathLike | None = None,
                 exclude_categories: Sequence[str] | None = None, max_prompt_chars: int = 1500,
                 extra_prompts: Sequence[str] = (), chat: bool = True, store: str | os.PathLike | None = None,
                 batch_size: int = 16, progress: bool = True) -> Corpus:
    """Self-distilled training data: prompts continued by ``target``.

    The prompts are ``prompts`` standard library prompts (:func:`stdlib_prompts` with
    ``seed``), then those of ``spec_bench`` (:func:`spec_bench_prompts`, held-out
    categories removed), then ``extra_prompts``. Each is continued once per temperature
    of ``temperatures``: 0 is greedy decoding (the continuation a greedy run commits),
    anything else samples with seed ``seed + i`` for prompt ``i``. Prompts too long for
    the target's context with ``max_new_tokens`` to spare are left out. Greedy
    continuations are decoded ``batch_size`` prompts at a time
    (:func:`~specviz.decode.engine.plain_generate_batch`: one forward per token for the
    whole batch, several times the tokens per second of one-by-one decoding on a CPU);
    sampled ones one by one.

    Args:
        target: the model that writes the continuations (the heads' target).
        prompts: standard library prompts (0 for none).
        max_new_tokens: continuation budget per prompt (stops earlier at end of sequence).
        seed: prompt choice and sampling seed.
        temperatures: one continuation per temperature.
        spec_bench: an optional Spec-Bench-format prompt file.
        exclude_categories: its held-out categories (default: the evaluation categories).
        max_prompt_chars: longest quoted source or docstring in a standard library prompt.
        extra_prompts: more prompts, as text.
        chat: wrap prompts in the target's chat template (as decoding does).
        store: a ``.jsonl`` file keeping finished continuations (a rerun with the same
            arguments resumes from it); None keeps nothing.
        batch_size: greedy continuations decoded together (1: one by one, as
            :func:`~specviz.decode.engine.plain_generate` decodes them).
        progress: show a progress bar on stderr.

    Raises:
        ValueError: no prompt at all, or no prompt fits the target's context.
    """
    from tqdm import tqdm

    from specviz.decode.engine import encode_prompt, plain_generate, plain_generate_batch
    from specviz.study.store import ResultStore

    check_int("prompts", prompts, 0)
    check_int("max_new_tokens", max_new_tokens)
    check_int("batch_size", batch_size)
    temps = [float(t) for t in temperatures]
    if not temps or min(temps) < 0:
        raise ValueError(f"temperatures must be a non-empty list of values >= 0, got {list(temperatures)}")
    texts = (stdlib_prompts(prompts, seed=seed, max_chars=max_prompt_chars) if prompts else [])
    if spec_bench is not None:
        texts += spec_bench_prompts(spec_bench, exclude_categories)
    texts += list(extra_prompts)
    if not texts:
        raise ValueError("no prompts: ask for stdlib prompts, a Spec-Bench file or extra prompts")
    encoded = [encode_prompt(target.tokenizer, t, chat) for t in texts]
    fits = [ids for ids in encoded if len(ids) + max_new_tokens < target.max_context]
    if not fits:
        raise ValueError(f"no prompt fits {target.name}'s context of {target.max_context} tokens with "
                         f"{max_new_tokens} new tokens; lower max_prompt_chars or max_new_tokens")
    results = ResultStore(store)
    units = [(i, ids, t) for i, ids in enumerate(fits) for t in temps]
    keys = [hashlib.sha256(repr((ids, t, seed + i, max_new_tokens)).encode()).hexdigest()[:24] for i, ids, t in units]
    with tqdm(total=len(units), desc=f"continuations by {target.name}", unit="seq", file=sys.stderr,
              disable=not progress, mininterval=1.0) as bar:
        bar.update(sum(key in results for key in keys))
        greedy = [u for u, key in enumerate(keys) if key not in results and units[u][2] == 0.0]
        for start in range(0, len(greedy), batch_size):  # each batch is stored as soon as it is decoded
            chunk = greedy[start:start + batch_size]
            outs = plain_generate_batch(target, [units[u][1] for u in chunk], max_new_tokens=max_new_tokens,
                                        batch_size=len(chunk), chat=chat)
            for u, out in zip(chunk, outs):
                results.add(keys[u], {"output_ids": list(out.output_ids)})
            bar.update(len(chunk))
        for u, key in enumerate(keys):
            i, ids, temp = units[u]
            if key not in results:
                out = plain_generate(target, ids, max_new_tokens=max_new_tokens,
                                     config=SamplingConfig(temperature=temp), seed=seed + i)
                results.add(key, {"output_ids": list(out.output_ids)})
                bar.update(1)
    sequences = [list(units[u][1]) + list(results.rows_of(key)[0]["output_ids"]) for u, key in enumerate(keys)]
    lengths = [len(units[u][1]) for u in range(len(units))]
    return Corpus.from_sequences(sequences, lengths)
