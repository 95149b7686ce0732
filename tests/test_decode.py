"""The speculative decoding engine (specviz.decode, specviz.models.kvcache) on the tiny random pair:
greedy identity with the target for every drafter, the KV cache after acceptance, batches,
replay, the distribution test for every lossless verifier, stopping and errors."""

import copy

import pytest
import torch

from specviz.decode.engine import (
    encode_prompt,
    eos_token_ids,
    plain_generate,
    speculative_generate,
    speculative_generate_batch,
)
from specviz.decode.records import GenerationResult
from specviz.decode.replay import replay_acceptance
from specviz.draft import (
    AdaptiveChainDrafter,
    ChainDrafter,
    ChooserDrafter,
    Drafter,
    DynamicTreeDrafter,
    FallbackDrafter,
    MergedDrafter,
    SelfSpeculativeDrafter,
    TreeDrafter,
)
from specviz.models.kvcache import cache_length, compact_cache, forward_tokens, new_cache
from specviz.models.tiny import tiny_model, tiny_tokenizer
from specviz.models.types import LoadedModel, TokenizerMismatchError
from specviz.draft.ngram import AdaptiveNgramDrafter, NgramDrafter, NgramTrieDrafter
from specviz.draft.suffix import SuffixDrafter
from specviz.sampling import SamplingConfig, probs_from_logits
from specviz.tree.shapes import expansion, from_paths, kary
from specviz.tree.core import DraftTree, pad_trees, tree_attention_mask

PROMPTS = (
    "def fizzbuzz(n):",  # code
    "What is 17 * 23? Think step by step.",  # maths
    "Translate to French: the cat sleeps on the warm window sill.",  # translation
)

DRAFTERS = {
    "chain1": lambda p: ChainDrafter(p.draft, 1),
    "chain4": lambda p: ChainDrafter(p.draft, 4),
    "kary2x3": lambda p: TreeDrafter(p.draft, kary(2, 3)),
    "expansion321": lambda p: TreeDrafter(p.draft, expansion([3, 2, 1])),
    "paths": lambda p: TreeDrafter(p.draft, from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)])),
    "dynamic": lambda p: DynamicTreeDrafter(p.draft, topk=3, depth=4, budget=10),
    "adaptive_heuristic": lambda p: AdaptiveChainDrafter(p.draft, "heuristic"),
    "adaptive_throughput": lambda p: AdaptiveChainDrafter(p.draft, "throughput", cost_ratio=0.2),
    "self": lambda p: SelfSpeculativeDrafter(p.target, 1, kary(2, 2)),
    "ngram": lambda p: NgramDrafter(n=2, k=4),
    "ngram_trie": lambda p: NgramTrieDrafter(n=2, depth=4, budget=8),
    "merged": lambda p: MergedDrafter([ChainDrafter(p.draft, 3), NgramDrafter(n=2, k=3)]),
    "merged_budget": lambda p: MergedDrafter([NgramDrafter(n=2, k=3), DynamicTreeDrafter(p.draft, topk=3, depth=4,
                                                                                          budget=10)], budget=6),
    "fallback": lambda p: FallbackDrafter([NgramDrafter(n=2, k=3, min_n=2), ChainDrafter(p.draft, 2)]),
    # the global tree carries earlier prompts' outputs into later runs: lossless either way
    "suffix": lambda p: SuffixDrafter(n=4, depth=4, budget=8),
    "suffix_request": lambda p: SuffixDrafter(n=4, depth=4, budget=8, max_sequences=0),
    # fixed costs: a replay (which times nothing) drafts as the live run does
    "ngram_adaptive": lambda p: AdaptiveNgramDrafter(n=2, k_max=4, costs=[1.0, 1.2, 1.4, 1.9, 2.3]),
}


@pytest.fixture(scope="module")
def references(tiny_pair):
    return {p: plain_generate(tiny_pair.target, p, max_new_tokens=32) for p in PROMPTS}


class _Fixed(Drafter):
    """Test drafter returning a given tree (or a root-only one, or None)."""

    name = "fixed"

    def __init__(self, make):
        self.make = make

    def draft(self, context, config, sibling_sampling, generator):
        return self.make(context.tolist())


# -- greedy identity ----------------------------------------------------------------------------

