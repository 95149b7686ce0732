"""The speculative decoding engine: draft, verify the whole tree in one target call, commit.

One step for every active sequence (batch row):

1. the row's drafter proposes a :class:`~specviz.tree.DraftTree` rooted at the last
   committed token;
2. the target runs once over ``[root, draft nodes]`` of every row (plus the drafter's
   side branch, if it asks for one: :class:`~specviz.tree.SideBranch`): the KV cache holds
   each row's committed tokens *except the last*, the new tokens get depth-based
   position ids and the 4D tree mask (:func:`specviz.tree.pad_trees`), so row ``b``'s
   logits ``(N_b, V)`` are exactly "the target's distribution after node i" that the
   verifiers expect;
3. the verifier picks the accepted path and the bonus token; the drafter observes the
   step with the target's logits and, if it reads them, the target's last hidden states
   at the nodes (:meth:`~specviz.draft.Drafter.observe` with a
   :class:`~specviz.draft.base.TargetOutputs`; the prompt's come from the prefill);
4. the cache keeps the prefix plus the root and the accepted path, moved into place
   (:func:`specviz.models.kvcache.compact_cache`); the bonus token becomes the next root.

Every step is recorded in a :class:`~specviz.decode.records.StepTrace` (tree,
acceptance, target and draft probabilities at the nodes, the exact expected acceptance,
wall times), every sequence in a :class:`~specviz.decode.records.GenerationResult`;
sequences stop by :class:`~specviz.decode.records.StopRules`. :func:`plain_generate` is
the target-only baseline and the reference for identity tests
(:func:`plain_generate_batch` decodes many prompts greedily at once, the fast way to
record long references; both live in :mod:`specviz.decode.plain`, and the prompt and
stopping helpers in :mod:`specviz.decode.prompts`, all importable from here);
:func:`specviz.decode.replay_acceptance` recomputes greedy acceptance for any drafter
from a recorded greedy continuation without running the target on any tree.

Probabilities in traces follow the verifier's view (after the sampling configuration);
under greedy decoding, where that view is one-hot, they are temperature-1 softmax
probabilities instead, which is what pictures and calibration want.

Dimension legend: B = batch rows, N = tree nodes incl. root (Nmax over rows), P =
committed prefix in the cache (Pmax over rows), L = committed tokens, V = vocabulary,
E = hidden size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from typing import Sequence

import torch

from specviz.decode.phases import phase
from specviz.decode.plain import plain_generate, plain_generate_batch
from specviz.decode.prompts import check_prompt, encode_prompt, eos_token_ids, stop_rules
from specviz.decode.records import GenerationResult, StepTrace
from specviz.decode.rows import Row, check_drafter, finish_row, step_tree
from specviz.draft.base import Drafter, TargetOutputs, draft_all, side_branch_of, spawn
from specviz.models.kvcache import (
    cache_length,
    compact_cache,
    forward_tokens,
    new_cache,
    select_rows,
    stack_caches,
)
from specviz.models.types import LoadedModel
from specviz.sampling import GREEDY, SamplingConfig, make_generator, probs_from_logits
from specviz.tree.core import DraftTree, pad_trees
from specviz.tree.side import SideBranch
from specviz.validate import check_int
from specviz.verify.rules import Verifier, as_verifier

__all__ = [
    "EngineOptions",
    "encode_prompt",
    "eos_token_ids",
    "stop_rules",
    "speculative_generate",
    "speculative_generate_batch",
    "plain_generate",
    "plain_generate_batch",
]


# -- the run's options ---------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineOptions:
    """How the engine decodes: one object for every option of a run, as transformers'
    ``GenerationConfig`` is for ``generate()``. :func:`speculative_generate` takes one
    and keyword changes of its fields (``max_new_tokens=32`` is ``replace(options,
    max_new_tokens=32)``).

    Attributes:
        max_new_tokens: token budget.
        config: sampling configuration (greedy by default), shared by drafter and verifier.
        verifier: a rule name from :data:`specviz.verify.VERIFIERS` or a Verifier.
        chat: apply the chat template to text prompts.
        analyze: compute per-node target probabilities and the exact expected acceptance
            (costs a little; turn off for timing runs).
        keep_draft_probs: keep each tree's ``(N, V)`` draft distributions in the trace
            (large for real vocabularies).
        stop_at_eos: stop after an end-of-sequence token (False generates exactly
            ``max_new_tokens``, e.g. for fixed-length comparisons).
        attention: how the target's verification forward attends
            (:data:`specviz.attention.ATTENTION_CHOICES`; see :func:`~specviz.models.forward_tokens`).
    """

    max_new_tokens: int = 64
    config: SamplingConfig = GREEDY
    verifier: str | Verifier = "greedy"
    chat: bool = True
    analyze: bool = True
    keep_draft_probs: bool = False
    stop_at_eos: bool = True
    attention: str = "specviz"

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens)
        if not isinstance(self.config, SamplingConfig):
            raise TypeError(f"config must be a SamplingConfig, got {type(self.config).__name__}")

    @classmethod
    def of(cls, options: "EngineOptions | None", changes: dict) -> "EngineOptions":
        """``options`` (the defaults when None) with ``changes`` to its fields.

        Raises:
            TypeError: ``options`` not an EngineOptions, or a change that names no option.
        """
        if options is None:
            options = cls()
        elif not isinstance(options, cls):
            raise TypeError(f"options must be an EngineOptions, got {type(options).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; the options are "
                            f"{', '.join(names)} (and seed)")
        return replace(options, **changes) if changes else options


# -- one step of a row ---------------------------------------------------------------------------

def _node_probs(tree: DraftTree, logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """``(N,)`` target probability of each node's token at its parent; ``logits`` ``(N, V)``."""
    dist = torch.softmax(logits, dim=-1) if config.greedy else probs_from_logits(logits, config)  # (N, V)
    out = torch.ones(tree.n_nodes)
    if tree.n_nodes > 1:
        out[1:] = dist[tree.parents[1:], tree.tokens[1:]]
    return out


