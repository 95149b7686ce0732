"""SuffixDecoding (specviz.draft.suffix): the suffix counts against brute force, the speculation
trees it grows, the global tree over earlier outputs and its eviction; greedy identity, batches
and losslessness under sampling are in tests/test_decode.py with the other drafters."""

import random

import pytest
import torch

from specviz.decode.engine import speculative_generate
from specviz.draft.base import spawn
from specviz.draft.suffix import SuffixCounts, SuffixDrafter
from specviz.sampling import GREEDY


def _strings(counts: SuffixCounts) -> dict[tuple[int, ...], int]:
    out, stack = {}, [((), counts.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            out[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return out


def _brute(sequences, max_len) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    for seq in sequences:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + max_len) + 1):
                out[tuple(seq[i:j])] = out.get(tuple(seq[i:j]), 0) + 1
    return out


def test_counts_are_every_substrings_occurrences_and_removal_subtracts_them():
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    counts = SuffixCounts(5)
    for seq in seqs:
        counts.start()
        half = len(seq) // 2
        counts.extend(seq[:half])  # grown in two pieces, as a request grows step by step
        counts.extend(seq[half:])
    assert _strings(counts) == _brute(seqs, 5)
    last = seqs[-1]  # the suffixes of the sequence being extended, kept by extend, are the walked ones
    walked = counts.suffix_nodes(last, 4)
    assert [(m, id(n)) for m, n in counts.current_suffixes(min(4, len(last) - 1))] == [(m, id(n)) for m, n in walked]
    assert counts.root.count == sum(map(len, seqs)) and counts.n_nodes == 1 + len(_brute(seqs, 5))
    for gone in (seqs[2], seqs[0]):
        counts.remove(gone)
    left = [s for i, s in enumerate(seqs) if i not in (0, 2)]
    assert _strings(counts) == _brute(left, 5) and counts.n_nodes == 1 + len(_brute(left, 5))


def test_the_longest_matching_suffix_and_its_most_frequent_continuations():
    drafter = SuffixDrafter(n=4, depth=3, budget=8, max_sequences=0)
    # "1 2 3" was followed by 4 twice and by 9 once; the context ends in "1 2 3" again
    context = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 9, 7, 1, 2, 3]
    (name, length, score, nodes), = drafter.candidates(context)
    assert name == "request" and length == 3  # "7 1 2 3" has no earlier occurrence with a continuation
    tree = drafter.draft(torch.tensor(context), GREEDY, "greedy", None)
    # one node per matched token: the three best by path score, 4 (2 of the pattern's 4 occurrences, the
    # context's own included) then its own continuation; the shorter patterns' smaller trees score less
    assert _paths(tree) == {(4,), (4, 5), (4, 5, 1)} and tree.q.tolist() == pytest.approx([1, 0.5, 1, 1])
    assert score == pytest.approx(1.5)
    assert score == pytest.approx(sum(_scores(tree))) and tree.draft_probs is None
    wide = SuffixDrafter(n=4, depth=3, budget=8, factor=2.0, max_sequences=0).draft(
        torch.tensor(context), GREEDY, "greedy", None)
    assert _paths(wide) == {(4,), (4, 5), (4, 5, 1), (9,), (9, 7), (9, 7, 1)}  # depth 3, then the rarer branch
    assert wide.ranks.tolist() == [0, 0, 0, 0, 1, 0, 0] and int(wide.parents[4]) == 0


def _paths(tree) -> set[tuple[int, ...]]:
    return {tuple(int(tree.tokens[j]) for j in _path(tree, i)) for i in range(1, tree.n_nodes)}


def _path(tree, i):
    out = []
    while i > 0:
        out.append(i)
        i = int(tree.parents[i])
    return out[::-1]


def _scores(tree):
    """Each node's path score: the product of q from the root."""
    out = []
    for i in range(1, tree.n_nodes):
        p = 1.0
        for j in _path(tree, i):
            p *= float(tree.q[j])
        out.append(p)
    return out


def test_tree_size_follows_the_match_length_and_rare_continuations_are_left_out():
    drafter = SuffixDrafter(n=8, depth=8, budget=16, max_sequences=0)
    long = list(range(10, 22))
    tree = drafter.draft(torch.tensor(long + [0] + long[:8]), GREEDY, "greedy", None)
    assert tree.tokens[1:].tolist() == long[8:] + [0, 10, 11, 12]  # 8 matched tokens: 8 nodes, 8 deep
    short = SuffixDrafter(n=8, depth=8, budget=16, max_sequences=0)
    assert short.draft(torch.tensor([5, 6, 7, 8, 5]), GREEDY, "greedy", None).n_nodes == 2  # a 1-token match
    rare = SuffixDrafter(n=2, depth=2, budget=16, min_prob=0.3, max_sequences=0)
    context = [1, 2] + [1, 3] * 1 + [1, 4] * 3 + [1]  # after 1: 4 three times, 2 once, 3 once
    tree = rare.draft(torch.tensor(context), GREEDY, "greedy", None)
    assert tree.tokens[1:].tolist()[:1] == [4] and 2 not in tree.tokens[1:].tolist()
    assert SuffixDrafter(max_sequences=0).draft(torch.tensor([1, 2, 3]), GREEDY, "greedy", None).n_nodes == 1


def test_earlier_outputs_draft_through_the_global_tree_bounded_to_the_last_sequences(tiny_pair):
    drafter = SuffixDrafter(n=4, depth=4, budget=8, max_sequences=2)
    first = speculative_generate(tiny_pair.target, drafter, [7, 8, 9], max_new_tokens=12, stop_at_eos=False,
                                 chat=False)
    out = list(first.output_ids)
    # a new request whose context ends with the start of the first output: only the global tree knows it
    assert [c[0] for c in drafter.candidates([40, 41] + out[:4])] == ["global"]
    tree = drafter.draft(torch.tensor([40, 41] + out[:4]), GREEDY, "greedy", None)
    assert tree.tokens[1].item() == out[4]
    (seen,) = drafter._history  # the output as far as the drafter saw it: all but the last step's tokens
    assert seen == out[:len(seen)] and len(seen) >= 4 and drafter.global_counts.root.count == len(seen)
    # spawned rows share the global tree, and a request is added once however many rows reset
    speculative_generate(tiny_pair.target, drafter, [40, 41] + out[:4], max_new_tokens=6, stop_at_eos=False,
                         chat=False)
    row = spawn(drafter)
    row.reset()
    drafter.reset()
    assert len(drafter._history) == 2 and row.global_counts is drafter.global_counts
    for prompt in ([50, 51], [60, 61], [70, 71]):
        speculative_generate(tiny_pair.target, drafter, prompt, max_new_tokens=6, stop_at_eos=False, chat=False)
    drafter.reset()
    assert len(drafter._history) == 2  # the oldest evicted
    assert drafter.global_counts.root.count == sum(map(len, drafter._history))


def test_bad_settings_are_named():
    for kwargs, match in (({"n": 0}, "n"), ({"budget": -1}, "budget"), ({"factor": 0}, "factor"),
                          ({"min_prob": 1.5}, "min_prob"), ({"max_sequences": -1}, "max_sequences")):
        with pytest.raises(ValueError, match=match):
            SuffixDrafter(**kwargs)
    with pytest.raises(ValueError, match="context must"):
        SuffixDrafter().draft(torch.tensor([], dtype=torch.long), GREEDY, "greedy", None)