def test_engine_options_are_one_object_with_keyword_changes(tiny_pair):
    from specviz.decode.engine import EngineOptions

    options = EngineOptions(max_new_tokens=8, stop_at_eos=False, analyze=False)
    drafter = ChainDrafter(tiny_pair.draft, 2)
    a = speculative_generate(tiny_pair.target, drafter, PROMPTS[0], options)
    b = speculative_generate(tiny_pair.target, drafter, PROMPTS[0], max_new_tokens=8, stop_at_eos=False, analyze=False)
    assert a.output_ids == b.output_ids and len(a.output_ids) == 8
    c = speculative_generate(tiny_pair.target, drafter, PROMPTS[0], options, max_new_tokens=4)
    assert c.output_ids == a.output_ids[:4] and options.max_new_tokens == 8
    with pytest.raises(TypeError, match="unknown engine option.*max_tokens.*max_new_tokens"):
        speculative_generate(tiny_pair.target, drafter, PROMPTS[0], max_tokens=4)
    with pytest.raises(TypeError, match="options must be an EngineOptions"):
        speculative_generate(tiny_pair.target, drafter, PROMPTS[0], {"max_new_tokens": 4})
    with pytest.raises(ValueError, match="max_new_tokens"):
        EngineOptions(max_new_tokens=0)


def test_the_drafter_protocol_is_three_methods_and_observe_gets_what_a_drafter_reads(tiny_pair):
    from specviz.draft.base import TargetOutputs

    assert {n for n, v in vars(Drafter).items() if callable(v) and not n.startswith("_")} == {
        "draft", "observe", "reset"}

    class Recording(_Fixed):
        def __init__(self, reads):
            super().__init__(lambda ctx: DraftTree.from_lists([ctx[-1], 5], [-1, 0]))
            self.reads, self.seen = frozenset(reads), []

        def observe(self, step, outputs=None):
            self.seen.append((step, outputs))

    hidden_size = tiny_pair.target.model.config.hidden_size
    for reads in ((), ("hidden",)):
        d = Recording(reads)
        result = speculative_generate(tiny_pair.target, d, [3, 4, 5, 6], max_new_tokens=6, stop_at_eos=False)
        steps = d.seen[1:] if reads else d.seen
        assert [s for s, _ in steps] == list(result.steps)
        assert all(isinstance(o, TargetOutputs) and o.logits.shape == (s.tree.n_nodes, tiny_pair.target.vocab_size)
                   and o.side_logits is None for s, o in steps)
        assert all((o.hidden is not None) == bool(reads) for _, o in steps)
        if reads:  # the prefill's hidden states first, at the committed tokens but the last
            step, outputs = d.seen[0]
            assert step is None and outputs.logits is None and tuple(outputs.hidden.shape) == (3, hidden_size)
        else:
            assert len(d.seen) == len(result.steps)
    with pytest.raises(ValueError, match="reads \\['hiden'\\]"):
        speculative_generate(tiny_pair.target, Recording(["hiden"]), [3, 4, 5, 6], max_new_tokens=2)


def test_plain_generate_matches_transformers_generate(tiny_pair):
    target = tiny_pair.target
    ids = encode_prompt(target.tokenizer, PROMPTS[0])
    ours = plain_generate(target, PROMPTS[0], max_new_tokens=24, stop_at_eos=False)
    with torch.no_grad():
        theirs = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       do_sample=False, max_new_tokens=24, min_new_tokens=24,
                                       pad_token_id=target.tokenizer.pad_token_id)
    assert ours.prompt_ids == tuple(ids)
    assert list(ours.output_ids) == theirs[0, len(ids):].tolist()


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_output_is_identical_to_the_target(tiny_pair, references, name):
    drafter = DRAFTERS[name](tiny_pair)
    for prompt in PROMPTS:
        result = speculative_generate(tiny_pair.target, drafter, prompt, max_new_tokens=32)
        ref = references[prompt]
        assert result.output_ids == ref.output_ids, (name, prompt)
        assert result.stop_reason == ref.stop_reason
        assert sum(s.acceptance.tau for s in result.steps) >= len(result.output_ids)
        for step in result.steps:
            # greedy is deterministic: the exact expectation is the realised value
            assert step.expected_accepted == pytest.approx(step.acceptance.n_accepted)
            assert float(step.target_token_probs[0]) == 1.0
            assert step.tree.draft_probs is None


