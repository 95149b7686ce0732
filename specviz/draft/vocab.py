"""A draft model that scores part of the vocabulary: its most frequent tokens plus the
tokens of the sequence at hand.

A draft model's LM head is one row per vocabulary entry, and a one-token forward reads all
of them: for the built-in 0.5B draft (151,936 rows x 896) a sixth of the forward's time in
``w8a8-token``. Most rows are tokens a draft never proposes for the text it drafts. As in
FR-Spec (Zhao et al., 2025) and EAGLE-3's draft vocabulary, the drafters here can score only
the ``N`` most frequent tokens of a corpus, plus (unlike those) every token of the current
sequence's prompt and output, so that copying a rare name or identifier from the prompt
stays possible. The other tokens get a logit of ``-inf``: the draft never proposes them and
gives them probability 0. The target still verifies over the whole vocabulary, so decoding
stays lossless (the sampling rules are exact for any draft distribution); what the smaller
head costs is the steps where the target's token lies outside the set.

* :class:`DraftVocabulary` - a ranking of token ids by frequency in a corpus, saved as JSON
  next to a hash of the tokenizer it was counted with; :func:`draft_vocabulary` finds the
  one for a model (shipped in ``data/`` for the built-in pair's tokenizer, else in the
  specviz cache), :func:`build_draft_vocabulary` counts one (``python -m specviz.draft.vocab``);
* :func:`head_rows` - the rows of a (possibly quantized) LM head as a head of its own, with
  the same kernel: every kept logit is bitwise the full head's for the integer modes (exact
  integer products), and equal up to the summation order of a float product;
* :class:`ReducedHead` - the head a :class:`~specviz.draft.base.DraftModelState` scores with:
  the ranked rows plus the sequence's own tokens, scattered into a full-width logit row.

Dimension legend: V = full vocabulary, W = scored rows, E = hidden size, M = positions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import nn

from specviz.locations import DATA_DIR
from specviz.validate import check_int

__all__ = [
    "DraftVocabulary",
    "tokenizer_hash",
    "draft_vocabulary",
    "build_draft_vocabulary",
    "head_rows",
    "ReducedHead",
    "reduced_head",
    "VOCABULARY_DIR",
]

#: where the rankings shipped with specviz live (one JSON file per tokenizer)
VOCABULARY_DIR = DATA_DIR
_FILE_PREFIX = "draft-vocab-"


_tokenizer_hashes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def tokenizer_hash(tokenizer) -> str:
    """A short hex hash of what a tokenizer maps text to: its vocabulary (token -> id) and
    special tokens. Two tokenizers with the same hash give the same ids for the same text.
    Computed once per tokenizer object (a third of a second for a 150k vocabulary)."""
    try:
        return _tokenizer_hashes[tokenizer]
    except (KeyError, TypeError):
        pass
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256()
    digest.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode())
    digest.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    value = digest.hexdigest()[:16]
    try:
        _tokenizer_hashes[tokenizer] = value
    except TypeError:  # not weakly referenceable: computed again next time
        pass
    return value


@dataclass(frozen=True)
class DraftVocabulary:
    """Token ids ranked by frequency in a corpus, for one tokenizer.

    Attributes:
        ranked: the distinct ids of the corpus, most frequent first (ties: smaller id first).
        vocab_size: the model vocabulary the ids index (the LM head's rows).
        tokenizer: :func:`tokenizer_hash` of the tokenizer the corpus was encoded with.
        corpus: a description of the corpus (its size in tokens, sequences, sha256, how
            it was written).
    """

    ranked: tuple[int, ...]
    vocab_size: int
    tokenizer: str
    corpus: dict

    def __post_init__(self) -> None:
        check_int("vocab_size", self.vocab_size)
        outside = [t for t in self.ranked if not 0 <= t < self.vocab_size]
        if outside:
            raise ValueError(f"ranked token ids {outside[:5]} lie outside the vocabulary of {self.vocab_size}")
        if len(set(self.ranked)) != len(self.ranked):
            raise ValueError("ranked token ids must be distinct")

    def ids(self, n: int) -> torch.Tensor:
        """The ``n`` ids a head of ``n`` rows scores, sorted: the ``n`` most frequent of the
        corpus, then, when it has fewer distinct tokens, the smallest ids not taken yet (a
        BPE tokenizer numbers its merges in the order it learned them, roughly by frequency
        in its own training text)."""
        check_int("n", n)
        if n > self.vocab_size:
            raise ValueError(f"a draft vocabulary of {n} tokens is larger than the model's {self.vocab_size}")
        chosen = torch.zeros(self.vocab_size, dtype=torch.bool)
        ranked = torch.tensor(self.ranked[:n], dtype=torch.long)
        chosen[ranked] = True
        missing = n - int(chosen.sum())
        if missing:
            chosen[(~chosen).nonzero()[:missing, 0]] = True
        return chosen.nonzero()[:, 0]

    def coverage(self, sequences: Iterable[Sequence[int]], n: int) -> float:
        """Share of the tokens of ``sequences`` inside the ``n``-token vocabulary (nan without
        tokens): one minus the heads' :func:`~specviz.heads.modules.out_of_vocab_share`."""
        from specviz.heads.modules import out_of_vocab_share

        return 1.0 - out_of_vocab_share(self.ids(n), sequences)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the ranking as JSON to ``path`` (atomically); the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"tokenizer": self.tokenizer, "vocab_size": self.vocab_size, "corpus": self.corpus,
                                   "ranked": list(self.ranked)}, separators=(",", ":")) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "DraftVocabulary":
        """Read a ranking saved by :meth:`save`.

        Raises:
            ValueError: the file is not such a ranking.
        """
        try:
            raw = json.loads(Path(path).read_text())
            ranked = tuple(int(t) for t in raw["ranked"])
            return cls(ranked, int(raw["vocab_size"]), str(raw["tokenizer"]), dict(raw["corpus"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path} is not a draft vocabulary ranking ({exc})") from None


def _cache_path(tok_hash: str, cache: str | os.PathLike | None = None) -> Path:
    from specviz.models.loading import cache_dir

    return cache_dir(cache) / "vocab" / f"{_FILE_PREFIX}{tok_hash}.json"


def draft_vocabulary(model, cache: str | os.PathLike | None = None) -> DraftVocabulary:
    """The ranking for ``model`` (a :class:`~specviz.models.LoadedModel`): the one shipped
    in ``data/`` for its tokenizer, else one counted on this machine and kept in the specviz
    cache.

    Raises:
        FileNotFoundError: there is none for this tokenizer (the message gives the command
            that counts one).
        ValueError: the ranking found indexes another vocabulary size than the model's.
    """
    tok_hash = tokenizer_hash(model.tokenizer)
    for path in (VOCABULARY_DIR / f"{_FILE_PREFIX}{tok_hash}.json", _cache_path(tok_hash, cache)):
        if path.is_file():
            vocab = DraftVocabulary.load(path)
            if vocab.vocab_size != model.vocab_size:
                raise ValueError(f"{path} ranks a vocabulary of {vocab.vocab_size} tokens, but {model.name!r} has "
                                 f"{model.vocab_size}")
            return vocab
    raise FileNotFoundError(
        f"no draft vocabulary ranking for {model.name!r}'s tokenizer (hash {tok_hash}); count one with "
        f"`python -m specviz.draft.vocab --draft {model.name}` (a few minutes of the draft writing answers)")


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
    from specviz.heads.corpus import build_corpus

    corpus = build_corpus(draft, prompts=prompts, tasks=tasks, max_new_tokens=max_new_tokens, seed=seed,
                          temperatures=temperatures, store=store, batch_size=batch_size, progress=progress)
    counts = Counter(t for seq in corpus.sequences for t in seq)
    ranked = tuple(sorted(counts, key=lambda t: (-counts[t], t)))  # the heads' reduced_vocab's order
    described = corpus.summary() | {
        "writer": draft.name, "weight_mode": draft.weight_mode, "tasks": tasks, "stdlib_prompts": prompts,
        "max_new_tokens": max_new_tokens, "temperatures": [float(t) for t in temperatures], "seed": seed,
        "distinct": len(ranked)}
    return DraftVocabulary(ranked, draft.vocab_size, tokenizer_hash(draft.tokenizer), described)


# ---------------------------------------------------------------------------------------------------
# Heads over some rows
# ---------------------------------------------------------------------------------------------------


def head_rows(head: nn.Module, rows: torch.Tensor) -> nn.Module:
    """Rows ``rows`` of the linear LM head ``head`` as a head of their own, multiplied by
    the same kernel. For the integer heads (``Int8Linear``, ``W8A8Linear``,
    ``W8A8TokenLinear``) each output is bitwise the full head's for that row; a float product
    of fewer rows may sum in another order (a last-bit difference).

    Supported: ``nn.Linear`` and specviz's ``Int8Linear``, ``WxLinear``, ``W8A8Linear``,
    ``W8A8TokenLinear`` and ``W4A8TokenLinear`` (bitwise as well); ``Int4Linear`` is
    requantized from its dequantized rows (its packed layout does not slice), which
    reproduces them up to float rounding.

    Raises:
        TypeError: any other module.
    """
    from specviz.models.weights import Int4Linear, Int8Linear, W4A8TokenLinear, W8A8Linear, WxLinear

    rows = torch.as_tensor(rows, dtype=torch.long)
    if isinstance(head, W4A8TokenLinear):
        return head.rows(rows)
    if isinstance(head, (nn.Linear, WxLinear)):
        weight = nn.Parameter(head.weight.detach()[rows.to(head.weight.device)], requires_grad=False)
        bias = None if head.bias is None else nn.Parameter(head.bias.detach()[rows.to(head.bias.device)],
                                                           requires_grad=False)
        if isinstance(head, WxLinear):
            return WxLinear(weight, bias)
        out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                        dtype=weight.dtype)
        out.weight, out.bias = weight, bias
        return out
    if isinstance(head, W8A8Linear):
        new = type(head).__new__(type(head))
        nn.Module.__init__(new)
        for name, buf in head._buffers.items():
            if buf is not None and name != "inv_smooth":
                buf = buf[rows.to(buf.device)].contiguous()
            new.register_buffer(name, buf)
        new.out_features, new.in_features = rows.numel(), head.in_features
        new.alpha, new.dynamic_rows = head.alpha, head.dynamic_rows
        if hasattr(head, "residual"):
            new.residual = head.residual
        new._packed = new._pack()
        return new
    if isinstance(head, Int8Linear):
        new = type(head).__new__(type(head))
        nn.Module.__init__(new)
        for name, buf in head._buffers.items():
            new.register_buffer(name, None if buf is None else buf[rows.to(buf.device)].contiguous())
        new.out_features, new.in_features = rows.numel(), head.in_features
        return new
    if isinstance(head, Int4Linear):
        weight = head.dequantized_weight()[rows]
        bias = None if head.bias is None else head.bias[rows]
        return Int4Linear(weight, bias, head.group_size) if hasattr(head, "group_size") else Int4Linear(weight, bias)
    raise TypeError(f"a reduced draft vocabulary needs a linear LM head; {type(head).__name__} is not one specviz "
                    "can take rows of")


_heads: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class ReducedHead:
    """A draft model's LM head scoring a fixed set of rows plus the tokens of one sequence.

    Called with hidden states ``(..., E)`` it returns logits ``(..., V)``: the scored rows'
    own values (the full head's, :func:`head_rows`), ``-inf`` elsewhere. The fixed
    rows' head is shared by every :class:`ReducedHead` over the same model and set
    (:func:`reduced_head`); :meth:`include` adds a sequence's tokens to this one alone, in
    a second, small head, and :meth:`reset` drops them.

    Args:
        base: the head over the fixed rows.
        rows: those rows' ids, ``(W,)``.
        full: the model's full LM head (where the extra rows come from).
        vocab_size: V.
    """

    def __init__(self, base: nn.Module, rows: torch.Tensor, full: nn.Module, vocab_size: int) -> None:
        self.base, self.rows, self.full, self.vocab_size = base, rows, full, vocab_size
        self._fixed = torch.zeros(vocab_size, dtype=torch.bool)
        self._fixed[rows] = True
        self.reset()

    def fresh(self) -> "ReducedHead":
        """A head over the same fixed rows (shared) without this one's included tokens."""
        return ReducedHead(self.base, self.rows, self.full, self.vocab_size)

    def reset(self) -> None:
        """Forget the tokens :meth:`include` added."""
        self._extra: list[int] = []
        self._extra_set: set[int] = set()
        self._extra_head: nn.Module | None = None
        self._index = self.rows

    @property
    def size(self) -> int:
        """Rows scored now (W)."""
        return int(self._index.numel())

    def include(self, tokens: Iterable[int]) -> None:
        """Score ``tokens`` from now on too (those outside the fixed rows and in range)."""
        new = [t for t in dict.fromkeys(int(t) for t in tokens)
               if 0 <= t < self.vocab_size and not self._fixed[t] and t not in self._extra_set]
        if not new:
            return
        self._extra.extend(new)
        self._extra_set.update(new)
        extra = torch.tensor(self._extra, dtype=torch.long)
        self._extra_head = head_rows(self.full, extra)
        self._index = torch.cat([self.rows, extra])

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        scored = self.base(hidden)  # (..., W0)
        if self._extra_head is not None:
            scored = torch.cat([scored, self._extra_head(hidden)], dim=-1)  # (..., W)
        out = scored.new_full((*scored.shape[:-1], self.vocab_size), float("-inf"))  # (..., V)
        out.index_copy_(out.dim() - 1, self._index.to(out.device), scored)
        return out


def reduced_head(draft, n: int, vocabulary: DraftVocabulary | None = None) -> ReducedHead:
    """A :class:`ReducedHead` of ``draft`` (a :class:`~specviz.models.LoadedModel`) over the
    ``n`` most frequent tokens of ``vocabulary`` (default :func:`draft_vocabulary`). The
    fixed rows' head is built once per model and ``n`` and shared.

    Raises:
        ValueError: ``n`` is not below the model's vocabulary size, or the ranking belongs
            to another tokenizer.
        FileNotFoundError: no ranking for the model's tokenizer (see :func:`draft_vocabulary`).
    """
    check_int("n", n)
    if n >= draft.vocab_size:
        raise ValueError(f"a draft vocabulary of {n} tokens is not smaller than {draft.name!r}'s {draft.vocab_size}")
    vocab = vocabulary if vocabulary is not None else draft_vocabulary(draft)
    if vocab.tokenizer != tokenizer_hash(draft.tokenizer):
        raise ValueError(f"the draft vocabulary ranking was counted with another tokenizer than {draft.name!r}'s")
    model = draft.model
    full = model.get_output_embeddings()
    if full is None:
        raise TypeError(f"{draft.name!r} has no LM head to take rows of")
    shared = _heads.setdefault(model, {})
    key = (n, vocab.tokenizer, vocab.corpus.get("sha256"), id(full))
    if key not in shared:
        rows = vocab.ids(n)
        shared[key] = (head_rows(full, rows), rows)
    base, rows = shared[key]
    return ReducedHead(base, rows, full, draft.vocab_size)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specviz.draft.vocab",
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
    from specviz.models.loading import DEFAULT_DRAFT, load_model

    for name in ("tasks", "prompts", "max_new_tokens"):
        if getattr(args, name) < 0 or (name == "max_new_tokens" and args.max_new_tokens < 1):
            parser.error(f"--{name.replace('_', '-')} must be {'>= 1' if name == 'max_new_tokens' else '>= 0'}")
    draft = load_model(args.draft or DEFAULT_DRAFT, dtype=args.dtype)
    tok_hash = tokenizer_hash(draft.tokenizer)
    out = Path(args.out) if args.out else _cache_path(tok_hash)
    store = Path(args.store) if args.store else _cache_path(tok_hash).with_suffix(".corpus.jsonl")
    vocab = build_draft_vocabulary(draft, tasks=args.tasks, prompts=args.prompts,
                                   max_new_tokens=args.max_new_tokens, store=store)
    vocab.save(out)
    print(f"{out}: {len(vocab.ranked)} distinct tokens ranked from {vocab.corpus['tokens']} "
          f"(corpus sha256 {vocab.corpus['sha256'][:12]})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
