"""The chooser over many drafters: exploration, the worths that pick a part, what each part
learns, and that the output stays the target's."""

import types

import pytest
import torch

from specviz.decode.engine import plain_generate, speculative_generate
from specviz.draft import ChainDrafter, ChooserDrafter, JacobiDrafter, NgramDrafter, SuffixDrafter
from specviz.draft.registry import build_drafter, parse_strategy
from specviz.sampling import SamplingConfig

PROMPT = "Repeat after me three times: the red fox jumps over the lazy dog, the red fox jumps."
GREEDY = SamplingConfig()


class _Costs:
    """A verification cost curve: 0.1 s plus 0.01 s per token fed."""

    @staticmethod
    def target_s(n):
        return 0.1 + 0.01 * (n - 1)


def _step(tree, accepted, draft_s=0.0, verify_s=0.1):
    acceptance = types.SimpleNamespace(n_accepted=accepted,
                                       accepted_tokens=tuple(tree.tokens[1:1 + accepted].tolist()), bonus_token=0)
    return types.SimpleNamespace(step=1, tree=tree, acceptance=acceptance, draft_time_s=draft_s,
                                 verify_time_s=verify_s, fed_tokens=tree.n_nodes)


def test_output_is_the_targets_and_every_part_drafts(tiny_pair):
    chooser = ChooserDrafter([NgramDrafter(n=3, k=4), SuffixDrafter(), ChainDrafter(tiny_pair.draft, 2)],
                             revisit=6)
    result = speculative_generate(tiny_pair.target, chooser, PROMPT, max_new_tokens=40, stop_at_eos=False)
    reference = plain_generate(tiny_pair.target, PROMPT, max_new_tokens=40, stop_at_eos=False)
    assert result.output_ids == reference.output_ids
    assert len(chooser.history) == len(result.steps)
    names = [d.name for d in chooser.drafters]
    assert chooser._chosen[2] >= chooser.explore  # the chain always proposes: explored
    assert all(chooser.draft_s(i) == chooser.draft_s(i) for i in range(3))  # every part's drafting was timed
    for step, (part, worths) in zip(result.steps, chooser.history):
        if part == "plain":
            assert step.tree.n_nodes == 1
        else:
            assert step.tree.source.tolist() == [names.index(part)] * step.tree.n_nodes
        assert len(worths) == 3
    assert sum(chooser._chosen) == sum(part != "plain" for part, _ in chooser.history)


def test_worths_pick_the_part_and_plain_decoding_wins_when_nothing_pays(tiny_pair):
    ngram, chain = NgramDrafter(n=3, k=4), ChainDrafter(tiny_pair.draft, 2)
    chooser = ChooserDrafter([ngram, chain], explore=0, revisit=0, costs=_Costs(), draft_costs=[0.0, 0.05])
    # prior acceptance 1/2 per depth: a chain of 2 commits 1 + 0.5 + 0.25 tokens on average
    assert chooser.expected_tokens(1, 2) == pytest.approx(1.75)
    assert chooser.worth(1, 2, 3) == pytest.approx(1.75 / (0.12 + 0.05))
    silent = torch.tensor([1, 2, 3, 4, 5])  # no lookup match, the chain never measured: plain decoding
    tree = chooser.draft(silent, GREEDY, "greedy", None)
    assert tree.n_nodes == 1 and chooser.last_part is None and chooser.history[-1][0] == "plain"
    chooser._shape[1] = (2, 3)  # the chain's latest tree: worth 10.3 tokens/s against a plain step's 10
    tree = chooser.draft(silent, GREEDY, "greedy", None)
    assert chooser.last_part == 1 and tree.n_nodes == 3 and tree.source.tolist() == [1, 1, 1]
    # a 3-token lookup match is asked first (it costs nothing) and is worth more than the chain
    repeating = torch.tensor([7, 8, 9, 10, 11, 12, 13, 7, 8, 9])
    tree = chooser.draft(repeating, GREEDY, "greedy", None)
    assert chooser.last_part == 0 and tree.tokens.tolist() == [9, 10, 11, 12, 13]
    assert chooser.history[-1][1][0] == pytest.approx(chooser.expected_tokens(0, 4) / 0.14)


