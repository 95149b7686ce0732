"""Follow-up requests: a workload where earlier output comes back, built from the prompt set.

Serving engines meet requests that repeat earlier text: a chat's second turn revises the first
answer, an agent loop re-reads its own output. :func:`follow_up_references` builds such a workload
without a download. Each prompt opens a session: turn 1 is the prompt, turn 2 is the conversation
so far (the prompt, the target's greedy answer) plus the prompt's own second turn where it has one,
else :data:`FOLLOW_UP`, which asks for the answer again, corrected. Both turns are decoded
greedily by the target, so every strategy is measured along the same references.

:func:`workload_acceptance` replays strategies along them with one drafter per strategy for the
whole workload, in session order, as a server would meet them: a drafter that keeps state across
requests (suffix decoding's global tree) sees every earlier request's output. Drafters that need
the target's outputs (lookahead) run live instead. :func:`workload_speed` times a few requests of
turn 2 live, beside plain decoding.

    python -m specviz.bench.workload --limit 14 --out outputs/reference/workload-follow-up.csv
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pandas as pd

from specviz.bench.cost import compare_runs, timed_run
from specviz.data.machine import machine_label
from specviz.data.prompts import Prompt, load_prompts
from specviz.data.store import atomic_write_text
from specviz.decode.engine import speculative_generate
from specviz.decode.plain import plain_generate_batch
from specviz.decode.records import GenerationResult, result_from_row
from specviz.decode.replay import replay_acceptance
from specviz.draft.registry import build_drafter, parse_strategy
from specviz.draft.suffix import SuffixDrafter
from specviz.metrics.acceptance import summarize_steps
from specviz.models.loading import load_pair

__all__ = ["FOLLOW_UP", "WorkloadRequest", "follow_up_references", "save_references", "load_references",
           "workload_acceptance", "workload_summary", "workload_speed", "arctic_comparison", "main"]

#: turn 2 of a session whose prompt has one turn only
FOLLOW_UP = "Check your answer above for mistakes, then write the complete answer again with any mistakes fixed."


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of the workload and the target's greedy answer to it.

    Attributes:
        session: the session's position in the workload.
        turn: 1 (the prompt) or 2 (the follow-up, with the conversation so far).
        prompt: the prompt the session started from.
        reference: the target's greedy decoding of the request (not stopped at EOS).
    """

    session: int
    turn: int
    prompt: Prompt
    reference: GenerationResult


def _follow_up_ids(tokenizer, prompt: Prompt, answer: str) -> list[int]:
    """The token ids of turn 2: the prompt, the answer and the follow-up, in the chat template."""
    follow_up = prompt.turns[1] if len(prompt.turns) > 1 else FOLLOW_UP
    messages = [{"role": "user", "content": prompt.text}, {"role": "assistant", "content": answer},
                {"role": "user", "content": follow_up}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def follow_up_references(target, prompts: Sequence[Prompt], *, max_new_tokens: int = 64,
                         batch_size: int = 16) -> list[WorkloadRequest]:
    """The workload's requests in session order (turn 1, then turn 2 of each prompt), each with
    the target's greedy answer of ``max_new_tokens`` tokens, decoded ``batch_size`` rows at a time."""
    if not prompts:
        raise ValueError("the workload needs at least one prompt")
    if not getattr(target.tokenizer, "chat_template", None):
        raise ValueError(f"target {target.name!r} has no chat template, which the follow-up turns need")
    first = plain_generate_batch(target, [p.text for p in prompts], max_new_tokens=max_new_tokens,
                                 batch_size=batch_size, stop_at_eos=False)
    answers = [target.tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in first]
    second = plain_generate_batch(target, [_follow_up_ids(target.tokenizer, p, a) for p, a in zip(prompts, answers)],
                                  max_new_tokens=max_new_tokens, batch_size=batch_size, stop_at_eos=False)
    return [WorkloadRequest(i, turn, p, ref) for i, (p, a, b) in enumerate(zip(prompts, first, second))
            for turn, ref in ((1, a), (2, b))]


def save_references(requests: Sequence[WorkloadRequest], path: str | Path) -> Path:
    """Write the requests and their references as JSON lines (token ids), for :func:`load_references`."""
    lines = [json.dumps({"session": r.session, "turn": r.turn, "question_id": r.prompt.question_id,
                         "category": r.prompt.category, "turns": list(r.prompt.turns),
                         "prompt_ids": list(r.reference.prompt_ids), "output_ids": list(r.reference.output_ids),
                         "max_new_tokens": r.reference.max_new_tokens}) for r in requests]
    return atomic_write_text(path, "\n".join(lines) + "\n")


def load_references(path: str | Path) -> list[WorkloadRequest]:
    """The requests :func:`save_references` wrote (a rerun skips decoding them again).

    Raises:
        ValueError: a line that is not such a request (names the file and the line).
    """
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            # the file keeps no wall times: the references are replayed, never timed
            ref = result_from_row({"prompt_ids": d["prompt_ids"], "output_ids": d["output_ids"], "wall_s": 0.0},
                                  int(d["max_new_tokens"]))
            out.append(WorkloadRequest(int(d["session"]), int(d["turn"]),
                                       Prompt(int(d["question_id"]), d["category"], tuple(d["turns"])), ref))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}, line {lineno}: expected a workload request with session, turn, question_id, "
                             f"category, turns, prompt_ids, output_ids and max_new_tokens ({exc})") from None
    return out


