"""Training data for draft heads without a download: prompts from the Python standard
library and from task templates, continued by the target itself (self-distillation).

* :func:`stdlib_prompts` - "explain this function", "summarise this docstring" and
  "complete this function" prompts built from the source and docstrings of standard
  library modules (every Python installation has them), chosen deterministically by a
  seed;
* :func:`task_prompts` - prompts of the study's task kinds (writing, questions, word
  problems, translation, summarisation, questions on a context, code) from the templates
  of :mod:`~specviz.heads.tasks` (random slots and prose of the Python reference), never
  from the evaluation file;
* :func:`self_prompts` - prompts the target writes itself: its chat template up to a
  user turn, the turn's first words of a task kind, and the rest sampled from the
  target (as Magpie draws instructions out of an aligned model), so their wording is
  as varied as the model's, not the templates';
* :func:`spec_bench_prompts` - prompts of a Spec-Bench-format file minus held-out
  categories (by default every category of the shipped evaluation set, so
  ``data/prompts.jsonl`` never leaks into training);
* :func:`build_corpus` - each prompt continued by the target, greedily and sampled
  (temperature 0.7 with a seed), as a :class:`Corpus` of token sequences with its size
  in tokens and a sha256 of its token ids. With a ``store`` path, finished
  continuations are kept on disk and a rerun resumes. The target's features (its last
  hidden states) are kept as the decoding computes them
  (:func:`~specviz.decode.engine.plain_generate_batch` with ``features=True``), so the
  training needs no second pass over the sequences (:attr:`Corpus.features`).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from specviz.heads.tasks import TASK_KINDS, _check_kinds, _prose_passages, _task_prompt
from specviz.models.types import LoadedModel
from specviz.sampling import SamplingConfig
from specviz.validate import check_int

if TYPE_CHECKING:
    from specviz.data.store import ResultStore

__all__ = [
    "Corpus",
    "STDLIB_MODULES",
    "stdlib_prompts",
    "TASK_KINDS",
    "task_prompts",
    "SELF_OPENERS",
    "self_prompts",
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
        features: where the target's features of sequence ``i`` were kept when it was
            decoded: ``features(i)`` is ``(target name, weight mode, (T, H) tensor)`` or
            None (:func:`build_corpus` sets it; None: no sequence has any). Not part of
            the hash: :func:`~specviz.heads.extract_features` uses them for the target
            and weight mode they came from and computes the others.
    """

    sequences: tuple[tuple[int, ...], ...]
    prompt_lengths: tuple[int, ...]
    tokens: int
    sha256: str
    features: Callable[[int], tuple[str, str, torch.Tensor] | None] | None = field(default=None, compare=False,
                                                                                   repr=False)

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int] | None = None,
                       features: Callable[[int], tuple[str, str, torch.Tensor] | None] | None = None) -> "Corpus":
        """A corpus of ``sequences`` (prompt lengths default to 0: every token is a
        training target); size and hash computed; ``features`` as the attribute.

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
        return cls(seqs, lens, sum(len(s) for s in seqs), digest.hexdigest(), features)

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
            of the shipped set (:data:`specviz.data.prompts.CATEGORIES`).

    Raises:
        ValueError: every prompt of the file is held out, or the file is not valid.
        FileNotFoundError: the file does not exist.
    """
    from specviz.data.prompts import CATEGORIES, load_prompts

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
                 batch_size: int = 16, progress: bool = True, tasks: int = 0, written: int = 0) -> Corpus:
    """Self-distilled training data: prompts continued by ``target``.

    The prompts are ``prompts`` standard library prompts (:func:`stdlib_prompts` with
    ``seed``), then ``tasks`` prompts of the study's task kinds (:func:`task_prompts`
    with ``seed``), then ``written`` prompts the target writes itself
    (:func:`self_prompts` with ``seed``), then those of ``spec_bench``
    (:func:`spec_bench_prompts`, held-out categories removed), then ``extra_prompts``.
    Each is continued once per temperature of ``temperatures``: 0 is greedy decoding
    (the continuation a greedy run commits), anything else samples with seed ``seed + i``
    for prompt ``i``. Prompts too long for the target's context with ``max_new_tokens``
    to spare are left out. Continuations are decoded ``batch_size`` prompts at a time
    (:func:`~specviz.decode.engine.plain_generate_batch`: one forward per token for the
    whole batch, several times the tokens per second of one-by-one decoding on a CPU).

    Args:
        target: the model that writes the continuations (the heads' target).
        prompts: standard library prompts (0 for none).
        tasks: prompts of the study's task kinds (0 for none): writing, questions, word
            problems, translation, summarisation, questions on a context and code, the
            kinds the heads are evaluated on.
        written: prompts of those kinds written by the target itself (0 for none; needs
            a chat template), kept in ``store`` like the continuations.
        max_new_tokens: continuation budget per prompt (stops earlier at end of sequence).
        seed: prompt choice and sampling seed.
        temperatures: one continuation per temperature.
        spec_bench: an optional Spec-Bench-format prompt file.
        exclude_categories: its held-out categories (default: the evaluation categories).
        max_prompt_chars: longest quoted source or docstring in a standard library prompt.
        extra_prompts: more prompts, as text.
        chat: wrap prompts in the target's chat template (as decoding does).
        store: a ``.jsonl`` file keeping finished continuations (a rerun with the same
            arguments resumes from it); None keeps nothing. The features of each
            continuation go to the directory beside it (``<store>.features``), one
            float16 file per sequence, written before the continuation is recorded;
            without a store they stay in memory.
        batch_size: continuations decoded together (1: one by one, as
            :func:`~specviz.decode.engine.plain_generate` decodes them).
        progress: show a progress bar on stderr.

    Raises:
        ValueError: no prompt at all, or no prompt fits the target's context.
    """
    from specviz.data.store import ResultStore

    check_int("prompts", prompts, 0)
    check_int("tasks", tasks, 0)
    check_int("written", written, 0)
    check_int("max_new_tokens", max_new_tokens)
    check_int("batch_size", batch_size)
    temps = list(dict.fromkeys(float(t) for t in temperatures))  # each temperature once
    if not temps or min(temps) < 0:
        raise ValueError(f"temperatures must be a non-empty list of values >= 0, got {list(temperatures)}")
    texts = (stdlib_prompts(prompts, seed=seed, max_chars=max_prompt_chars) if prompts else [])
    texts += task_prompts(tasks, seed=seed) if tasks else []
    results = ResultStore(store)
    if written:
        texts += self_prompts(target, written, seed=seed, store=results, batch_size=batch_size, progress=progress)
    if spec_bench is not None:
        texts += spec_bench_prompts(spec_bench, exclude_categories)
    texts += list(extra_prompts)
    fits = _fitting_prompts(target, texts, chat, max_new_tokens)
    units = [(i, ids, t) for i, ids in enumerate(fits) for t in temps]
    keys = [hashlib.sha256(repr((ids, t, seed + i, max_new_tokens)).encode()).hexdigest()[:24] for i, ids, t in units]
    kept = _FeatureFiles(None if store is None else Path(str(store) + ".features"))
    _continue_units(target, units, keys, results, kept, temps=temps, seed=seed, max_new_tokens=max_new_tokens,
                    chat=chat, batch_size=batch_size, progress=progress)
    sequences = [list(units[u][1]) + list(results.rows_of(key)[0]["output_ids"]) for u, key in enumerate(keys)]
    lengths = [len(units[u][1]) for u in range(len(units))]
    return Corpus.from_sequences(sequences, lengths, features=kept.lookup(keys))