def _prefill(target: LoadedModel, contexts: list[list[int]], hidden: bool = False):
    """A cache holding every context except its last token (right-padded rows), and with
    ``hidden`` the target's last hidden states there: one ``(len(c) - 1, E)`` tensor per
    context (None without ``hidden``).

    Each context is prefilled alone, the forward :func:`plain_generate` runs, and the
    rows' caches are then stacked: a prompt costs its own tokens, not the longest prompt's
    (one padded forward of B rows feeds B times the longest, which made the prefill of a
    batch of mixed prompt lengths several times its rows' own), and every row starts from
    exactly its plain decoding's cache."""
    width = int(target.model.config.hidden_size)
    caches, states = [], []
    for c in contexts:
        cache = new_cache(target.model)
        n = len(c) - 1
        if n == 0:
            caches.append(cache)
            states.append(torch.zeros(0, width))
            continue
        out = forward_tokens(target.model, cache, torch.tensor([c[:-1]]), torch.arange(n)[None], None,
                             logits_to_keep=1, hidden=hidden)
        caches.append(cache)
        states.append(out[1][0] if hidden else None)  # (n, E)
    cache = caches[0] if len(caches) == 1 else stack_caches(target.model, caches)
    return cache, (states if hidden else None)


def _verify_row(row: Row, tree: DraftTree, logits: torch.Tensor, verifier: Verifier, config: SamplingConfig,
                analyze: bool, keep_draft_probs: bool, draft_time: float, forward_time: float,
                side: SideBranch | None) -> StepTrace:
    """Apply the verification rule to one row's tree and record the step; ``logits`` ``(N, V)``."""
    t0 = time.perf_counter()
    with phase("verify"):
        acc = verifier(tree, logits, config, row.generator)
        verify_time = forward_time + time.perf_counter() - t0
        if analyze:
            node_probs = _node_probs(tree, logits, config)
            expected = verifier.expected_accepted(tree, logits, config)
        else:
            node_probs = torch.full((tree.n_nodes,), float("nan"))
            expected = float("nan")
    return StepTrace(
        step=len(row.steps),
        tree=tree if keep_draft_probs or tree.draft_probs is None else replace(tree, draft_probs=None),
        acceptance=acc, target_token_probs=node_probs, expected_accepted=expected,
        draft_time_s=draft_time, verify_time_s=verify_time, drafter=row.drafter.name, context_len=len(row.tokens),
        side=side)


