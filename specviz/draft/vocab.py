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
  specviz cache), :func:`~specviz.heads.vocab.build_draft_vocabulary` counts one (``python -m specviz.heads.vocab``);
* :func:`head_rows` - the rows of a (possibly quantized) LM head as a head of its own, with
  the same kernel: every kept logit is bitwise the full head's for the integer modes (exact
  integer products), and equal up to the summation order of a float product;
* :class:`ReducedHead` - the head a :class:`~specviz.draft.base.DraftModelState` scores with:
  the ranked rows plus the sequence's own tokens, scattered into a full-width logit row.

Dimension legend: V = full vocabulary, W = scored rows, E = hidden size, M = positions.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
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
    "vocabulary_cache_path",
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
        tokens): one minus the heads' :func:`~specviz.models.heads.out_of_vocab_share`."""
        from specviz.models.heads import out_of_vocab_share

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


def vocabulary_cache_path(tok_hash: str, cache: str | os.PathLike | None = None) -> Path:
    from specviz.models.builtin import cache_dir

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
    for path in (VOCABULARY_DIR / f"{_FILE_PREFIX}{tok_hash}.json", vocabulary_cache_path(tok_hash, cache)):
        if path.is_file():
            vocab = DraftVocabulary.load(path)
            if vocab.vocab_size != model.vocab_size:
                raise ValueError(f"{path} ranks a vocabulary of {vocab.vocab_size} tokens, but {model.name!r} has "
                                 f"{model.vocab_size}")
            return vocab
    raise FileNotFoundError(
        f"no draft vocabulary ranking for {model.name!r}'s tokenizer (hash {tok_hash}); count one with "
        f"`python -m specviz.heads.vocab --draft {model.name}` (a few minutes of the draft writing answers)")


# ---------------------------------------------------------------------------------------------------
# Heads over some rows
# ---------------------------------------------------------------------------------------------------


def head_rows(head: nn.Module, rows: torch.Tensor) -> nn.Module:
    """Rows ``rows`` of the linear LM head ``head`` as a head of their own, multiplied by
    the same kernel. For the integer heads (``W8A8TokenLinear``, ``W4A8TokenLinear``) each
    output is bitwise the full head's for that row; a float product of fewer rows
    (``nn.Linear``) may sum in another order (a last-bit difference).

    Raises:
        TypeError: any other module.
    """
    from specviz.quant.weights import W4A8TokenLinear, W8A8TokenLinear

    rows = torch.as_tensor(rows, dtype=torch.long)
    if isinstance(head, W4A8TokenLinear):
        return head.rows(rows)
    if isinstance(head, nn.Linear):
        weight = nn.Parameter(head.weight.detach()[rows.to(head.weight.device)], requires_grad=False)
        bias = None if head.bias is None else nn.Parameter(head.bias.detach()[rows.to(head.bias.device)],
                                                           requires_grad=False)
        out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                        dtype=weight.dtype)
        out.weight, out.bias = weight, bias
        return out
    if isinstance(head, W8A8TokenLinear):
        new = type(head).__new__(type(head))
        nn.Module.__init__(new)
        for name, buf in head._buffers.items():
            if buf is not None and name != "inv_smooth":
                buf = buf[rows.to(buf.device)].contiguous()
            new.register_buffer(name, buf)
        new.out_features, new.in_features = rows.numel(), head.in_features
        new.alpha, new.residual = head.alpha, head.residual
        new._pack()
        return new
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