def _fitting_prompts(target: LoadedModel, texts: Sequence[str], chat: bool, max_new_tokens: int) -> list[list[int]]:
    """The token ids of the prompts of :func:`build_corpus` that leave ``max_new_tokens``
    of the target's context to spare."""
    from specviz.decode.engine import encode_prompt

    if not texts:
        raise ValueError("no prompts: ask for stdlib prompts, task prompts, a Spec-Bench file or extra prompts")
    encoded = [encode_prompt(target.tokenizer, t, chat) for t in texts]
    fits = [ids for ids in encoded if len(ids) + max_new_tokens < target.max_context]
    if not fits:
        raise ValueError(f"no prompt fits {target.name}'s context of {target.max_context} tokens with "
                         f"{max_new_tokens} new tokens; lower max_prompt_chars or max_new_tokens")
    return fits


def _continue_units(target: LoadedModel, units: Sequence[tuple], keys: Sequence[str], results: ResultStore,
                    kept: _FeatureFiles, *, temps: Sequence[float], seed: int, max_new_tokens: int, chat: bool,
                    batch_size: int, progress: bool) -> None:
    """Decode the ``(prompt index, prompt ids, temperature)`` units of :func:`build_corpus`
    that ``results`` lacks, greedy first and then each temperature, ``batch_size`` at a
    time; each continuation is recorded under its key as soon as it is decoded, after its
    features."""
    from tqdm import tqdm

    from specviz.decode.engine import plain_generate_batch

    with tqdm(total=len(units), desc=f"continuations by {target.name}", unit="seq", file=sys.stderr,
              disable=not progress, mininterval=1.0) as bar:
        bar.update(sum(key in results for key in keys))
        for temp in temps:  # greedy and each temperature in batches, stored as soon as decoded
            todo = [u for u, key in enumerate(keys) if key not in results and units[u][2] == temp]
            for start in range(0, len(todo), batch_size):
                chunk = todo[start:start + batch_size]
                outs = plain_generate_batch(target, [units[u][1] for u in chunk], max_new_tokens=max_new_tokens,
                                            batch_size=len(chunk), chat=chat, config=SamplingConfig(temperature=temp),
                                            seed=[seed + units[u][0] for u in chunk], features=True)
                for u, (out, feats) in zip(chunk, outs):
                    kept.put(keys[u], target, feats)  # before the unit: a recorded unit has its features
                    results.add(keys[u], {"output_ids": list(out.output_ids)})
                bar.update(len(chunk))