def test_drafts_are_actually_accepted(tiny_pair):
    result = speculative_generate(tiny_pair.target, ChainDrafter(tiny_pair.draft, 4), PROMPTS[0], max_new_tokens=32)
    assert result.n_steps < 32
    assert sum(s.acceptance.n_accepted for s in result.steps) > 0


# -- the KV cache after acceptance --------------------------------------------------------------

def test_cache_keeps_prefix_plus_accepted_path_per_row(tiny_pair):
    """Two rows with different prefixes verify different trees in one call; after compaction
    to their accepted paths, the next token's logits equal a fresh forward of the sequence."""
    model = tiny_pair.target.model
    prefixes = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    trees = [DraftTree.from_lists([10, 20, 21, 22, 23], [-1, 0, 0, 2, 2]),
             DraftTree.from_lists([13, 30, 31, 32], [-1, 0, 1, 0])]
    paths = [[2, 4], [3]]  # accepted nodes per row (non-contiguous: needs moving)
    cache = new_cache(model)
    lens = [len(p) - 1 for p in prefixes]
    ids = torch.zeros(2, max(lens), dtype=torch.long)
    for r, p in enumerate(prefixes):
        ids[r, :lens[r]] = torch.tensor(p[:-1])
    allowed = torch.zeros(2, max(lens), max(lens), dtype=torch.bool)
    for r in range(2):
        allowed[r] = torch.ones(max(lens), max(lens), dtype=torch.bool).tril()
        allowed[r, :, lens[r]:] = False
        allowed[r].fill_diagonal_(True)
    forward_tokens(model, cache, ids, torch.arange(max(lens)).expand(2, -1), allowed)
    batch = pad_trees(trees, lens)
    logits = forward_tokens(model, cache, batch.tokens, batch.position_ids, batch.mask)
    pmax = max(lens)
    for r in range(2):
        seq = prefixes[r][:-1] + [int(trees[r].tokens[i]) for i in [0] + paths[r]]
        fresh = model(torch.tensor([seq])).logits[0, -1]
        torch.testing.assert_close(logits[r, paths[r][-1]], fresh, atol=1e-5, rtol=1e-5)
    src = [[pmax] + [pmax + n for n in path] for path in paths]
    new_lens = [lens[r] + len(src[r]) for r in range(2)]
    compact_cache(cache, lens, src, max(new_lens))
    assert cache_length(cache) == max(new_lens)
    bonus = [40, 41]
    allowed = torch.zeros(2, 1, max(new_lens) + 1, dtype=torch.bool)
    for r in range(2):
        allowed[r, 0, :new_lens[r]] = True
        allowed[r, 0, -1] = True
    out = forward_tokens(model, cache, torch.tensor([[40], [41]]), torch.tensor([[new_lens[0]], [new_lens[1]]]),
                         allowed)
    for r in range(2):
        seq = prefixes[r][:-1] + [int(trees[r].tokens[i]) for i in [0] + paths[r]] + [bonus[r]]
        fresh = model(torch.tensor([seq])).logits[0, -1]
        torch.testing.assert_close(out[r, 0], fresh, atol=1e-5, rtol=1e-5)


def test_tree_mask_forward_matches_the_mask_helper(tiny_pair):
    """The bool mask the engine passes is the tree module's mask (prefix + ancestors)."""
    tree = DraftTree.from_lists([9, 1, 2, 3], [-1, 0, 0, 1])
    batch = pad_trees([tree], [4])
    assert torch.equal(batch.mask[0], tree_attention_mask(tree, 4))


# -- batches ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["chain4", "kary2x3", "dynamic", "ngram_trie", "adaptive_heuristic", "fallback",
                                  "suffix_request"])
def test_batch_rows_equal_single_runs_greedy(tiny_pair, name):
    prompts = list(PROMPTS) + [[65]]  # different lengths, including a one-token prompt
    drafter = DRAFTERS[name](tiny_pair)
    batch = speculative_generate_batch(tiny_pair.target, drafter, prompts, max_new_tokens=24)
    for prompt, row in zip(prompts, batch):
        alone = speculative_generate(tiny_pair.target, drafter, prompt, max_new_tokens=24)
        assert row.output_ids == alone.output_ids
        assert [s.acceptance.accepted_nodes for s in row.steps] == [s.acceptance.accepted_nodes for s in alone.steps]
    assert len({r.n_steps for r in batch}) > 1  # rows really accepted differently