def _row(strategy: str, request: WorkloadRequest, result: GenerationResult, mode: str) -> dict:
    stats = summarize_steps(result.steps, new_tokens=result.n_new_tokens)
    return {"strategy": strategy, "mode": mode, "session": request.session, "turn": request.turn,
            "question_id": request.prompt.question_id, "category": request.prompt.category,
            "prompt_tokens": len(request.reference.prompt_ids), "new_tokens": result.n_new_tokens,
            "steps": stats.n_steps, "drafted": stats.drafted_tokens, "accepted": stats.accepted_tokens,
            "tau": result.n_new_tokens / max(1, stats.n_steps),
            "matches_reference": tuple(result.output_ids) == tuple(request.reference.output_ids[:result.n_new_tokens])}


def workload_acceptance(pair, requests: Sequence[WorkloadRequest], strategies: Sequence[str], *,
                        live_sessions: int | None = None) -> pd.DataFrame:
    """One row per (strategy, request): steps, drafted and accepted tokens and tau, the requests met
    in order by one drafter per strategy. A strategy a replay cannot run (it reads the target's
    outputs) runs live on the first ``live_sessions`` sessions (all when None)."""
    rows = []
    for name in strategies:
        drafter = build_drafter(parse_strategy(name), pair)
        live = "logits" in drafter.reads
        for request in requests:
            if live and live_sessions is not None and request.session >= live_sessions:
                continue
            ref = request.reference
            if live:
                result = speculative_generate(pair.target, drafter, list(ref.prompt_ids),
                                              max_new_tokens=ref.max_new_tokens, stop_at_eos=False)
            else:
                result = replay_acceptance(pair.target, drafter, ref, stop_at_eos=False)
            rows.append(_row(name, request, result, "live" if live else "replay"))
    return pd.DataFrame(rows)


def workload_summary(table: pd.DataFrame) -> pd.DataFrame:
    """:func:`workload_acceptance`'s rows pooled per (strategy, turn): requests, tokens, steps,
    tau (tokens over steps), the acceptance rate (accepted over drafted tokens), the lowest
    per-category tau and whether every run reproduced the references."""
    by_category = table.groupby(["strategy", "turn", "category"], sort=False)[["new_tokens", "steps"]].sum()
    lowest = (by_category["new_tokens"] / by_category["steps"]).groupby(level=["strategy", "turn"], sort=False).min()
    out = table.groupby(["strategy", "turn"], sort=False).agg(
        mode=("mode", "first"), requests=("session", "size"), new_tokens=("new_tokens", "sum"), steps=("steps", "sum"),
        drafted=("drafted", "sum"), accepted=("accepted", "sum"), matches_reference=("matches_reference", "all"))
    out["tau"] = out["new_tokens"] / out["steps"]
    out["lowest_category_tau"] = lowest
    out["acceptance_rate"] = out["accepted"] / out["drafted"]
    return out.reset_index()