class _FeatureFiles:
    """The features :func:`build_corpus` keeps per continuation: a file ``<key>.pt`` in
    ``directory`` (float16 where finite, else float32), or a dict in memory without one."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.memory: dict[str, tuple[str, str, torch.Tensor]] = {}

    def put(self, key: str, target: LoadedModel, feats: torch.Tensor) -> None:
        from specviz.models.features import _save, _storable

        entry = (target.name, target.weight_mode, _storable(feats, torch.float16))
        if self.directory is None:
            self.memory[key] = entry
            return
        _save(self.directory / f"{key}.pt", {"target": entry[0], "weight_mode": entry[1], "features": entry[2]})

    def get(self, key: str) -> tuple[str, str, torch.Tensor] | None:
        """The kept features of ``key``, or None (never kept, or an unreadable file);
        whether they fit a sequence is :func:`~specviz.heads.extract_features`' check."""
        if self.directory is None:
            return self.memory.get(key)
        path = self.directory / f"{key}.pt"
        if not path.exists():
            return None
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            return str(saved["target"]), str(saved["weight_mode"]), saved["features"]
        except Exception:  # a damaged file: the sequence's features are computed again
            return None

    def lookup(self, keys: Sequence[str]) -> Callable[[int], tuple[str, str, torch.Tensor] | None]:
        """``features(i)`` of :class:`Corpus` for the sequences of ``keys``."""
        return lambda i: self.get(keys[i])


# ---------------------------------------------------------------------------------------------------
# Prompts of the study's task kinds, generated from the templates of specviz.heads.tasks (never from the
# evaluation file)
# ---------------------------------------------------------------------------------------------------

def task_prompts(n: int, *, seed: int = 0, kinds: Sequence[str] = TASK_KINDS) -> list[str]:
    """``n`` prompts spread evenly over the task ``kinds`` of the study's prompt set
    (writing, questions, word problems, translation, summarisation, questions on a
    context, code), written from templates with random slots: names, topics,
    languages and numbers, and prose passages of the Python reference that ships with
    the standard library. Nothing comes from the evaluation file, so heads trained on
    the target's answers to them are evaluated on unseen prompts of the same kinds.

    The choice depends only on ``seed``, ``kinds`` and the Python version.

    Raises:
        ValueError: an unknown kind, or no kinds.
    """
    check_int("n", n, 0)
    kinds = _check_kinds("task_prompts", kinds)
    rng = random.Random(seed)
    passages = _prose_passages()
    return [_task_prompt(kinds[i % len(kinds)], rng, passages) for i in range(n)]


# ---------------------------------------------------------------------------------------------------
# Prompts the target writes itself
# ---------------------------------------------------------------------------------------------------

