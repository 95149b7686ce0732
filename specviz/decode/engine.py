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
3. the verifier picks the accepted path and the bonus token; the drafter sees the
   target's logits (:meth:`~specviz.draft.Drafter.observe_target`) and, if it asks for
   them, the target's last hidden states at the nodes
   (:meth:`~specviz.draft.Drafter.observe_hidden`; those of the prompt come from the
   prefill);
4. the cache keeps the prefix plus the root and the accepted path, moved into place
   (:func:`specviz.kvcache.compact_cache`); the bonus token becomes the next root.

Every step is recorded in a :class:`~specviz.decode.records.StepTrace` (tree,
acceptance, target and draft probabilities at the nodes, the exact expected acceptance,
wall times), every sequence in a :class:`~specviz.decode.records.GenerationResult`;
sequences stop by :class:`~specviz.decode.records.StopRules`. :func:`plain_generate` is
the target-only baseline and the reference for identity tests
(:func:`plain_generate_batch` decodes many prompts greedily at once, the fast way to
record long references);
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
from dataclasses import replace
from typing import Sequence

import torch

from specviz.decode.phases import phase
from specviz.decode.records import GenerationResult, StepTrace, StopRules
from specviz.draft.base import Drafter, draft_all
from specviz.models.kvcache import cache_length, compact_cache, forward_tokens, new_cache, select_rows, stack_caches
from specviz.models.loading import LoadedModel, check_same_tokenizer
from specviz.sampling import GREEDY, SamplingConfig, make_generator, probs_from_logits, sample
from specviz.tree.core import DraftTree, depths, pad_masks, pad_trees
from specviz.tree.side import SideBranch
from specviz.validate import check_int
from specviz.verify.rules import Verifier, as_verifier

__all__ = [
    "encode_prompt",
    "eos_token_ids",
    "stop_rules",
    "speculative_generate",
    "speculative_generate_batch",
    "plain_generate",
    "plain_generate_batch",
]


# -- prompts and stopping ------------------------------------------------------------------------

def encode_prompt(tokenizer, prompt: str | Sequence[int] | torch.Tensor, chat: bool = True) -> list[int]:
    """Token ids of ``prompt``.

    A string is wrapped in the tokenizer's chat template as one user turn (with the
    assistant generation prompt) when ``chat`` is True and the tokenizer has a
    template, and tokenized plainly otherwise; token ids are used as given.

    Raises:
        ValueError: an empty prompt, or ids that are not a flat sequence of
            non-negative integers.
        TypeError: a prompt that is neither text nor token ids.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt is empty; give some text or token ids")
        if chat and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
            raise ValueError(f"prompt ids must be a 1-D integer tensor, got {prompt.dtype} {tuple(prompt.shape)}")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"prompt must be text or a sequence of token ids, got {type(prompt).__name__}")
    ids = list(prompt)
    if not ids:
        raise ValueError("prompt is empty; give some text or token ids")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"prompt ids must be non-negative ints, position {i} holds {t!r}")
    return ids


def eos_token_ids(target: LoadedModel) -> tuple[int, ...]:
    """End-of-sequence ids of ``target``: its generation config's plus its tokenizer's."""
    found: list[int] = []
    gen_config = getattr(target.model, "generation_config", None)
    for source in (getattr(gen_config, "eos_token_id", None), getattr(target.tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        for t in ([source] if isinstance(source, int) else list(source)):
            if int(t) not in found:
                found.append(int(t))
    return tuple(found)


def stop_rules(target: LoadedModel, max_new_tokens: int, stop_at_eos: bool = True) -> StopRules:
    """The rules a run on ``target`` stops by: its end-of-sequence ids (when
    ``stop_at_eos``), the budget and its context limit."""
    return StopRules(eos_token_ids(target) if stop_at_eos else (), max_new_tokens, target.max_context)


def _limit_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """``tree`` without nodes deeper than ``max_depth``."""
    d = depths(tree)
    if int(d.max()) <= max_depth:
        return tree
    return tree.subtree(torch.nonzero(d <= max_depth).flatten().tolist())


def _check_prompt(target: LoadedModel, ids: list[int]) -> None:
    limit = target.max_context
    if len(ids) >= limit:
        raise ValueError(
            f"the prompt has {len(ids)} tokens but {target.name} handles at most {limit}; "
            "shorten it to leave room for at least one new token")
    top = max(ids)
    if top >= target.vocab_size:
        raise ValueError(f"prompt token id {top} is outside the vocabulary of {target.name} ({target.vocab_size})")


def _check_drafter(target: LoadedModel, drafter: Drafter) -> None:
    if not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a specviz Drafter, got {type(drafter).__name__}")
    for tok in drafter.tokenizers:
        if tok is not target.tokenizer:
            check_same_tokenizer(target.tokenizer, tok)


def _checked_tree(tree, drafter: Drafter, context: list[int], vocab: int) -> DraftTree:
    """The drafter's tree, validated; None (no proposal) becomes a root-only tree."""
    if tree is None:
        return DraftTree.from_lists([context[-1]], [-1])
    if not isinstance(tree, DraftTree):
        raise TypeError(f"drafter {drafter.name!r} returned {type(tree).__name__}, expected a DraftTree")
    if int(tree.tokens[0]) != context[-1]:
        raise ValueError(f"drafter {drafter.name!r} returned a tree rooted at token {int(tree.tokens[0])}; "
                         f"the root must be the last committed token {context[-1]}")
    top = int(tree.tokens.max())
    if top >= vocab:
        raise ValueError(f"drafter {drafter.name!r} proposed token id {top}, outside the target's vocabulary ({vocab})")
    return tree


