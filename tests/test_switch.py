"""The switch between prompt lookup and a draft-model chain: which part each step's
worths pick, what the model part learns, and that the output stays the target's."""

import types

import pytest
import torch

from specviz.decode.engine import plain_generate, speculative_generate
from specviz.draft import AdaptiveNgramDrafter, ChainDrafter, NgramDrafter, SwitchDrafter
from specviz.draft.registry import build_drafter, parse_strategy
from specviz.sampling import SamplingConfig

PROMPT = "Repeat after me three times: the red fox jumps over the lazy dog, the red fox jumps."
GREEDY = SamplingConfig()
# verification costs t(1)..t(9) relative to a plain step: each more token costs a tenth
COSTS = [1.0 + 0.1 * i for i in range(9)]


def _switch(pair, **kwargs):
    kwargs.setdefault("patience", 0)  # the model may draft from the first step
    return SwitchDrafter([AdaptiveNgramDrafter(n=3, k_max=8, costs=COSTS), ChainDrafter(pair.draft, 2)], **kwargs)


def _step(tree, accepted, draft_s=0.0, verify_s=0.1, bonus=0):
    """The fields of a StepTrace the switch and its parts read: ``accepted`` draft tokens
    of the chain ``tree`` accepted, then ``bonus``."""
    accepted_tokens = tuple(tree.tokens[1:1 + accepted].tolist())
    acceptance = types.SimpleNamespace(n_accepted=accepted, accepted_tokens=accepted_tokens, bonus_token=bonus)
    return types.SimpleNamespace(step=1, tree=tree, acceptance=acceptance, draft_time_s=draft_s,
                                 verify_time_s=verify_s)


def test_output_is_the_targets_and_both_parts_draft(tiny_pair):
    switch = _switch(tiny_pair)
    result = speculative_generate(tiny_pair.target, switch, PROMPT, max_new_tokens=40, stop_at_eos=False)
    reference = plain_generate(tiny_pair.target, PROMPT, max_new_tokens=40, stop_at_eos=False)
    assert result.output_ids == reference.output_ids
    assert len(switch.history) == len(result.steps)
    model_steps = 0
    for step, (part, lookup_worth, model_worth) in zip(result.steps, switch.history):
        source = step.tree.source.tolist()
        assert source == [1 if part == "model" else 0] * step.tree.n_nodes
        if model_steps >= switch.explore:  # past exploration, the worths decide
            assert (part == "model") == (model_worth > max(lookup_worth, 1.0))
        model_steps += part == "model"
        assert part == "lookup" or step.tree.n_nodes <= 3
    assert {part for part, _, _ in switch.history} == {"lookup", "model"}


def test_worths_pick_the_part(tiny_pair):
    switch = _switch(tiny_pair)
    # prior acceptance 3/4: E = 1 + 0.75 + 0.5625, C = C(3) + 2 * 0.5 = 2.2
    assert switch.model_worth() == pytest.approx(2.3125 / 2.2)
    # a first forward that catches up on 6 tokens costs C(6) = 1.5 one-token forwards: C = 1.2 + 2.5 * 0.5
    assert switch.model_worth(catch_up=6) == pytest.approx(2.3125 / 2.45)
    assert switch.model_worth(catch_up=12) == pytest.approx(2.3125 / (1.2 + (2.1 + 1) * 0.5))  # past the curve
    # no match: lookup's worth is a plain step's, the model's is higher
    tree = switch.draft(torch.tensor([1, 2, 3, 4, 5]), GREEDY, "greedy", None)
    assert switch.history[-1][0] == "model" and switch.last_part == 1 and tree.n_nodes == 3
    assert switch.lookup.history[-1] == (0, 0)
    # a 3-token match the lookup already saw accepted in full: its chain is worth more than the model's
    lookup = switch.lookup
    lookup._accepted[3] += 50
    lookup._tried[3] += 50
    context = torch.tensor([7, 8, 9, 10, 11, 12, 13, 14, 7, 8, 9])
    tree = switch.draft(context, GREEDY, "greedy", None)
    assert switch.history[-1][0] == "lookup" and switch.last_part == 0
    assert tree.tokens.tolist()[:4] == [9, 10, 11, 12] and tree.source.tolist() == [0] * tree.n_nodes
    assert switch.history[-1][1] == pytest.approx(lookup.last_worth) and lookup.last_worth > switch.model_worth()