#: first words of the user turns :func:`self_prompts` has the target write, by task kind
SELF_OPENERS: dict[str, tuple[str, ...]] = {
    "code": ("Write a Python function", "Write a function", "How do I", "Fix this Python code", "Implement",
             "Write a script"),
    "math_reasoning": ("A shop", "A train", "Solve", "If a", "Calculate", "Tom has"),
    "qa": ("Why", "How does", "What is", "What are the", "Explain", "What is the difference between"),
    "rag": ("Context:", "Read the text below", "Based on the following passage", "Here is a paragraph"),
    "summarization": ("Summarize the following", "Summarise this", "Give a short summary of", "Summarize"),
    "translation": ("Translate the following", "Translate this", "Translate into", "How do you say"),
    "writing": ("Write an email", "Write a short letter", "Write a message", "Write a short story",
                "Write a blog post", "Draft"),
}


def _usable_prompt(text: str, *, min_words: int = 4, latin: float = 0.9) -> bool:
    """Whether a written prompt is worth answering: at least ``min_words`` words, no line
    that starts with "assistant" (the model answering its own request inside the user
    turn), and at least a share ``latin`` of its letters in Latin scripts (a small model
    drifts into other scripts mid-sentence; the evaluation prompts are English)."""
    if len(text.split()) < min_words:
        return False
    if any(line.strip().lower().startswith("assistant") for line in text.splitlines()):
        return False
    letters = [c for c in text if c.isalpha()]
    return not letters or sum(ord(c) < 0x250 for c in letters) >= latin * len(letters)


def _turn_prefix(target: LoadedModel) -> str:
    """The target's chat template up to the text of a user turn (system turn included)."""
    tok = target.tokenizer
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{target.name}'s tokenizer has no chat template, so it cannot write prompts itself; "
                         "use task or standard library prompts")
    marker = "\u2063specviz-user-turn\u2063"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                   add_generation_prompt=False)
    if text.count(marker) != 1:
        raise ValueError(f"{target.name}'s chat template does not put a user turn's text in one place")
    return text[:text.index(marker)]


def self_prompts(target: LoadedModel, n: int, *, seed: int = 0, kinds: Sequence[str] = TASK_KINDS,
                 temperature: float = 0.9, top_p: float = 0.95, max_tokens: int = 160, batch_size: int = 16,
                 min_words: int = 4, latin: float = 0.9, complete: bool = True, max_attempts: int | None = None,
                 store: str | os.PathLike | ResultStore | None = None, progress: bool = True) -> list[str]:
    """``n`` prompts written by ``target`` itself: no prompt file, no template beyond the
    first words.

    Attempt ``j`` feeds the target its chat template up to a user turn's text and the
    first words of a task kind (kind ``kinds[j % len(kinds)]``, words chosen from
    :data:`SELF_OPENERS` by ``seed`` and ``j``), and samples the rest of the turn
    (``temperature``, nucleus ``top_p``, seed ``seed + j``) until the model ends the turn.
    An instruction-tuned model writes what users ask it: this is how Magpie (Xu et al.,
    2024) draws instruction data out of an aligned model. Heads trained on the target's
    answers to such prompts see the model's own variety of requests, not a template's.

    A written turn is kept if it ended within ``max_tokens`` (``complete``), has at
    least ``min_words`` words, no line starting with "assistant", at least a share
    ``latin`` of its letters in Latin scripts and is not a repeat; attempts go on
    (``batch_size`` sampled together) until ``n`` are kept or ``max_attempts`` (default
    ``4 * n + 16``) were made. The result depends only on the target, the arguments and,
    for rounding near-ties, the batch size.

    Args:
        store: a ``.jsonl`` file keeping every attempt's text (a rerun resumes from it),
            or an open :class:`~specviz.data.store.ResultStore`; None keeps nothing.

    Raises:
        ValueError: bad arguments, a tokenizer without a chat template, or fewer than
            ``n`` usable prompts after ``max_attempts`` attempts (the message gives the
            counts and what to loosen).
    """
    from tqdm import tqdm

    from specviz.data.store import ResultStore

    attempts, kinds, config = _writing_settings(n, seed, kinds, temperature, top_p, max_tokens, batch_size,
                                                min_words, latin, max_attempts)
    if n == 0:
        return []
    prefix = _turn_prefix(target)
    results = store if isinstance(store, ResultStore) else ResultStore(store)
    turns = _WrittenTurns(target, prefix, kinds, seed, config, (temperature, top_p, max_tokens), results)
    kept: list[str] = []
    seen: set[str] = set()
    j = 0
    with tqdm(total=n, desc=f"prompts written by {target.name}", unit="prompt", file=sys.stderr,
              disable=not progress, mininterval=1.0) as bar:
        while len(kept) < n and j < attempts:
            batch = list(range(j, min(j + batch_size, attempts)))
            turns.write(batch)
            before = len(kept)
            for b in batch:
                row = results.rows_of(turns.key(b))[0]
                text = row["text"].strip()
                if (row["ended"] or not complete) and _usable_prompt(text, min_words=min_words, latin=latin) \
                        and text not in seen and len(kept) < n:
                    seen.add(text)
                    kept.append(text)
            bar.update(len(kept) - before)
            j = batch[-1] + 1
    if len(kept) < n:
        raise ValueError(f"{target.name} wrote {len(kept)} usable prompts of {n} in {j} attempts; allow more "
                         "attempts (max_attempts), longer turns (max_tokens) or loosen min_words / latin / complete")
    return kept