def _side_branch(row: Row, context: torch.Tensor, tree: DraftTree, prefix: int,
                 max_context: int) -> SideBranch | None:
    """The row's side branch for this step (``context``: its committed tokens), or None when
    it has none or it would run past the context limit."""
    side = side_branch_of(row.drafter, context, tree)
    if side is None:
        return None
    if not isinstance(side, SideBranch):
        raise TypeError(f"drafter {row.drafter.name!r} returned a {type(side).__name__} side branch, "
                        "expected a SideBranch or None")
    if prefix + side.reach >= max_context:
        return None
    return side


# -- the engine ---------------------------------------------------------------------------------

def _run(target: LoadedModel, drafters: list[Drafter], prompts: list[list[int]], seeds: list[int],
         options: EngineOptions, verifier: Verifier) -> list[GenerationResult]:
    """The engine's loop: decode every prompt (one row each) until all rows stop."""
    start = time.perf_counter()
    config = options.config
    stops = stop_rules(target, options.max_new_tokens, options.stop_at_eos)
    vocab = target.vocab_size
    mode = verifier.sibling_sampling
    rows = [Row(p, d, make_generator(s)) for p, d, s in zip(prompts, drafters, seeds)]
    for row in rows:
        row.drafter.reset()
    active = list(range(len(rows)))
    # drafters that read the target's hidden states get them after the prefill and after every step
    want_hidden = any("hidden" in row.drafter.reads for row in rows)
    with phase("prefill"):
        cache, prefill_hidden = _prefill(target, [r.tokens for r in rows], hidden=want_hidden)
    if want_hidden:
        with phase("update"):
            for row, states in zip(rows, prefill_hidden):
                if "hidden" in row.drafter.reads:
                    row.drafter.observe(None, TargetOutputs(hidden=states))
    while active:
        t0 = time.perf_counter()
        contexts = [torch.tensor(rows[i].tokens) for i in active]  # (L_b,) per row
        with phase("draft"):
            drafted = draft_all([rows[i].drafter for i in active], contexts, config, mode,
                                [rows[i].generator for i in active])
        draft_time = time.perf_counter() - t0
        with phase("tree"):
            trees = [step_tree(rows[i], tree, stops, vocab) for i, tree in zip(active, drafted)]
        prefix = [len(rows[i].tokens) - 1 for i in active]
        assert cache_length(cache) == max(prefix), "cache length out of sync with the committed prefixes"
        t0 = time.perf_counter()
        with phase("draft"):
            sides = [_side_branch(rows[i], c, t, p, target.max_context)
                     for i, c, t, p in zip(active, contexts, trees, prefix)]
        draft_time += time.perf_counter() - t0
        with phase("tree"):
            batch = pad_trees(trees, prefix, sides=sides)
        t0 = time.perf_counter()
        with phase("forward"):
            out = forward_tokens(target.model, cache, batch.tokens, batch.position_ids, batch.mask,
                                 attention=options.attention, hidden=want_hidden)
        logits, hidden = out if want_hidden else (out, None)  # (B, Nmax, V), (B, Nmax, E)
        forward_time = time.perf_counter() - t0
        pmax = max(prefix)
        keep_rows, dst, src = [], [], []
        for b, i in enumerate(active):
            row, tree, side = rows[i], trees[b], sides[b]
            n = tree.n_nodes
            s = side.size if side is not None else 0
            trace = _verify_row(row, tree, logits[b, :n], verifier, config, options.analyze, options.keep_draft_probs,
                                draft_time, forward_time, side)
            row.steps.append(trace)
            with phase("update"):
                reads_hidden = hidden is not None and "hidden" in row.drafter.reads
                outputs = TargetOutputs(logits[b, :n], logits[b, n:n + s] if side is not None else None,
                                        hidden[b, :n] if reads_hidden else None)
                row.drafter.observe(trace, outputs)
                acc = trace.acceptance
                row.commit(acc.committed_tokens, stops)
            if row.stop_reason:
                row.wall_s = time.perf_counter() - start
                continue
            keep_rows.append(b)
            dst.append(prefix[b])
            src.append([pmax] + [pmax + n for n in acc.accepted_nodes])
        active = [active[b] for b in keep_rows]
        if not active:
            break
        with phase("cache"):
            if len(keep_rows) < len(trees):
                select_rows(cache, keep_rows)
            compact_cache(cache, dst, src, max(d + len(s) for d, s in zip(dst, src)))
    name = drafters[0].name
    return [finish_row(target, row, start, name, verifier.name, config, options.max_new_tokens) for row in rows]