def _node_probs(tree: DraftTree, logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """``(N,)`` target probability of each node's token at its parent; ``logits`` ``(N, V)``."""
    dist = torch.softmax(logits, dim=-1) if config.greedy else probs_from_logits(logits, config)  # (N, V)
    out = torch.ones(tree.n_nodes)
    if tree.n_nodes > 1:
        out[1:] = dist[tree.parents[1:], tree.tokens[1:]]
    return out


# -- the engine ---------------------------------------------------------------------------------

class _Row:
    """Per-sequence state of a running batch."""

    def __init__(self, prompt: list[int], drafter: Drafter, generator: torch.Generator) -> None:
        self.prompt = prompt
        self.tokens = list(prompt)  # committed: prompt + generated
        self.drafter = drafter
        self.generator = generator
        self.steps: list[StepTrace] = []
        self.stop_reason = ""
        self.wall_s = 0.0

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    def commit(self, tokens: Sequence[int], stops: StopRules) -> None:
        """Append a step's tokens (cut at end-of-sequence) and note why the row stops."""
        committed, self.stop_reason = stops.commit(tokens, len(self.prompt), self.generated)
        self.tokens.extend(committed)


def _prefill(target: LoadedModel, contexts: list[list[int]], hidden: bool = False):
    """A cache holding every context except its last token (right-padded rows), and with
    ``hidden`` the target's last hidden states there: one ``(len(c) - 1, E)`` tensor per
    context (None without ``hidden``)."""
    cache = new_cache(target.model)
    lens = [len(c) - 1 for c in contexts]
    m = max(lens)
    if m == 0:
        width = int(target.model.config.hidden_size)
        return cache, ([torch.zeros(0, width) for _ in contexts] if hidden else None)
    b = len(contexts)
    ids = torch.zeros(b, m, dtype=torch.long)  # (B, m)
    for r, c in enumerate(contexts):
        ids[r, :lens[r]] = torch.tensor(c[:-1])
    pos = torch.arange(m).expand(b, m)  # (B, m)
    allowed = None
    if min(lens) != m:
        # causal within each row's own tokens; pad_masks puts padding after them
        allowed = pad_masks([torch.ones(n, n, dtype=torch.bool).tril() for n in lens], [0] * b)  # (B, m, m)
    out = forward_tokens(target.model, cache, ids, pos, allowed, logits_to_keep=1, hidden=hidden)
    if not hidden:
        return cache, None
    states = out[1]  # (B, m, E)
    return cache, [states[r, :n] for r, n in enumerate(lens)]


def _finish(target: LoadedModel, row: _Row, start: float, drafter_name: str, verifier: str,
            config: SamplingConfig, max_new_tokens: int) -> GenerationResult:
    out = tuple(row.tokens[len(row.prompt):])
    return GenerationResult(
        prompt_ids=tuple(row.prompt), output_ids=out,
        text=target.tokenizer.decode(list(out), skip_special_tokens=True),
        steps=tuple(row.steps), wall_s=row.wall_s or time.perf_counter() - start,
        stop_reason=row.stop_reason, drafter=drafter_name, verifier=verifier, config=config,
        max_new_tokens=max_new_tokens)


def _verify_row(row: _Row, tree: DraftTree, logits: torch.Tensor, verifier: Verifier, config: SamplingConfig,
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


def _side_branch(row: _Row, context: torch.Tensor, tree: DraftTree, prefix: int,
                 max_context: int) -> SideBranch | None:
    """The row's side branch for this step (``context``: its committed tokens), or None when
    it has none or it would run past the context limit."""
    side = row.drafter.side_branch(context, tree)
    if side is None:
        return None
    if not isinstance(side, SideBranch):
        raise TypeError(f"drafter {row.drafter.name!r} returned a {type(side).__name__} side branch, "
                        "expected a SideBranch or None")
    if prefix + side.reach >= max_context:
        return None
    return side


def _run(target: LoadedModel, drafters: list[Drafter], prompts: list[list[int]], max_new_tokens: int,
         config: SamplingConfig, verifier: Verifier, seeds: list[int], analyze: bool,
         keep_draft_probs: bool, stop_at_eos: bool, attention: str) -> list[GenerationResult]:
    start = time.perf_counter()
    stops = stop_rules(target, max_new_tokens, stop_at_eos)
    vocab = target.vocab_size
    mode = verifier.sibling_sampling
    rows = [_Row(p, d, make_generator(s)) for p, d, s in zip(prompts, drafters, seeds)]
    for row in rows:
        row.drafter.reset()
    active = list(range(len(rows)))
    # drafters that read the target's hidden states get them after the prefill and after every step
    want_hidden = any(row.drafter.needs_target_hidden for row in rows)
    with phase("prefill"):
        cache, prefill_hidden = _prefill(target, [r.tokens for r in rows], hidden=want_hidden)
    if want_hidden:
        with phase("update"):
            for row, states in zip(rows, prefill_hidden):
                if row.drafter.needs_target_hidden:
                    row.drafter.observe_hidden(None, states)
    while active:
        t0 = time.perf_counter()
        contexts = [torch.tensor(rows[i].tokens) for i in active]  # (L_b,) per row
        with phase("draft"):
            drafted = draft_all([rows[i].drafter for i in active], contexts, config, mode,
                                [rows[i].generator for i in active])
        draft_time = time.perf_counter() - t0
        with phase("tree"):
            trees = []
            for i, tree in zip(active, drafted):
                row = rows[i]
                tree = _checked_tree(tree, row.drafter, row.tokens, vocab)
                room = stops.room(len(row.prompt), row.generated)
                trees.append(_limit_depth(tree, room - 1))
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
                                 attention=attention, hidden=want_hidden)
        logits, hidden = out if want_hidden else (out, None)  # (B, Nmax, V), (B, Nmax, E)
        forward_time = time.perf_counter() - t0
        pmax = max(prefix)
        keep_rows, dst, src = [], [], []
        for b, i in enumerate(active):
            row, tree, side = rows[i], trees[b], sides[b]
            n = tree.n_nodes
            s = side.size if side is not None else 0
            trace = _verify_row(row, tree, logits[b, :n], verifier, config, analyze, keep_draft_probs,
                                draft_time, forward_time, side)
            row.steps.append(trace)
            with phase("update"):
                row.drafter.observe_target(trace, logits[b, :n], logits[b, n:n + s] if side is not None else None)
                if hidden is not None and row.drafter.needs_target_hidden:
                    row.drafter.observe_hidden(trace, hidden[b, :n])
                row.drafter.observe(trace)
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
    return [_finish(target, row, start, name, verifier.name, config, max_new_tokens) for row in rows]


def _prepare(target: LoadedModel, drafter: Drafter, prompts: Sequence, max_new_tokens: int, chat: bool,
             config: SamplingConfig, verifier) -> tuple[list[list[int]], Verifier]:
    if not isinstance(target, LoadedModel):
        raise TypeError(f"target must be a specviz LoadedModel, got {type(target).__name__}")
    if not isinstance(config, SamplingConfig):
        raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}")
    check_int("max_new_tokens", max_new_tokens)
    _check_drafter(target, drafter)
    ids = [encode_prompt(target.tokenizer, p, chat) for p in prompts]
    for p in ids:
        _check_prompt(target, p)
    return ids, as_verifier(verifier, "verifier")