def _writing_settings(n: int, seed: int, kinds: Sequence[str], temperature: float, top_p: float, max_tokens: int,
                      batch_size: int, min_words: int, latin: float,
                      max_attempts: int | None) -> tuple[int, list[str], SamplingConfig]:
    """The attempts allowed, the kinds and the sampling configuration of a
    :func:`self_prompts` call, its arguments checked."""
    check_int("n", n, 0)
    check_int("seed", seed, 0)
    check_int("max_tokens", max_tokens)
    check_int("batch_size", batch_size)
    check_int("min_words", min_words, 0)
    attempts = 4 * n + 16 if max_attempts is None else check_int("max_attempts", max_attempts)
    if not 0.0 <= latin <= 1.0:
        raise ValueError(f"latin must be a share in [0, 1], got {latin!r}")
    kinds = _check_kinds("self_prompts", kinds)
    config = SamplingConfig(temperature=temperature, top_p=top_p)
    if config.greedy:
        raise ValueError("self_prompts samples; temperature must be > 0 (greedy writes the same prompt every time)")
    return attempts, kinds, config


class _WrittenTurns:
    """The attempts of a :func:`self_prompts` call: attempt ``j``'s first words, its key in
    the store (from the turn prefix, the words, its seed ``seed + j`` and the sampling
    settings) and the user turn the target writes after them."""

    def __init__(self, target: LoadedModel, prefix: str, kinds: Sequence[str], seed: int, config: SamplingConfig,
                 sampling: tuple[float, float, int], results: ResultStore) -> None:
        self.target, self.prefix, self.kinds, self.seed = target, prefix, kinds, seed
        self.config, self.results = config, results
        self.sampling = sampling  # (temperature, top_p, max_tokens) as given
        self.max_tokens = sampling[2]

    def opener(self, j: int) -> str:
        """The first words of attempt ``j``."""
        return random.Random(f"{self.seed}/{j}").choice(SELF_OPENERS[self.kinds[j % len(self.kinds)]])

    def key(self, j: int) -> str:
        """Attempt ``j``'s key in the store."""
        wanted = (self.prefix, self.opener(j), self.seed + j, *self.sampling)
        return "written-" + hashlib.sha256(repr(wanted).encode()).hexdigest()[:24]

    def write(self, batch: Sequence[int]) -> None:
        """Sample the turns of the attempts of ``batch`` the store lacks, together, and store them."""
        from specviz.decode.engine import plain_generate_batch

        todo = [b for b in batch if self.key(b) not in self.results]
        if not todo:
            return
        tok = self.target.tokenizer
        ids = [tok(self.prefix + self.opener(b), add_special_tokens=False)["input_ids"] for b in todo]
        outs = plain_generate_batch(self.target, ids, max_new_tokens=self.max_tokens, batch_size=len(todo),
                                    chat=False, config=self.config, seed=[self.seed + b for b in todo])
        for b, out in zip(todo, outs):
            text = self.opener(b) + tok.decode(list(out.output_ids), skip_special_tokens=True)
            self.results.add(self.key(b), {"text": text, "ended": out.stop_reason == "eos"})