def _prepare(target: LoadedModel, drafter: Drafter, prompts: Sequence,
             options: EngineOptions) -> tuple[list[list[int]], Verifier]:
    """Check a run's arguments; the prompts' token ids and the verification rule."""
    if not isinstance(target, LoadedModel):
        raise TypeError(f"target must be a specviz LoadedModel, got {type(target).__name__}")
    check_drafter(target, drafter)
    ids = [encode_prompt(target.tokenizer, p, options.chat) for p in prompts]
    for p in ids:
        check_prompt(target, p)
    return ids, as_verifier(options.verifier, "verifier")


def speculative_generate(target: LoadedModel, drafter: Drafter, prompt: str | Sequence[int],
                         options: EngineOptions | None = None, *, seed: int = 0, **changes) -> GenerationResult:
    """Generate with speculative decoding: ``drafter`` proposes, ``target`` verifies.

    The drafter is reset first, so a run depends only on its arguments.

    Args:
        target: the target model.
        drafter: any :class:`~specviz.draft.base.Drafter`.
        prompt: text (chat template applied when ``options.chat``) or token ids.
        options: how to decode (:class:`EngineOptions`; None: its defaults).
        seed: seeds the generator that drafting and verification draw from.
        **changes: changes to ``options``' fields, e.g. ``max_new_tokens=32``,
            ``config=SamplingConfig(temperature=1.0)``, ``verifier="chain"``.

    Returns:
        A :class:`GenerationResult`; stops on an end-of-sequence token, after
        ``max_new_tokens``, or at the target's context limit.

    Raises:
        ValueError: empty prompt, prompt that fills the context, bad budget, a drafter tree
            with the wrong root; :class:`~specviz.models.TokenizerMismatchError` when the
            drafter's tokenizer differs from the target's.
        TypeError: a change that names no option.
    """
    options = EngineOptions.of(options, changes)
    ids, rule = _prepare(target, drafter, [prompt], options)
    return _run(target, [drafter], ids, [seed], options, rule)[0]


def speculative_generate_batch(target: LoadedModel, drafter: Drafter, prompts: Sequence[str | Sequence[int]],
                               options: EngineOptions | None = None, *, seed: int | Sequence[int] = 0,
                               **changes) -> list[GenerationResult]:
    """Speculative decoding of several prompts at once, one target call per step for all rows.

    Every row gets its own copy of ``drafter`` (:func:`~specviz.draft.base.spawn`)
    and its own generator; the rows' draft-model forwards are batched too
    (:func:`~specviz.draft.base.draft_all`). Rows accept different numbers of tokens, so
    their committed lengths drift apart and the caches keep per-row lengths. A row that
    stops leaves the batch. Each row's output equals running that prompt alone with the same seed
    (exactly in fp32 up to float rounding of padded shapes).

    Args:
        prompts: one prompt per row.
        seed: one seed for every row, or one per row.
        Other arguments as in :func:`speculative_generate`.
    """
    if isinstance(prompts, (str, torch.Tensor)) or not len(prompts):
        raise ValueError("prompts must be a non-empty list of prompts")
    seeds = [seed] * len(prompts) if isinstance(seed, int) else list(seed)
    if len(seeds) != len(prompts):
        raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
    options = EngineOptions.of(options, changes)
    ids, rule = _prepare(target, drafter, prompts, options)
    drafters = [spawn(drafter) for _ in ids]
    return _run(target, drafters, ids, seeds, options, rule)