def test_parts_learn_their_acceptance_and_costs(tiny_pair):
    chain = ChainDrafter(tiny_pair.draft, 2)
    context = torch.tensor([1, 2, 3, 4, 5])
    chain.draft(context, GREEDY, "greedy", None)  # warm: a first forward prepares the model
    chooser = ChooserDrafter([NgramDrafter(n=3, k=4), chain], explore=0, revisit=0)
    chooser._shape[1] = (2, 3)
    chooser._first_s[1] = 0.001  # its first draft was cheap: it drafts, and is timed, every step
    tree = chooser.draft(context, GREEDY, "greedy", None)
    assert chooser.last_part == 1 and len(chooser._draft_s[1]) == 1 and chooser._first_s[0] is None
    chooser.observe(_step(tree, 0, verify_s=0.12))
    assert chooser._tried[1] == [1.0, 0.0] and chooser._accepted[1] == [0.0, 0.0]  # depth 2 never reached
    chooser.observe(_step(tree, 2, verify_s=0.12))
    assert chooser._tried[1] == [2.0, 1.0] and chooser._accepted[1] == [1.0, 1.0]
    assert chooser._chosen == [0, 2]
    chooser._draft_s[1] = [0.05, 0.07]
    assert chooser.draft_s(1) == pytest.approx(0.06) and not chooser.is_cheap(1)  # the median of the later drafts
    # verification: a size's first step is left out, one size timed keeps the prior's shape
    assert chooser._verify == [(3, 0.12)]
    assert chooser.verify_s(1) == pytest.approx(0.12 * 0.25 / (0.25 + 2 * 0.005))
    chooser.last_part = None
    plain = type(tree).from_lists([5], [-1])
    for seconds in (0.30, 0.10):  # the first one-token step (0.30) is a warm-up
        chooser.observe(_step(plain, 0, verify_s=seconds))
    assert chooser.verify_s(1) == pytest.approx(0.10) and chooser.verify_s(5) == pytest.approx(0.14)
    chooser.last_part = 1  # two sizes: the line through their medians, which one slow forward hardly moves
    for seconds in (0.12, 5.0):
        chooser.observe(_step(tree, 0, verify_s=seconds))
    assert chooser.verify_s(5) == pytest.approx(0.14)
    chooser.reset()
    assert chooser._tried == [[], []] and chooser.history == [] and chooser._verify == []


def test_a_part_left_out_for_long_is_revisited(tiny_pair):
    chooser = ChooserDrafter([NgramDrafter(n=3, k=4), ChainDrafter(tiny_pair.draft, 2)], explore=1, revisit=3,
                             costs=_Costs(), draft_costs=[0.0, 10.0], patience=0)  # the chain costs far too much
    context = torch.tensor([1, 2, 3, 4, 5])
    parts = []
    for _ in range(12):
        tree = chooser.draft(context, GREEDY, "greedy", None)
        parts.append(chooser.last_part)
        chooser.observe(_step(tree, 0))
    # the lookup, asked first every step, never matches; the chain drafts when it has waited three steps
    assert parts == [1, None, None, None] * 3


