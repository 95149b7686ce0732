"""Slow checks on the built-in pair: is speculative decoding exact, and what does adaptivity buy?

Three sections, each a function returning frozen dataclasses, plus a command line
(:mod:`specviz.checks.__main__`)::

    python -m specviz.checks                        # full: 10 prompts x 128 tokens, every section
    python -m specviz.checks --prompts 3 --tokens 32 --sections identity

* ``identity`` (fp32): every drafter's greedy output must equal the target's own greedy
  decoding (:func:`specviz.decode.plain_generate`) token for token;
* ``bf16``: the same comparison in bf16, where a batched verify and a one-token decode
  may round differently. Reported as a match rate; at every first divergence the
  target's logit gap between the two competing tokens is shown next to the bf16
  rounding step at that logit's magnitude, so a reader can see it is a near-tie;
* ``adaptive``: the two adaptive chain schedules against fixed chains, by greedy replay
  (:func:`specviz.decode.replay_acceptance`, no target calls on trees) with a modelled
  cost per step, ``1 + c * draft_forwards`` target-verify units, which does not depend
  on how busy the machine is.

Prompts are the first ``--prompts`` of the shipped prompt set, round-robin over its
categories; all rows of a drafter run as one batch (one verify call per step for all
prompts).

The full command runs for a long time, so every finished unit (a target-only reference,
one drafter's comparison) is appended to ``outputs/checks/partial/checks-<P>x<T>-<dtype>.jsonl``
as it completes; running the same command again after an interruption skips what is
there (``--fresh`` starts over).
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

from specviz.decode.engine import speculative_generate_batch
from specviz.decode.records import GenerationResult
from specviz.decode.replay import greedy_reference, reference_key, replay_acceptance
from specviz.draft.adaptive import AdaptiveChainDrafter
from specviz.draft.base import Drafter
from specviz.draft.model import ChainDrafter, TreeDrafter
from specviz.draft.registry import build_drafter
from specviz.draft.vocab import draft_vocabulary
from specviz.metrics.acceptance import summarize
from specviz.models.types import LoadedModel, ModelPair
from specviz.data.store import ResultStore
from specviz.tree.shapes import from_paths

__all__ = [
    "SPARSE_TREE",
    "default_drafters",
    "Mismatch",
    "DrafterCheck",
    "logit_gap",
    "references",
    "check_identity",
    "ScheduleResult",
    "compare_schedules",
    "format_checks",
    "format_schedules",
]

#: a sparse Medusa-style static tree: wide at depth 1, one deep spine
SPARSE_TREE = from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)])


#: the reduced draft vocabulary the checks run (``chain-k2-v32768``)
REDUCED_VOCAB = 32768


def default_drafters(pair: ModelPair) -> list[Drafter]:
    """One drafter of every kind, with the shapes the checks use (by registry name, plus the
    sparse tree, which no name spells). A chain with a reduced draft vocabulary
    (:mod:`specviz.draft.vocab`) joins them where the draft's vocabulary is larger than
    :data:`REDUCED_VOCAB` and a token ranking for its tokenizer is found."""
    # without trained exits a truncated target only agrees with itself when few layers are cut
    self_spec = f"self-spec-L{pair.target.model.config.num_hidden_layers - 4}-k3"
    names = ["chain-k4", "tree-2x2x1", "dynamic-w4-d5-b16", "adaptive-heuristic", "adaptive-throughput", self_spec,
             "ngram-n3-k5", "ngram-trie-n3-d5-b16", "merged", "switch", "choose", "jacobi-k5",
             "lookahead-w5-n4-g5"]
    if pair.draft.vocab_size > REDUCED_VOCAB:
        try:  # the reduced draft vocabulary, where a ranking for the draft's tokenizer exists
            draft_vocabulary(pair.draft)
            names.insert(1, f"chain-k2-v{REDUCED_VOCAB}")
        except FileNotFoundError:
            pass
    drafters = [build_drafter(name, pair) for name in names]
    drafters.insert(2, TreeDrafter(pair.draft, SPARSE_TREE))
    return drafters


@dataclass(frozen=True)
class Mismatch:
    """The first token where a speculative run left the target's own greedy output.

    Attributes:
        prompt_index: which prompt.
        position: index among the new tokens.
        plain_token: what target-only decoding chose.
        spec_token: what speculative decoding committed.
        logit_gap: target logit of ``plain_token`` minus that of ``spec_token``, from a
            fresh forward of the shared prefix in the check's dtype.
        top_logit: the larger of the two logits.
        rounding_step: the dtype's spacing of representable numbers at ``top_logit``.
    """

    prompt_index: int
    position: int
    plain_token: int
    spec_token: int
    logit_gap: float
    top_logit: float
    rounding_step: float


@dataclass(frozen=True)
class DrafterCheck:
    """One drafter's greedy outputs compared with target-only decoding.

    Attributes:
        drafter: the drafter's name.
        dtype: the target's weight mode ("fp32", "bf16", "w8a8-token", ...).
        n_prompts: prompts run.
        identical: prompts whose whole output matched.
        matched_tokens: new tokens before the first divergence, summed over prompts.
        total_tokens: new tokens of the target-only outputs, summed.
        tau: tokens committed per target call.
        mismatches: the first divergence of every prompt that diverged.
        wall_time_s: wall time of the batched speculative run.
    """

    drafter: str
    dtype: str
    n_prompts: int
    identical: int
    matched_tokens: int
    total_tokens: int
    tau: float
    mismatches: tuple[Mismatch, ...]
    wall_time_s: float

    @property
    def match_rate(self) -> float:
        """Fraction of prompts reproduced exactly."""
        return self.identical / self.n_prompts

    @property
    def token_match_rate(self) -> float:
        """Fraction of target tokens reproduced before the first divergence."""
        return self.matched_tokens / self.total_tokens if self.total_tokens else math.nan


def _mode_tag(model: LoadedModel) -> str:
    """The target's weight mode ("fp32", "bf16", "w8a8-token", ...): what a check ran in."""
    return model.weight_mode or {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[model.dtype]


@torch.no_grad()
def logit_gap(target: LoadedModel, prefix: Sequence[int], a: int, b: int) -> tuple[float, float, float]:
    """``(logit[a] - logit[b], max(logit[a], logit[b]), rounding step there)`` for the
    target's next-token logits after ``prefix``, in the model's own dtype."""
    logits = target.model(torch.tensor([list(prefix)], device=target.device)).logits[0, -1].cpu()  # (V,) model dtype
    la, lb = float(logits[a]), float(logits[b])
    top = max(la, lb)
    # spacing of representable numbers at |top|: eps (the spacing at 1.0) times its binade
    step = torch.finfo(logits.dtype).eps * 2.0 ** math.floor(math.log2(abs(top))) if top else 0.0
    return la - lb, top, step


def references(target: LoadedModel, prompts: Sequence[str], max_new_tokens: int, store: ResultStore,
               log: Callable[[str], None] = print) -> list[GenerationResult]:
    """Target-only greedy outputs of ``prompts`` (end-of-sequence tokens ignored), each
    read from ``store`` when it is there and added to it when computed
    (:func:`specviz.decode.replay.greedy_reference`, keyed by model, dtype, budget and prompt ids)."""
    tag = _mode_tag(target)
    out = []
    for i, p in enumerate(prompts):
        r = greedy_reference(target, p, max_new_tokens, store=store)
        out.append(r)
        log(f"[{tag}] target-only prompt {i}: {len(r.output_ids)} tokens, {r.wall_s:.1f} s")
    return out


def _check_from_row(row: dict) -> DrafterCheck:
    fields = dict(row)
    fields["mismatches"] = tuple(Mismatch(*m) for m in fields["mismatches"])
    return DrafterCheck(**{k: fields[k] for k in DrafterCheck.__dataclass_fields__})


def check_identity(pair: ModelPair, prompts: Sequence[str], drafters: Sequence[Drafter], max_new_tokens: int,
                   log: Callable[[str], None] = print, store: ResultStore | None = None) -> tuple[DrafterCheck, ...]:
    """Greedy speculative outputs of every drafter against target-only greedy decoding.

    Both sides ignore end-of-sequence tokens, so every prompt compares exactly
    ``max_new_tokens`` tokens (what follows an end-of-sequence token is still the
    target's deterministic greedy choice, so it tests the engine as well).

    Args:
        pair: target and draft, in the dtype to check.
        prompts: text prompts (chat template applied).
        drafters: drafters built on ``pair``.
        max_new_tokens: budget per prompt.
        log: progress printer.
        store: where finished units are kept (references and per-drafter results), so
            that a rerun after an interruption resumes; None keeps nothing.
    """
    target = pair.target
    tag = _mode_tag(target)
    store = store if store is not None else ResultStore(None)
    plain = references(target, prompts, max_new_tokens, store, log)
    checks = []
    # a drafter's result is only valid for these prompts and this budget
    runs_key = hashlib.sha256(" ".join(reference_key(target, r.prompt_ids, max_new_tokens)
                                       for r in plain).encode()).hexdigest()[:16]
    for drafter in drafters:
        unit = f"{tag}/{drafter.name}/{runs_key}"
        if unit in store:
            check = _check_from_row(store.rows_of(unit)[0])
            log(f"[{tag}] {check.drafter}: {check.identical}/{check.n_prompts} identical (from {store.path})")
            checks.append(check)
            continue
        start = time.perf_counter()
        runs = speculative_generate_batch(target, drafter, list(prompts), max_new_tokens=max_new_tokens,
                                          analyze=False, stop_at_eos=False)
        wall = time.perf_counter() - start
        mismatches, matched, identical = [], 0, 0
        for i, (ref, run) in enumerate(zip(plain, runs)):
            a, b = ref.output_ids, run.output_ids
            if a == b:
                identical += 1
                matched += len(a)
                continue
            pos = next(j for j in range(min(len(a), len(b)) + 1) if j == min(len(a), len(b)) or a[j] != b[j])
            matched += pos
            if pos < min(len(a), len(b)):
                gap, top, step = logit_gap(target, list(ref.prompt_ids) + list(a[:pos]), a[pos], b[pos])
                mismatches.append(Mismatch(i, pos, a[pos], b[pos], gap, top, step))
        (stats,) = summarize(runs)
        check = DrafterCheck(drafter.name, tag, len(prompts), identical, matched, sum(len(r.output_ids) for r in plain),
                             stats.tau, tuple(mismatches), wall)
        log(f"[{tag}] {check.drafter}: {identical}/{len(prompts)} identical, tau {check.tau:.2f}, {wall:.0f} s")
        # a mismatch is kept as its field values in order (store rows hold scalars and lists)
        store.add(unit, asdict(check) | {"mismatches": [list(asdict(m).values()) for m in check.mismatches]})
        checks.append(check)
    return tuple(checks)


@dataclass(frozen=True)
class ScheduleResult:
    """A chain schedule's greedy acceptance by replay, with a modelled cost.

    Attributes:
        drafter: the drafter's name.
        steps: target calls.
        new_tokens: tokens generated.
        drafted_tokens: draft tokens proposed (each costs one draft forward).
        acceptance_rate: accepted / drafted.
        tau: tokens committed per target call.
        cost_ratio: draft-forward cost in target-verify units used by the model.
        modelled_speedup: target-only cost (one verify unit per token) divided by
            ``sum over steps of (1 + cost_ratio * drafted)``.
    """

    drafter: str
    steps: int
    new_tokens: int
    drafted_tokens: int
    acceptance_rate: float
    tau: float
    cost_ratio: float
    modelled_speedup: float


def compare_schedules(pair: ModelPair, prompts: Sequence[str], max_new_tokens: int, cost_ratio: float,
                      log: Callable[[str], None] = print,
                      store: ResultStore | None = None) -> tuple[ScheduleResult, ...]:
    """Fixed chains versus the two adaptive schedules, by greedy replay on the same references
    (target-only outputs are read from and added to ``store`` as in :func:`check_identity`)."""
    target, d = pair.target, pair.draft
    refs = references(target, prompts, max_new_tokens, store if store is not None else ResultStore(None), log)
    log(f"references ready ({len(refs)} prompts)")
    schedules: list[Drafter] = [ChainDrafter(d, k) for k in (2, 4, 6)] + [
        AdaptiveChainDrafter(d, "heuristic"),
        AdaptiveChainDrafter(d, "throughput", cost_ratio=cost_ratio),
    ]
    out = []
    for drafter in schedules:
        runs = [replay_acceptance(target, drafter, ref) for ref in refs]
        (stats,) = summarize(runs)
        cost = sum(1.0 + cost_ratio * s.tree.budget for r in runs for s in r.steps)
        result = ScheduleResult(drafter.name, stats.n_steps, stats.new_tokens, stats.drafted_tokens,
                                stats.acceptance_rate, stats.tau, cost_ratio, stats.new_tokens / cost)
        log(f"{result.drafter}: tau {result.tau:.2f}, modelled speedup {result.modelled_speedup:.2f}")
        out.append(result)
    return tuple(out)


def format_checks(checks: Sequence[DrafterCheck]) -> str:
    """A text table of identity / match-rate checks plus every mismatch's logit gap."""
    lines = [f"{'mode':10} {'drafter':42} {'identical':>9} {'token match':>11} {'tau':>5} {'time s':>7}"]
    for c in checks:
        lines.append(f"{c.dtype:10} {c.drafter:42} {c.identical:>4}/{c.n_prompts:<4} {c.token_match_rate:>11.3f} "
                     f"{c.tau:>5.2f} {c.wall_time_s:>7.0f}")
    for c in checks:
        for m in c.mismatches:
            lines.append(f"  {c.dtype} {c.drafter} prompt {m.prompt_index} token {m.position}: target-only "
                         f"{m.plain_token}, speculative {m.spec_token}, logit gap {m.logit_gap:+.4f} at logit "
                         f"{m.top_logit:.3f} (rounding step {m.rounding_step:.4f})")
    return "\n".join(lines)


def format_schedules(results: Sequence[ScheduleResult]) -> str:
    """A text table of the schedule comparison."""
    lines = [f"{'drafter':22} {'steps':>6} {'drafted':>8} {'acc rate':>9} {'tau':>6} {'modelled speedup':>17}"]
    for r in results:
        lines.append(f"{r.drafter:22} {r.steps:>6} {r.drafted_tokens:>8} {r.acceptance_rate:>9.3f} {r.tau:>6.2f} "
                     f"{r.modelled_speedup:>17.3f}")
    return "\n".join(lines)