def test_the_model_part_learns_its_acceptance_and_cost(tiny_pair):
    # a strong prior (acceptance 0.9), so that a few rejections are needed to give the model up
    switch = _switch(tiny_pair, prior_accepted=9.0, prior_rejected=1.0)
    context = torch.tensor([1, 2, 3, 4, 5])
    worths = [switch.model_worth()]
    for i in range(5):
        tree = switch.draft(context, GREEDY, "greedy", None)
        assert switch.last_part == 1 and tree.n_nodes == 3
        # rejected at once; the first step's draft time (with the prompt's prefill) is not a drafting cost
        switch.observe(_step(tree, 0, draft_s=5.0 if i == 0 else 0.1, verify_s=0.1 * COSTS[2]))
        worths.append(switch.model_worth())
    assert switch._tried[1] == 10 + 5 and switch._accepted[1] == 9 and switch._tried[2] == 10  # 2 never reached
    assert switch.draft_ratio() == pytest.approx(0.5)  # 0.1 s per 2 forwards over a 0.1 s plain step
    assert worths == sorted(worths, reverse=True) and worths[-1] < 1.0 < worths[0]
    # now worth less than a plain step: no proposal at all without a lookup match
    tree = switch.draft(context, GREEDY, "greedy", None)
    assert tree.n_nodes == 1 and switch.last_part is None and switch.history[-1][0] == "lookup"
    switch.reset()
    assert switch.model_worth() == pytest.approx(worths[0]) and switch.history == []


def test_the_model_is_tried_before_its_worth_decides(tiny_pair):
    context = torch.tensor([1, 2, 3, 4, 5])  # no lookup match
    # prior acceptance 1/2: worth (1 + 0.5 + 0.25) / 2.2 < 1, less than a plain step
    for explore in (0, 2):
        switch = _switch(tiny_pair, prior_accepted=1.0, prior_rejected=1.0, explore=explore)
        assert switch.model_worth() < 1.0
        parts = []
        for _ in range(4):
            tree = switch.draft(context, GREEDY, "greedy", None)
            parts.append(switch.last_part)
            switch.observe(_step(tree, 0))
        assert parts == [1] * explore + [None] * (4 - explore)
    with pytest.raises(ValueError, match="explore must be an int >= 0, got -1"):
        _switch(tiny_pair, explore=-1)


def test_the_model_waits_until_the_lookup_has_been_silent(tiny_pair):
    switch = _switch(tiny_pair, patience=2)
    repeating = torch.tensor([7, 8, 9, 10, 11, 7, 8, 9])  # a lookup match: its chain drafts
    silent = torch.tensor([1, 2, 3, 4, 5])  # no match
    parts = []
    for context in (repeating, silent, repeating, silent, silent):
        tree = switch.draft(context, GREEDY, "greedy", None)
        parts.append(switch.history[-1][0])
        switch.observe(_step(tree, 0))
    # the model's prior worth beats a plain step's, but it is asked only after two silent lookups
    assert parts == ["lookup", "lookup", "lookup", "lookup", "model"]
    switch.reset()
    assert switch._silent == 0
    with pytest.raises(ValueError, match="patience must be an int >= 0, got 1.5"):
        _switch(tiny_pair, patience=1.5)


def test_sampling_is_deterministic_and_iid_refused(tiny_pair):
    # fixed costs: measured times would steer the choices, and so the random draws
    switch = _switch(tiny_pair, draft_cost=0.5)
    config = SamplingConfig(temperature=0.8)
    verifier = parse_strategy("switch").verifier(0.8)
    assert verifier == "topk"
    a = speculative_generate(tiny_pair.target, switch, PROMPT, max_new_tokens=16, config=config, verifier=verifier,
                             seed=3)
    b = speculative_generate(tiny_pair.target, switch.spawn(), PROMPT, max_new_tokens=16, config=config,
                             verifier=verifier, seed=3)
    assert a.output_ids == b.output_ids
    with pytest.raises(ValueError, match="a switch between drafters drafts deterministic top-k siblings"):
        switch.draft(torch.tensor([1, 2, 3]), config, "iid", torch.Generator().manual_seed(0))


def test_registry_names_and_bad_parts(tiny_pair):
    assert build_drafter("switch", tiny_pair).name == "switch(ngram-adaptive(n=3,k<=8)|chain(k=2))"
    named = build_drafter("switch-ngram-adaptive-n4-k6+chain-k3", tiny_pair)
    assert named.name == "switch(ngram-adaptive(n=4,k<=6)|chain(k=3))" and named.model.k == 3
    with pytest.raises(ValueError, match=r"switch strategy parts 'ngram-n3-k3\+chain-k2': SwitchDrafter's first "
                                         r"part must be an AdaptiveNgramDrafter"):
        build_drafter("switch-ngram-n3-k3+chain-k2", tiny_pair)
    with pytest.raises(ValueError, match="second part must be a ChainDrafter"):
        build_drafter("switch-ngram-adaptive+dynamic", tiny_pair)
    with pytest.raises(ValueError, match=r"switch strategy part 'fallback': composite strategies do not nest"):
        build_drafter("switch-ngram-adaptive+fallback", tiny_pair)
    with pytest.raises(ValueError, match=r"fallback strategy part 'switch': composite strategies do not nest"):
        build_drafter("fallback-ngram+switch", tiny_pair)
    with pytest.raises(ValueError, match=r"needs two parts, \[lookup, model\], got 3"):
        SwitchDrafter([AdaptiveNgramDrafter(), ChainDrafter(tiny_pair.draft, 2), NgramDrafter()])
    with pytest.raises(ValueError, match="draft_cost must be a positive number, got 0"):
        SwitchDrafter([AdaptiveNgramDrafter(), ChainDrafter(tiny_pair.draft, 2)], draft_cost=0)