def speculative_generate(target: LoadedModel, drafter: Drafter, prompt: str | Sequence[int], *,
                         max_new_tokens: int = 64, config: SamplingConfig = GREEDY,
                         verifier: str | Verifier = "greedy", seed: int = 0, chat: bool = True,
                         analyze: bool = True, keep_draft_probs: bool = False,
                         stop_at_eos: bool = True, attention: str = "specviz") -> GenerationResult:
    """Generate with speculative decoding: ``drafter`` proposes, ``target`` verifies.

    The drafter is reset first, so a run depends only on its arguments.

    Args:
        target: the target model.
        drafter: any :class:`~specviz.drafters.Drafter`.
        prompt: text (chat template applied when ``chat``) or token ids.
        max_new_tokens: token budget.
        config: sampling configuration (greedy by default), shared by drafter and verifier.
        verifier: a rule name from :data:`specviz.verify.VERIFIERS` or a Verifier.
        seed: seeds the generator that drafting and verification draw from.
        chat: apply the chat template to text prompts.
        analyze: compute per-node target probabilities and the exact expected acceptance
            (costs a little; turn off for timing runs).
        keep_draft_probs: keep each tree's ``(N, V)`` draft distributions in the trace
            (large for real vocabularies).
        stop_at_eos: stop after an end-of-sequence token (False generates exactly
            ``max_new_tokens``, e.g. for fixed-length comparisons).
        attention: how the target's verification forward attends
            (:data:`specviz.attention.ATTENTION_CHOICES`; see :func:`~specviz.models.forward_tokens`).

    Returns:
        A :class:`GenerationResult`; stops on an end-of-sequence token, after
        ``max_new_tokens``, or at the target's context limit.

    Raises:
        ValueError: empty prompt, prompt that fills the context, bad budget, a drafter tree
            with the wrong root; :class:`~specviz.models.TokenizerMismatchError` when the
            drafter's tokenizer differs from the target's.
    """
    ids, rule = _prepare(target, drafter, [prompt], max_new_tokens, chat, config, verifier)
    return _run(target, [drafter], ids, max_new_tokens, config, rule, [seed], analyze, keep_draft_probs,
                stop_at_eos, attention)[0]