@pytest.mark.parametrize("verifier", ["chain", "specinfer", "sequoia", "topk"])
def test_batch_rows_equal_single_runs_sampling(tiny_pair, verifier):
    config = SamplingConfig(temperature=0.8, top_p=0.95)
    drafter = ChainDrafter(tiny_pair.draft, 3) if verifier == "chain" else TreeDrafter(tiny_pair.draft, kary(2, 2))
    seeds = [3, 4, 5]
    batch = speculative_generate_batch(tiny_pair.target, drafter, list(PROMPTS), max_new_tokens=16, config=config,
                                       verifier=verifier, seed=seeds)
    for prompt, seed, row in zip(PROMPTS, seeds, batch):
        alone = speculative_generate(tiny_pair.target, drafter, prompt, max_new_tokens=16, config=config,
                                     verifier=verifier, seed=seed)
        assert row.output_ids == alone.output_ids


# -- replay -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["chain4", "kary2x3", "paths", "dynamic", "adaptive_heuristic",
                                  "adaptive_throughput", "ngram", "ngram_trie", "merged", "merged_budget", "fallback",
                                  "ngram_adaptive", "suffix"])
def test_replay_gives_the_live_per_step_acceptance(tiny_pair, name):
    target = tiny_pair.target
    for prompt in PROMPTS[:2]:
        reference = plain_generate(target, prompt, max_new_tokens=32, stop_at_eos=False)
        live = speculative_generate(target, DRAFTERS[name](tiny_pair), prompt, max_new_tokens=32)
        replay = replay_acceptance(target, DRAFTERS[name](tiny_pair), reference)
        assert replay.output_ids == live.output_ids
        assert len(replay.steps) == len(live.steps)
        for a, b in zip(live.steps, replay.steps):
            assert torch.equal(a.tree.tokens, b.tree.tokens) and torch.equal(a.tree.parents, b.tree.parents)
            assert a.acceptance.accepted_nodes == b.acceptance.accepted_nodes
            assert a.acceptance.bonus_token == b.acceptance.bonus_token
            assert torch.equal(a.acceptance.tried, b.acceptance.tried)
        assert all(s.verify_time_s == 0.0 for s in replay.steps)


def test_replay_needs_a_long_enough_greedy_reference(tiny_pair):
    target = tiny_pair.target
    short = plain_generate(target, PROMPTS[0], max_new_tokens=8)
    with pytest.raises(ValueError, match="needs token"):
        replay_acceptance(target, ChainDrafter(tiny_pair.draft, 4), short, max_new_tokens=16)
    sampled = plain_generate(target, PROMPTS[0], max_new_tokens=4, config=SamplingConfig(temperature=1.0))
    with pytest.raises(ValueError, match="greedy reference"):
        replay_acceptance(target, ChainDrafter(tiny_pair.draft, 4), sampled)


# -- sampling: the output distribution is the target's -------------------------------------------

def _exact_sequence_probs(target: LoadedModel, prompt: list[int], config: SamplingConfig, length: int,
                          eos: tuple[int, ...]) -> dict[tuple[int, ...], float]:
    """Probability of every continuation of ``length`` tokens (shorter if it ends in EOS)
    under plain sampling from the target."""
    out: dict[tuple[int, ...], float] = {}
    frontier = [((), 1.0)]
    with torch.no_grad():
        while frontier:
            seq, prob = frontier.pop()
            if len(seq) == length or (seq and seq[-1] in eos):
                out[seq] = out.get(seq, 0.0) + prob
                continue
            logits = target.model(torch.tensor([prompt + list(seq)])).logits[0, -1]
            p = probs_from_logits(logits, config).double()
            for tok in torch.nonzero(p > 0).flatten().tolist():
                frontier.append((seq + (tok,), prob * float(p[tok])))
    return out