def workload_speed(pair, requests: Sequence[WorkloadRequest], strategies: Sequence[str], *, turn: int = 2,
                   sessions: int = 3) -> pd.DataFrame:
    """Timed greedy runs (:func:`~specviz.bench.cost.timed_run`) of plain decoding and each strategy
    on turn ``turn`` of the first ``sessions`` sessions, plain first, the strategies in a rotating
    order; :func:`~specviz.bench.cost.compare_runs` columns (``tokens_per_s``, ``speedup``)."""
    chosen = [r for r in requests if r.turn == turn and r.session < sessions]
    rows = []
    for k, request in enumerate(chosen):
        ids = list(request.reference.prompt_ids)
        order = list(strategies[k % len(strategies):]) + list(strategies[:k % len(strategies)])
        for name in ["plain"] + order:
            drafter = None if name == "plain" else build_drafter(parse_strategy(name), pair)
            run = timed_run(pair.target, drafter, ids, max_new_tokens=request.reference.max_new_tokens, method=name)
            rows.append({"method": name, "question_id": request.prompt.question_id,
                         "category": request.prompt.category, "session": request.session, **dataclasses.asdict(run)})
    return compare_runs(pd.DataFrame(rows))


def _paths(tokens: Sequence[int], parents: Sequence[int]) -> frozenset[tuple[int, ...]]:
    """Every node's token path from the root (``parents[i]`` before ``i``; -1: under the root)."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (int(token),))
    return frozenset(paths)


def arctic_comparison(requests: Sequence[WorkloadRequest], *, budget: int = 16, factor: float = 1.0,
                      min_prob: float = 0.1, max_tree_depth: int = 64) -> pd.DataFrame:
    """specviz's :class:`~specviz.draft.suffix.SuffixDrafter` and ``arctic-inference``'s
    ``SuffixDecodingCache`` fed the same token streams, the requests in order: at every position of
    every answer both propose for the same context, then the answer's token joins both. One row per
    request: positions, proposals that are the same tree of token paths, and those that are not,
    split into proposals of equal score (a tie broken the other way), proposals equal to the one of
    the cache's other tree (its request tree's or its global tree's, the choice between them tipped)
    and the rest.

    Configured alike: patterns shorter than ``max_tree_depth``, at most ``budget`` nodes, ``factor``
    and ``min_prob``. arctic-inference adds a request's answer to its global tree while it is being
    written; specviz adds it when the request is over, which can tip the choice between the trees.

    Raises:
        ImportError: ``arctic_inference.suffix_decoding`` cannot be imported (its C++ module is built
            with the package, which targets vLLM on a GPU).
    """
    from arctic_inference.suffix_decoding import SuffixDecodingCache
    from arctic_inference.suffix_decoding._C import SuffixTree

    cache = SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=256)
    ours = SuffixDrafter(n=max_tree_depth - 1, depth=budget, budget=budget, factor=factor, min_prob=min_prob)
    rows = []
    for k, request in enumerate(requests):
        prompt, output = list(request.reference.prompt_ids), list(request.reference.output_ids)
        cache.start_request(k, prompt)
        ours.reset()
        same = ties = tipped = other = 0
        for t in range(len(output)):
            context = prompt + output[:t]
            theirs = cache.speculate(k, context, max_spec_tokens=budget, max_spec_factor=factor,
                                     min_token_prob=min_prob, use_tree_spec=True)
            found = ours.candidates(context)
            mine = max(found, key=lambda c: c[2]) if found else None
            a = _paths([tok for _, tok, _ in mine[3]], [p - 1 for p, _, _ in mine[3]]) if mine else frozenset()
            b = _paths(theirs.token_ids, theirs.parents)
            if a == b:
                same += 1
            elif mine is not None and abs(mine[2] - theirs.score) < 1e-4:
                ties += 1
            elif any(a == _paths(d.token_ids, d.parents) for d in (
                    SuffixTree.speculate(tree, context[-max_tree_depth:], budget, factor, 0.0, min_prob, True)
                    for tree in (cache._local_trees[k], cache._global_tree))):
                tipped += 1
            else:
                other += 1
            cache.add_active_response(k, [output[t]])
        ours.candidates(prompt + output)  # the last token too, as the cache has it
        cache.stop_request(k)
        rows.append({"session": request.session, "turn": request.turn, "category": request.prompt.category,
                     "positions": len(output), "same": same, "equal_score": ties, "other_tree": tipped,
                     "different": other})
    return pd.DataFrame(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specviz.bench.workload``: the follow-up workload's acceptance (and speed) per strategy."""
    p = argparse.ArgumentParser(prog="python -m specviz.bench.workload", description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=14, help="prompts (sessions), round-robin over categories")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens of every answer")
    p.add_argument("--strategies", default="suffix,ngram-trie,ngram,lookahead",
                   help="comma-separated strategy names (python -m specviz.bench --list-methods)")
    p.add_argument("--live-sessions", type=int, default=3,
                   help="sessions that strategies needing the target's outputs (lookahead) run live on")
    p.add_argument("--timed-sessions", type=int, default=3, help="turn-2 requests timed end to end (0: none)")
    p.add_argument("--dtype", default="fp32", help="weight mode of the models (fp32: the exactness reference)")
    p.add_argument("--references", help="requests and references written by an earlier run (.references.jsonl): "
                   "decode nothing again")
    p.add_argument("--arctic", action="store_true",
                   help="also feed the same token streams to arctic-inference's SuffixDecodingCache (.arctic.csv)")
    p.add_argument("--out", required=True, help="CSV of the acceptance rows; their summary, the timed runs and the "
                   "references go beside it (.summary.csv, .speed.csv, .references.jsonl)")
    args = p.parse_args(argv)
    strategies = [s for s in args.strategies.split(",") if s]
    try:
        for s in strategies:
            parse_strategy(s)
    except ValueError as exc:
        p.error(str(exc))
    start = time.perf_counter()
    pair = load_pair(dtype=args.dtype)
    out = Path(args.out)
    if args.references:
        requests = load_references(args.references)
    else:
        prompts = load_prompts(limit=args.limit)
        print(f"[workload] {len(prompts)} sessions x 2 turns x {args.max_new_tokens} tokens: greedy references",
              file=sys.stderr, flush=True)
        requests = follow_up_references(pair.target, prompts, max_new_tokens=args.max_new_tokens)
        save_references(requests, out.with_suffix(".references.jsonl"))
    print(f"[workload] references after {time.perf_counter() - start:.0f} s; replaying {strategies}",
          file=sys.stderr, flush=True)
    table = workload_acceptance(pair, requests, strategies, live_sessions=args.live_sessions)
    command = "python -m specviz.bench.workload " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    table = table.assign(machine=machine_label(), command=command)
    atomic_write_text(out, table.to_csv(index=False))
    summary = workload_summary(table).assign(machine=machine_label(), command=command)
    atomic_write_text(out.with_suffix(".summary.csv"), summary.to_csv(index=False))
    print(summary.drop(columns=["machine", "command"]).round(3).to_string(index=False))
    if args.timed_sessions:
        speed = workload_speed(pair, requests, strategies, sessions=args.timed_sessions)
        speed = speed.drop(columns="output_ids").assign(machine=machine_label(), command=command)
        atomic_write_text(out.with_suffix(".speed.csv"), speed.to_csv(index=False))
        print(speed.groupby("method", sort=False)[["tokens_per_s", "speedup"]].mean().round(3).to_string())
    if args.arctic:
        try:
            peer = arctic_comparison(requests)
        except ImportError as exc:
            print(f"[workload] arctic-inference's suffix cache does not import here ({exc}); no comparison",
                  file=sys.stderr)
        else:
            peer = peer.assign(machine=machine_label(), command=command)
            atomic_write_text(out.with_suffix(".arctic.csv"), peer.to_csv(index=False))
            print(peer[["positions", "same", "equal_score", "other_tree", "different"]].sum().to_string())
    print(f"[workload] done in {time.perf_counter() - start:.0f} s; wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
