"""The fallback cascade: which part drafts each step, what the draft model is spared, and
that the output stays the target's."""

import pytest
import torch

import specviz.draft.base as draft_base
from specviz.decode.engine import plain_generate, speculative_generate
from specviz.draft import ChainDrafter, FallbackDrafter, NgramDrafter
from specviz.draft.lookahead import JacobiDrafter
from specviz.draft.registry import build_drafter, parse_strategy
from specviz.sampling import SamplingConfig

# repeats its own words, so lookup finds matches on some steps and not on others
PROMPT = "Repeat after me three times: the red fox jumps over the lazy dog, the red fox jumps."


def _count_draft_forwards(monkeypatch):
    fed = []
    original = draft_base.run_draft_forwards

    def counting(requests):
        fed.extend(len(r.tokens) for r in requests)
        return original(requests)

    monkeypatch.setattr(draft_base, "run_draft_forwards", counting)
    return fed


def test_lookup_drafts_where_it_matches_and_the_model_elsewhere(tiny_pair, monkeypatch):
    cascade = FallbackDrafter([NgramDrafter(n=3, k=3, min_n=2), ChainDrafter(tiny_pair.draft, 2)])
    fed = _count_draft_forwards(monkeypatch)
    result = speculative_generate(tiny_pair.target, cascade, PROMPT, max_new_tokens=40, stop_at_eos=False)
    reference = plain_generate(tiny_pair.target, PROMPT, max_new_tokens=40, stop_at_eos=False)
    assert result.output_ids == reference.output_ids

    sources = [int(s.tree.source[0]) for s in result.steps]
    assert set(sources) == {0, 1}  # both parts drafted some steps
    for step, part in zip(result.steps, sources):
        assert torch.all(step.tree.source == part)
        assert 1 < step.tree.n_nodes <= (3 if part == 1 else 4)  # the chain's 2 or lookup's 3 tokens, or fewer
    # the draft model ran on its own steps only: 2 forwards each (catch-up + one token)
    assert len(fed) == 2 * sources.count(1)
    # on the steps after lookup's, its catch-up fed everything committed since it last ran
    assert max(fed) > 2


def test_catch_up_after_lookup_steps_keeps_the_model_in_sync(tiny_pair):
    """Wherever the chain part drafts after lookup steps, its draft equals that of a fresh
    chain drafter given the same context: the catch-up forward brought its cache in sync."""
    reference = plain_generate(tiny_pair.target, PROMPT, max_new_tokens=40, stop_at_eos=False)
    context = torch.tensor(list(reference.prompt_ids) + list(reference.output_ids))
    start = len(reference.prompt_ids)
    cascade = FallbackDrafter([NgramDrafter(n=3, k=3, min_n=2), ChainDrafter(tiny_pair.draft, 2)])
    compared = 0
    for length in range(start, context.numel(), 3):  # jumps of 3 committed tokens, as accepted drafts give
        tree = cascade.draft(context[:length], SamplingConfig(), "greedy", None)
        if cascade.last_part == 1:
            fresh = ChainDrafter(tiny_pair.draft, 2).draft(context[:length], SamplingConfig(), "greedy", None)
            assert tree.tokens.tolist() == fresh.tokens.tolist()
            compared += 1
    assert compared >= 2


def test_silent_parts_give_a_root_only_tree(tiny_pair):
    cascade = FallbackDrafter([NgramDrafter(n=3, k=3, min_n=3), NgramDrafter(n=2, k=3, min_n=2)])
    tree = cascade.draft(torch.tensor([1, 2, 3, 4, 5]), SamplingConfig(), "greedy", None)
    assert tree.n_nodes == 1 and cascade.last_part is None
    tree = cascade.draft(torch.tensor([1, 2, 3, 4, 5, 6, 4, 5]), SamplingConfig(), "greedy", None)
    assert cascade.last_part == 1 and tree.tokens.tolist() == [5, 6, 4, 5] and tree.source.tolist() == [1] * 4
    tree = cascade.draft(torch.tensor([1, 2, 3, 4, 5, 6, 7, 2, 3, 4]), SamplingConfig(), "greedy", None)
    assert cascade.last_part == 0 and tree.tokens.tolist() == [4, 5, 6, 7]


def test_sampling_verifies_deterministic_drafts_with_the_topk_rule(tiny_pair):
    cascade = build_drafter("fallback-ngram-n2-k3-min2+chain-k2", tiny_pair)
    config = SamplingConfig(temperature=0.8)
    verifier = parse_strategy("fallback").verifier(0.8)
    assert verifier == "topk"
    a = speculative_generate(tiny_pair.target, cascade, PROMPT, max_new_tokens=16, config=config,
                             verifier=verifier, seed=7)
    b = speculative_generate(tiny_pair.target, cascade.spawn(), PROMPT, max_new_tokens=16, config=config,
                             verifier=verifier, seed=7)
    assert a.output_ids == b.output_ids
    for step in a.steps:
        assert step.tree.draft_probs is None  # every part drafted its most likely tokens
    with pytest.raises(ValueError, match="a fallback cascade drafts deterministic top-k siblings"):
        cascade.draft(torch.tensor([1, 2, 3]), config, "iid", torch.Generator().manual_seed(0))


def test_registry_names_and_bad_parts(tiny_pair):
    default = build_drafter("fallback", tiny_pair)
    assert default.name == "fallback(ngram(n=3,k=4,min=2)>chain(k=2))"
    assert parse_strategy("ngram-n3-k4-min2").arguments() == {"n": 3, "k": 4, "min_n": 2}
    named = build_drafter("fallback-ngram-n2-k3+dynamic-w2-d2-b4", tiny_pair)
    assert [d.name for d in named.drafters] == ["ngram(n=2,k=3)", "dynamic(k=2,d=2,n=4)"]
    with pytest.raises(ValueError, match=r"fallback strategy part 'beam': unknown strategy 'beam'"):
        build_drafter("fallback-ngram+beam", tiny_pair)
    with pytest.raises(ValueError, match=r"fallback strategy part 'merged': composite strategies do not nest"):
        build_drafter("fallback-ngram+merged", tiny_pair)
    with pytest.raises(ValueError, match="at least two drafters"):
        FallbackDrafter([NgramDrafter()])
    with pytest.raises(TypeError, match=r"drafters\[1\] must be a Drafter, got str"):
        FallbackDrafter([NgramDrafter(), "chain"])
    with pytest.raises(ValueError, match=r"drafters\[1\] \(jacobi\(k=3\)\) guesses from the target's outputs"):
        FallbackDrafter([NgramDrafter(), JacobiDrafter(k=3)])
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(n=2, min_n=3)