def _chi_square_p_value(counts: dict, probs: dict, n: int) -> float:
    """Pearson's goodness-of-fit test, cells with expected count < 5 pooled."""
    observed, expected = [], []
    pooled_o, pooled_e = 0.0, 0.0
    for cell, p in probs.items():
        if n * p < 5:
            pooled_o += counts.get(cell, 0)
            pooled_e += n * p
        else:
            observed.append(counts.get(cell, 0))
            expected.append(n * p)
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    assert sum(counts.get(c, 0) for c in counts if c not in probs) == 0, "a sequence the target cannot produce"
    o = torch.tensor(observed, dtype=torch.float64)
    e = torch.tensor(expected, dtype=torch.float64)
    stat = float(((o - e) ** 2 / e).sum())
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize("verifier", ["chain", "specinfer", "sequoia", "topk"])
def test_lossless_verifiers_reproduce_the_target_distribution(tiny_pair, verifier):
    target = tiny_pair.target
    config = SamplingConfig(temperature=1.0, top_k=3)
    prompt = [72, 101, 108, 108, 111]
    length, n = 3, 600
    drafter = {
        "chain": ChainDrafter(tiny_pair.draft, 2),
        "specinfer": TreeDrafter(tiny_pair.draft, kary(2, 2)),
        "sequoia": TreeDrafter(tiny_pair.draft, kary(2, 2)),
        "topk": DynamicTreeDrafter(tiny_pair.draft, topk=2, depth=2, budget=4),
    }[verifier]
    exact = _exact_sequence_probs(target, prompt, config, length, eos_token_ids(target))
    runs = speculative_generate_batch(target, drafter, [prompt] * n, max_new_tokens=length, config=config,
                                      verifier=verifier, seed=list(range(n)), chat=False, analyze=False)
    counts: dict[tuple[int, ...], int] = {}
    for r in runs:
        counts[r.output_ids] = counts.get(r.output_ids, 0) + 1
    accepted = sum(s.acceptance.n_accepted for r in runs for s in r.steps)
    drafted = sum(s.tree.budget for r in runs for s in r.steps)
    assert 0 < accepted < drafted  # both acceptances and rejections happened
    assert _chi_square_p_value(counts, exact, n) > 1e-3


def test_suffix_decoding_under_sampling_reproduces_the_target_distribution(tiny_pair):
    target = tiny_pair.target
    config = SamplingConfig(temperature=1.0, top_k=3)
    start = [72, 101, 108]
    greedy = list(plain_generate(target, start, max_new_tokens=3, stop_at_eos=False, chat=False).output_ids)
    prompt = start + greedy + start  # the request tree proposes the target's own greedy continuation again
    length, n = 3, 600
    exact = _exact_sequence_probs(target, prompt, config, length, eos_token_ids(target))
    runs = speculative_generate_batch(target, SuffixDrafter(n=3, depth=3, budget=4, max_sequences=0), [prompt] * n,
                                      max_new_tokens=length, config=config, verifier="topk", seed=list(range(n)),
                                      chat=False, analyze=False)
    counts: dict[tuple[int, ...], int] = {}
    for r in runs:
        counts[r.output_ids] = counts.get(r.output_ids, 0) + 1
    accepted = sum(s.acceptance.n_accepted for r in runs for s in r.steps)
    drafted = sum(s.tree.budget for r in runs for s in r.steps)
    assert 0 < accepted < drafted
    assert _chi_square_p_value(counts, exact, n) > 1e-3


def test_the_chooser_under_sampling_reproduces_the_target_distribution(tiny_pair):
    target = tiny_pair.target
    config = SamplingConfig(temperature=1.0, top_k=3)
    start = [72, 101, 108]
    greedy = list(plain_generate(target, start, max_new_tokens=3, stop_at_eos=False, chat=False).output_ids)
    prompt = start + greedy + start  # suffix trees propose the greedy continuation again, the chain anything
    length, n = 3, 600
    chooser = ChooserDrafter([SuffixDrafter(n=3, depth=3, budget=4, max_sequences=0),
                              ChainDrafter(tiny_pair.draft, 2)], explore=1, revisit=1, patience=0)
    exact = _exact_sequence_probs(target, prompt, config, length, eos_token_ids(target))
    runs = speculative_generate_batch(target, chooser, [prompt] * n, max_new_tokens=length, config=config,
                                      verifier="topk", seed=list(range(n)), chat=False, analyze=False)
    counts: dict[tuple[int, ...], int] = {}
    for r in runs:
        counts[r.output_ids] = counts.get(r.output_ids, 0) + 1
    sources = {int(s.tree.source[0]) for r in runs for s in r.steps if s.tree.n_nodes > 1}
    assert sources == {0, 1}  # both parts drafted
    accepted = sum(s.acceptance.n_accepted for r in runs for s in r.steps)
    drafted = sum(s.tree.budget for r in runs for s in r.steps)
    assert 0 < accepted < drafted
    assert _chi_square_p_value(counts, exact, n) > 1e-3