def speculative_generate_batch(target: LoadedModel, drafter: Drafter, prompts: Sequence[str | Sequence[int]], *,
                               max_new_tokens: int = 64, config: SamplingConfig = GREEDY,
                               verifier: str | Verifier = "greedy", seed: int | Sequence[int] = 0,
                               chat: bool = True, analyze: bool = True, keep_draft_probs: bool = False,
                               stop_at_eos: bool = True, attention: str = "specviz") -> list[GenerationResult]:
    """Speculative decoding of several prompts at once, one target call per step for all rows.

    Every row gets its own copy of ``drafter`` (:meth:`~specviz.drafters.Drafter.spawn`)
    and its own generator; the rows' draft-model forwards are batched too
    (:func:`~specviz.drafters.draft_all`). Rows accept different numbers of tokens, so
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
    ids, rule = _prepare(target, drafter, prompts, max_new_tokens, chat, config, verifier)
    drafters = [drafter.spawn() for _ in ids]
    return _run(target, drafters, ids, max_new_tokens, config, rule, seeds, analyze, keep_draft_probs, stop_at_eos,
                attention)


@torch.no_grad()
def plain_generate(target: LoadedModel, prompt: str | Sequence[int], *, max_new_tokens: int = 64,
                   config: SamplingConfig = GREEDY, seed: int = 0, chat: bool = True,
                   stop_at_eos: bool = True) -> GenerationResult:
    """Target-only decoding, one token per forward with a KV cache: the baseline for
    speedups and the reference for identity tests.

    Args:
        stop_at_eos: stop after an end-of-sequence token (False keeps going to
            ``max_new_tokens``, which :func:`specviz.decode.replay_acceptance` can use).
        Other arguments as in :func:`speculative_generate`.
    """
    if not isinstance(config, SamplingConfig):
        raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}")
    check_int("max_new_tokens", max_new_tokens)
    ids = encode_prompt(target.tokenizer, prompt, chat)
    _check_prompt(target, ids)
    start = time.perf_counter()
    stops = stop_rules(target, max_new_tokens, stop_at_eos)
    generator = make_generator(seed)
    cache = new_cache(target.model)
    tokens = list(ids)
    feed = torch.tensor([ids])  # (1, L)
    reason = ""
    while not reason:
        pos = torch.arange(len(tokens) - feed.shape[1], len(tokens))[None]  # (1, n)
        with phase("prefill" if len(tokens) == len(ids) else "forward"):
            logits = forward_tokens(target.model, cache, feed, pos, None, logits_to_keep=1)[0, -1]  # (V,)
        nxt = _next_token(logits, config, generator)
        _, reason = stops.commit([nxt], len(ids), len(tokens) - len(ids))
        tokens.append(nxt)
        feed = torch.tensor([[nxt]])
    out = tuple(tokens[len(ids):])
    return GenerationResult(
        prompt_ids=tuple(ids), output_ids=out, text=target.tokenizer.decode(list(out), skip_special_tokens=True),
        steps=(), wall_s=time.perf_counter() - start, stop_reason=reason, drafter="none",
        verifier="none", config=config, max_new_tokens=max_new_tokens)


def _next_token(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator) -> int:
    """The token target-only decoding commits after ``logits`` ``(V,)``: the argmax, or one
    draw from ``generator`` when ``config`` samples."""
    if config.greedy:
        return int(logits.argmax())
    return int(sample(probs_from_logits(logits, config), generator)[0])


@torch.no_grad()
def plain_generate_batch(target: LoadedModel, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int = 64,
                         batch_size: int = 16, chat: bool = True, stop_at_eos: bool = True,
                         config: SamplingConfig = GREEDY, seed: int | Sequence[int] = 0,
                         features: bool = False
                         ) -> list[GenerationResult] | list[tuple[GenerationResult, torch.Tensor]]:
    """Target-only decoding of many prompts, ``batch_size`` rows per forward.

    Each prompt is prefilled alone (the forward :func:`plain_generate` runs, so the first
    new token is the same); then the rows of a batch decode together, one forward per
    token for all of them, which reads the weights once for the whole batch instead of
    once per row: on a CPU, where a one-token forward is bound by the bytes of weights it
    reads, this multiplies the tokens per second. Prompts are batched in order of length
    so that rows of a batch have similar cache lengths (results come back in the order
    given). A row's cache keeps its own slots; the padding between them is masked out.

    Sampling (``config`` with a temperature) draws prompt ``i``'s tokens from its own
    generator, seeded ``seed + i`` (or ``seed[i]``), one draw per token as
    :func:`plain_generate` with that seed draws them: a row samples the same tokens
    whichever rows share its batch, as long as its logits are the same.

    Matrix products over several rows may round differently from one-row products, so a
    row can differ from :func:`plain_generate` where the target's top two tokens are
    a near-tie; in fp32 that is rare (the tests compare both).

    Args:
        prompts: the prompts (strings or token ids), at least one.
        batch_size: rows decoded together (1 decodes the prompts one by one).
        config: greedy (default) or a sampling configuration.
        seed: the first prompt's sampling seed (prompt ``i`` uses ``seed + i``), or one
            seed per prompt.
        features: also return the target's last hidden state (the input of its LM head)
            at every position of each sequence, prompt and continuation, as the decoding
            computed it: the prefill's for the prompt, each step's for the token it fed,
            and one more forward of a finished row for its last token. Draft heads learn
            from these (:func:`specviz.heads.build_corpus`), so their training data needs
            no second, teacher-forced pass over the sequences.
        Other arguments as in :func:`plain_generate`.

    Returns:
        One :class:`GenerationResult` per prompt, in order; with ``features``, pairs of it
        and a ``(T, H)`` float32 CPU tensor, ``T = len(prompt_ids) + len(output_ids)``.
    """
    if isinstance(prompts, (str, torch.Tensor)) or not len(prompts):
        raise ValueError("prompts must be a non-empty list of prompts")
    if not isinstance(config, SamplingConfig):
        raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}")
    check_int("max_new_tokens", max_new_tokens)
    check_int("batch_size", batch_size)
    if isinstance(seed, (list, tuple)):
        seeds = [check_int("seed", s, 0) for s in seed]
        if len(seeds) != len(prompts):
            raise ValueError(f"seed lists {len(seeds)} seeds for {len(prompts)} prompts; "
                             "give one per prompt or one int")
    else:
        seeds = [check_int("seed", seed, 0) + i for i in range(len(prompts))]
    encoded = [encode_prompt(target.tokenizer, p, chat) for p in prompts]
    for ids in encoded:
        _check_prompt(target, ids)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    results: list = [None] * len(encoded)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        gens = [make_generator(seeds[i]) for i in chunk]
        for i, result in zip(chunk, _plain_batch(target, [encoded[i] for i in chunk], max_new_tokens, stop_at_eos,
                                                 config, gens, features)):
            results[i] = result
    return results


def _plain_batch(target: LoadedModel, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool,
                 config: SamplingConfig, generators: list[torch.Generator], features: bool = False) -> list:
    """One batch of :func:`plain_generate_batch` (row ``b`` samples with ``generators[b]``;
    with ``features``, a finished row stays for one more forward, which feeds its last
    token for that token's hidden state and samples nothing)."""
    start = time.perf_counter()
    stops = stop_rules(target, max_new_tokens, stop_at_eos)
    caches, tokens, reasons, walls = [], [], [], []
    states: list[list[torch.Tensor]] = [[] for _ in prompts]  # per row: (n, H) hidden states in position order
    for b, ids in enumerate(prompts):
        cache = new_cache(target.model)
        pos = torch.arange(len(ids))[None]  # (1, L)
        logits = forward_tokens(target.model, cache, torch.tensor([ids]), pos, None, logits_to_keep=1,
                                hidden=features)
        if features:
            logits, hid = logits
            states[b].append(hid[0].float().cpu())  # (L, H)
        nxt = _next_token(logits[0, -1], config, generators[b])
        _, reason = stops.commit([nxt], len(ids), 0)
        caches.append(cache)
        tokens.append(list(ids) + [nxt])
        reasons.append(reason)
        walls.append(time.perf_counter() - start if reason else 0.0)
    active = [b for b, r in enumerate(reasons) if features or not r]
    lengths = [len(prompts[b]) for b in active]  # real cache slots of each active row
    cache = stack_caches(target.model, [caches[b] for b in active]) if active else None
    del caches
    smax = max(lengths) if active else 0
    step = 0  # slots appended after the padded length smax
    while active:
        rows = len(active)
        feed = torch.tensor([[tokens[b][-1]] for b in active])  # (B, 1)
        pos = torch.tensor([[n + step] for n in lengths])  # (B, 1)
        allowed = torch.zeros(rows, 1, smax + step + 1, dtype=torch.bool)  # (B, 1, Smax + step + 1)
        for r, n in enumerate(lengths):
            allowed[r, 0, :n] = True
        allowed[:, 0, smax:] = True
        logits = forward_tokens(target.model, cache, feed, pos, allowed, hidden=features)
        if features:
            logits, hid = logits
            hid = hid[:, -1].float().cpu()  # (B, H)
        logits = logits[:, -1]  # (B, V)
        step += 1
        keep = []
        for r, b in enumerate(active):
            if features:
                states[b].append(hid[r:r + 1])
                if reasons[b]:  # its last token's state is in: the row is done
                    continue
            nxt = _next_token(logits[r], config, generators[b])
            _, reason = stops.commit([nxt], len(prompts[b]), len(tokens[b]) - len(prompts[b]))
            tokens[b].append(nxt)
            if reason:
                reasons[b], walls[b] = reason, time.perf_counter() - start
            if features or not reason:
                keep.append(r)
        if len(keep) < rows:
            if not keep:
                break
            select_rows(cache, keep)
            active = [active[r] for r in keep]
            lengths = [lengths[r] for r in keep]
    out = []
    for b, ids in enumerate(prompts):
        new = tuple(tokens[b][len(ids):])
        result = GenerationResult(
            prompt_ids=tuple(ids), output_ids=new, text=target.tokenizer.decode(list(new), skip_special_tokens=True),
            steps=(), wall_s=walls[b], stop_reason=reasons[b], drafter="none", verifier="none", config=config,
            max_new_tokens=max_new_tokens)
        if features:
            hid = torch.cat(states[b])  # (T, H): every position fed once
            if hid.shape[0] != len(tokens[b]):
                raise RuntimeError(f"kept {hid.shape[0]} hidden states for {len(tokens[b])} positions")
            out.append((result, hid))
        else:
            out.append(result)
    return out