def test_expensive_parts_wait_while_a_cheap_part_drafts(tiny_pair):
    chooser = ChooserDrafter([NgramDrafter(n=3, k=4), ChainDrafter(tiny_pair.draft, 2)], revisit=2, patience=2,
                             costs=_Costs(), draft_costs=[0.0, 0.05])
    repeating = torch.tensor([7, 8, 9, 10, 11, 12, 13, 7, 8, 9])
    for _ in range(6):  # the lookup proposes every step: the chain is neither explored nor revisited
        tree = chooser.draft(repeating, GREEDY, "greedy", None)
        chooser.observe(_step(tree, 4))
    assert [part for part, _ in chooser.history] == [chooser.drafters[0].name] * 6
    assert chooser._first_s[1] is None  # the draft model never ran
    parts = []
    for _ in range(3):  # the lookup's drafts are rejected at their first token
        tree = chooser.draft(repeating, GREEDY, "greedy", None)
        parts.append(chooser.last_part)
        chooser.observe(_step(tree, 0))
    assert parts == [0, 0, 1]  # two steps without an accepted lookup token, then the chain is explored
    silent = torch.tensor([1, 2, 3, 4, 5])
    eager = ChooserDrafter([NgramDrafter(n=3, k=4), ChainDrafter(tiny_pair.draft, 2)], patience=0,
                           costs=_Costs(), draft_costs=[0.0, 0.05])
    eager.draft(silent, GREEDY, "greedy", None)
    assert eager.last_part == 1  # no patience: explored at once
    with pytest.raises(ValueError, match="patience"):
        ChooserDrafter([NgramDrafter(), SuffixDrafter()], patience=-1)


def test_sampled_runs_are_reproducible_with_fixed_costs(tiny_pair):
    config = SamplingConfig(temperature=0.8)
    verifier = parse_strategy("choose").verifier(0.8)
    assert verifier == "topk"
    fixed = ChooserDrafter([NgramDrafter(), ChainDrafter(tiny_pair.draft, 2)], costs=_Costs(),
                           draft_costs=[0.0, 0.02])
    a = speculative_generate(tiny_pair.target, fixed, PROMPT, max_new_tokens=16, config=config, verifier=verifier,
                             seed=3)
    b = speculative_generate(tiny_pair.target, fixed.spawn(), PROMPT, max_new_tokens=16, config=config,
                             verifier=verifier, seed=3)
    assert a.output_ids == b.output_ids
    with pytest.raises(ValueError, match="a chooser between drafters drafts deterministic top-k siblings"):
        fixed.draft(torch.tensor([1, 2, 3]), config, "iid", torch.Generator().manual_seed(0))


def test_registry_names_and_bad_parts(tiny_pair):
    default = build_drafter("choose", tiny_pair)
    assert default.name == "choose(ngram(n=3,k=4)|suffix(n=8,depth=8,budget=16)|chain(k=2))"
    named = build_drafter("choose-ngram-n2-k3+dynamic-w2-d2-b4", tiny_pair)
    assert [d.name for d in named.drafters] == ["ngram(n=2,k=3)", "dynamic(k=2,d=2,n=4)"]
    with pytest.raises(ValueError, match=r"choose strategy part 'switch': composite strategies do not nest"):
        build_drafter("choose-ngram+switch", tiny_pair)
    with pytest.raises(ValueError, match=r"fallback strategy part 'choose': composite strategies do not nest"):
        build_drafter("fallback-ngram+choose", tiny_pair)
    with pytest.raises(ValueError, match="at least two drafters, got 1"):
        ChooserDrafter([NgramDrafter()])
    with pytest.raises(ValueError, match=r"drafters\[1\] \(jacobi\(k=3\)\) guesses from the target's outputs"):
        ChooserDrafter([NgramDrafter(), JacobiDrafter(k=3)])
    with pytest.raises(ValueError, match="revisit must be an int >= 0, got -1"):
        ChooserDrafter([NgramDrafter(), SuffixDrafter()], revisit=-1)
    with pytest.raises(ValueError, match="cheap must be a positive number, got 0"):
        ChooserDrafter([NgramDrafter(), SuffixDrafter()], cheap=0)
    with pytest.raises(ValueError, match=r"draft_costs must give one drafting time >= 0 per part \(2\)"):
        ChooserDrafter([NgramDrafter(), SuffixDrafter()], draft_costs=[0.1])
    with pytest.raises(TypeError, match="costs must have a target_s"):
        ChooserDrafter([NgramDrafter(), SuffixDrafter()], costs=3)