def test_the_distribution_test_catches_a_lossy_rule(tiny_pair):
    """Same test, lossy "accept if p >= 0.5 q" rule: the skew towards the draft is detected."""
    target = tiny_pair.target
    config = SamplingConfig(temperature=1.0, top_k=3)
    prompt = [72, 101, 108, 108, 111]
    exact = _exact_sequence_probs(target, prompt, config, 3, eos_token_ids(target))
    runs = speculative_generate_batch(target, ChainDrafter(tiny_pair.draft, 2), [prompt] * 600, max_new_tokens=3,
                                      config=config, verifier="naive_half", seed=list(range(600)), chat=False,
                                      analyze=False)
    counts: dict[tuple[int, ...], int] = {}
    for r in runs:
        counts[r.output_ids] = counts.get(r.output_ids, 0) + 1
    assert _chi_square_p_value(counts, exact, 600) < 1e-6


def test_expected_acceptance_is_exact_under_sampling(tiny_pair):
    """The per-step expectation agrees with the realised mean over many seeds."""
    config = SamplingConfig(temperature=1.0, top_k=4)
    prompt = [72, 101, 108, 108, 111]
    n = 300
    runs = speculative_generate_batch(tiny_pair.target, TreeDrafter(tiny_pair.draft, kary(2, 2)), [prompt] * n,
                                      max_new_tokens=3, config=config, verifier="specinfer", seed=list(range(n)),
                                      chat=False)
    first = [r.steps[0] for r in runs]
    realised = sum(s.acceptance.n_accepted for s in first) / n
    expected = sum(s.expected_accepted for s in first) / n
    spread = torch.tensor([float(s.acceptance.n_accepted) for s in first]).std().item()
    assert abs(realised - expected) < 4 * spread / n ** 0.5 + 1e-9


# -- stopping -----------------------------------------------------------------------------------

def test_stops_at_eos_like_the_target():
    target = tiny_model(seed=3)
    reference = plain_generate(target, PROMPTS[1], max_new_tokens=20, stop_at_eos=False)
    eos = reference.output_ids[6]
    target.model.generation_config.eos_token_id = eos
    plain = plain_generate(target, PROMPTS[1], max_new_tokens=20)
    draft = LoadedModel("noisy", copy.deepcopy(target.model), target.tokenizer, target.dtype)
    spec = speculative_generate(target, ChainDrafter(draft, 4), PROMPTS[1], max_new_tokens=20)
    assert plain.stop_reason == spec.stop_reason == "eos"
    assert spec.output_ids == plain.output_ids and spec.output_ids[-1] == eos
    assert len(spec.output_ids) == reference.output_ids.index(eos) + 1
    # told to ignore end-of-sequence tokens, it goes on to the budget like the target
    full = speculative_generate(target, ChainDrafter(draft, 4), PROMPTS[1], max_new_tokens=20, stop_at_eos=False)
    assert full.output_ids == reference.output_ids and full.stop_reason == "max_new_tokens"


def test_stops_at_the_context_limit():
    target = tiny_model(seed=0, max_context=40)
    draft = LoadedModel("copy", copy.deepcopy(target.model), target.tokenizer, target.dtype)
    prompt = list(range(60, 90))
    plain = plain_generate(target, prompt, max_new_tokens=50, stop_at_eos=False)
    spec = speculative_generate(target, TreeDrafter(draft, kary(2, 3)), prompt, max_new_tokens=50, chat=False)
    assert spec.stop_reason == "context_limit" and len(prompt) + len(spec.output_ids) == 40
    assert spec.output_ids == plain.output_ids[:len(spec.output_ids)]


def test_budget_is_exact_and_trees_are_trimmed_to_it(tiny_pair):
    result = speculative_generate(tiny_pair.target, TreeDrafter(tiny_pair.draft, kary(2, 4)), PROMPTS[0],
                                  max_new_tokens=5)
    assert len(result.output_ids) == 5 and result.stop_reason == "max_new_tokens"
    assert result.steps[0].tree.depth <= 4


# -- errors and fallbacks -----------------------------------------------------------------------

def test_tokenizer_mismatch_is_refused(tiny_pair):
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    other = tiny_model(seed=1, tokenizer=tok)
    with pytest.raises(TokenizerMismatchError, match="vocabulary differs"):
        speculative_generate(tiny_pair.target, ChainDrafter(other, 2), PROMPTS[0], max_new_tokens=4)


@pytest.mark.parametrize("prompt", ["", "   ", [], torch.tensor([], dtype=torch.long)])
def test_empty_prompt_is_refused(tiny_pair, prompt):
    with pytest.raises(ValueError, match="prompt is empty"):
        speculative_generate(tiny_pair.target, NgramDrafter(), prompt, max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt is empty"):
        plain_generate(tiny_pair.target, prompt, max_new_tokens=4)


def test_prompt_past_the_context_is_refused(tiny_pair):
    too_long = [70] * tiny_pair.target.max_context
    with pytest.raises(ValueError, match="1024 tokens but .* handles at most 1024"):
        speculative_generate(tiny_pair.target, NgramDrafter(), too_long, max_new_tokens=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        speculative_generate(tiny_pair.target, NgramDrafter(), [10_000], max_new_tokens=4)


def test_bad_arguments_are_refused(tiny_pair):
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(tiny_pair.target, NgramDrafter(), "hi", max_new_tokens=0)
    with pytest.raises(ValueError, match="unknown verifier"):
        speculative_generate(tiny_pair.target, NgramDrafter(), "hi", verifier="maybe")
    with pytest.raises(TypeError, match="Drafter"):
        speculative_generate(tiny_pair.target, "chain", "hi")
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        speculative_generate_batch(tiny_pair.target, NgramDrafter(), list(PROMPTS), seed=[1, 2])


def test_tree_with_the_wrong_root_is_refused(tiny_pair):
    wrong = _Fixed(lambda ctx: DraftTree.from_lists([ctx[-1] + 1, 5], [-1, 0]))
    with pytest.raises(ValueError, match="root must be the last committed token"):
        speculative_generate(tiny_pair.target, wrong, PROMPTS[0], max_new_tokens=4)


@pytest.mark.parametrize("make", [lambda ctx: DraftTree.from_lists([ctx[-1]], [-1]), lambda ctx: None],
                         ids=["root-only", "none"])
def test_drafter_with_no_proposal_falls_back_to_plain_steps(tiny_pair, references, make):
    result = speculative_generate(tiny_pair.target, _Fixed(make), PROMPTS[0], max_new_tokens=32)
    assert result.output_ids == references[PROMPTS[0]].output_ids
    assert result.n_steps == len(result.output_ids)


# -- traces and prompts -------------------------------------------------------------------------

def test_traces_record_probabilities_and_times(tiny_pair):
    config = SamplingConfig(temperature=1.0)
    result = speculative_generate(tiny_pair.target, TreeDrafter(tiny_pair.draft, kary(2, 2)), PROMPTS[2],
                                  max_new_tokens=12, config=config, verifier="specinfer", keep_draft_probs=True)
    assert isinstance(result, GenerationResult) and result.verifier == "specinfer"
    for i, step in enumerate(result.steps):
        assert step.step == i and step.drafter == "tree(n=6,d=2)"
        assert step.draft_time_s > 0 and step.verify_time_s > 0
        assert 0.0 <= step.expected_accepted <= step.tree.depth
        assert step.tree.draft_probs is not None and step.tree.q is not None
        assert bool(((step.target_token_probs >= 0) & (step.target_token_probs <= 1)).all())
    assert result.steps[1].context_len == result.steps[0].context_len + result.steps[0].acceptance.tau


def test_chat_template_is_applied_to_text_prompts(tiny_pair):
    tok = tiny_pair.target.tokenizer
    ids = encode_prompt(tok, "hello")
    assert tok.decode(ids).startswith("<|im_start|>user\nhello")
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert encode_prompt(tok, "hello", chat=False) == tok("hello")["input_ids"]
    assert encode_prompt(tok, [1, 2, 3]) == [1, 2, 3]


def test_all_drafter_names_are_distinct(tiny_pair):
    names = [make(tiny_pair).name for make in DRAFTERS.values()]
    assert len(set(names)) == len(names), names
