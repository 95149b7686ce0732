"""A draft vocabulary reduced to a ranking's most frequent tokens plus the sequence's own:
rows of every head kind bitwise the full head's, the ranking file, the drafters and the
registry names, and that speculative output stays the target's."""

import pytest
import torch
from torch import nn

from specviz.decode.engine import encode_prompt, plain_generate, speculative_generate
from specviz.draft import ChainDrafter, DynamicTreeDrafter
from specviz.draft.registry import build_drafter, parse_strategy
from specviz.draft.vocab import (DraftVocabulary, ReducedHead, draft_vocabulary, head_rows, reduced_head,
                                 tokenizer_hash)
from specviz.quant.weights import W4A8TokenLinear, W8A8TokenLinear, _fbgemm_available
from specviz.sampling import SamplingConfig

PROMPT = "Repeat after me three times: the red fox jumps over the lazy dog, the red fox jumps."


def _ranking(pair, ranked=None):
    ranked = tuple(range(200, 100, -1)) if ranked is None else tuple(ranked)
    return DraftVocabulary(ranked, pair.draft.vocab_size, tokenizer_hash(pair.draft.tokenizer),
                           {"tokens": 0, "sha256": "test"})


@pytest.fixture
def cached_ranking(tiny_pair, tmp_path, monkeypatch):
    """A ranking for the tiny tokenizer in a fresh specviz cache (the shipped ones are for
    other tokenizers)."""
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    vocab = _ranking(tiny_pair)
    vocab.save(tmp_path / "vocab" / f"draft-vocab-{vocab.tokenizer}.json")
    return vocab


def _linear(n=40, k=16, bias=True):
    torch.manual_seed(0)
    layer = nn.Linear(k, n, bias=bias)
    return layer


@pytest.mark.parametrize("kind", ["linear", "w8a8-token", "w8a8-token-one-pass", "w4a8-token"])
def test_head_rows_are_bitwise_the_full_heads(kind):
    base = _linear()
    if kind.startswith("w8a8-token") and not _fbgemm_available():
        pytest.skip("no fbgemm")
    head = {"linear": lambda: base,
            "w8a8-token": lambda: W8A8TokenLinear.from_linear(base, torch.rand(16) + 0.5),
            "w8a8-token-one-pass": lambda: W8A8TokenLinear.from_linear(base, torch.rand(16) + 0.5, residual=False),
            "w4a8-token": lambda: W4A8TokenLinear.from_linear(base, torch.rand(16) + 0.5)}[kind]()
    rows = torch.tensor([3, 0, 17, 39, 5])
    x = torch.randn(2, 3, 16)
    sub = head_rows(head, rows)
    assert type(sub) is type(head)
    assert sub.out_features == 5
    if kind.startswith("w8a8-token"):  # the settings travel with the rows
        assert (sub.alpha, sub.residual, sub.in_features) == (head.alpha, head.residual, head.in_features)
    with torch.no_grad():
        if kind == "linear":  # a float product of fewer rows may sum in another order
            torch.testing.assert_close(sub(x), head(x)[..., rows], rtol=1e-6, atol=1e-6)
        else:  # exact integer products, then the same elementwise scaling
            assert torch.equal(sub(x), head(x)[..., rows])


def test_head_rows_of_other_modules_are_refused():
    with pytest.raises(TypeError, match="Conv1d"):
        head_rows(nn.Conv1d(2, 2, 1), torch.tensor([1, 9]))


def test_ranking_ids_fill_save_load_and_coverage(tiny_pair, tmp_path):
    vocab = _ranking(tiny_pair, ranked=[50, 7, 200])
    assert vocab.ids(2).tolist() == [7, 50]
    assert vocab.ids(5).tolist() == [0, 1, 7, 50, 200]  # the ranked three, then the smallest ids
    with pytest.raises(ValueError, match="larger than the model's"):
        vocab.ids(tiny_pair.draft.vocab_size + 1)
    path = vocab.save(tmp_path / "r.json")
    assert DraftVocabulary.load(path) == vocab
    (tmp_path / "bad.json").write_text('{"ranked": [1]}')
    with pytest.raises(ValueError, match="not a draft vocabulary ranking"):
        DraftVocabulary.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        DraftVocabulary((3, 400), tiny_pair.draft.vocab_size, vocab.tokenizer, {})
    with pytest.raises(ValueError, match="distinct"):
        DraftVocabulary((3, 3), tiny_pair.draft.vocab_size, vocab.tokenizer, {})
    assert vocab.coverage([[7, 50, 3, 3]], 2) == 0.5
    assert vocab.coverage([[7, 50, 3, 3]], 5) == 0.5  # 3 is not among the five
    assert vocab.coverage([[]], 2) != vocab.coverage([[]], 2)  # nan


def test_draft_vocabulary_lookup_and_errors(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="python -m specviz.heads.vocab --draft"):
        draft_vocabulary(tiny_pair.draft)
    vocab = _ranking(tiny_pair)
    path = vocab.save(tmp_path / "vocab" / f"draft-vocab-{vocab.tokenizer}.json")
    assert draft_vocabulary(tiny_pair.draft) == vocab
    DraftVocabulary((1, 2), 99, vocab.tokenizer, vocab.corpus).save(path)
    with pytest.raises(ValueError, match="ranks a vocabulary of 99"):
        draft_vocabulary(tiny_pair.draft)
    with pytest.raises(ValueError, match="another tokenizer"):
        reduced_head(tiny_pair.draft, 10, DraftVocabulary(vocab.ranked, vocab.vocab_size, "0" * 16, {}))
    with pytest.raises(ValueError, match="not smaller"):
        reduced_head(tiny_pair.draft, tiny_pair.draft.vocab_size, vocab)


def test_reduced_head_scores_its_rows_and_the_included_tokens(tiny_pair):
    vocab = _ranking(tiny_pair)
    head = reduced_head(tiny_pair.draft, 20, vocab)
    assert isinstance(head, ReducedHead) and head.size == 20
    full = tiny_pair.draft.model.lm_head
    h = torch.randn(1, 2, full.in_features)
    with torch.no_grad():
        out, ref = head(h), full(h)
    rows = vocab.ids(20)
    torch.testing.assert_close(out[..., rows], ref[..., rows], rtol=1e-6, atol=1e-6)
    outside = torch.ones(tiny_pair.draft.vocab_size, dtype=torch.bool)
    outside[rows] = False
    assert torch.isneginf(out[..., outside]).all()
    head.include([5, 5, 190, 10_000])  # 190 is ranked already; 10,000 is out of range
    assert head.size == 21
    with torch.no_grad():
        torch.testing.assert_close(head(h)[..., 5], ref[..., 5], rtol=1e-6, atol=1e-6)
    head.reset()
    assert head.size == 20
    # the fixed rows' head is built once per model and size
    assert reduced_head(tiny_pair.draft, 20, vocab).base is head.base


def test_chain_with_reduced_vocabulary_keeps_the_targets_output(tiny_pair, cached_ranking):
    drafter = ChainDrafter(tiny_pair.draft, 3, vocab=16)
    assert drafter.name == "chain(k=3,v=16)"
    result = speculative_generate(tiny_pair.target, drafter, PROMPT, max_new_tokens=40, stop_at_eos=False)
    reference = plain_generate(tiny_pair.target, PROMPT, max_new_tokens=40, stop_at_eos=False)
    assert result.output_ids == reference.output_ids
    # every proposal is a ranked token or one of the sequence's own
    allowed = set(cached_ranking.ids(16).tolist()) | set(encode_prompt(tiny_pair.draft.tokenizer, PROMPT, True))
    allowed |= set(result.output_ids)
    proposed = {int(t) for s in result.steps for t in s.tree.tokens[1:]}
    assert proposed and proposed <= allowed
    outside = proposed - set(cached_ranking.ids(16).tolist())
    assert outside  # the prompt's own tokens were proposed as well


def test_sampled_decoding_with_reduced_vocabulary_is_reproducible(tiny_pair, cached_ranking):
    config = SamplingConfig(temperature=0.8)
    runs = [speculative_generate(tiny_pair.target, DynamicTreeDrafter(tiny_pair.draft, 2, 3, 6, vocab=16), PROMPT,
                                 max_new_tokens=24, config=config, seed=3, stop_at_eos=False).output_ids
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 24


@pytest.mark.parametrize("name", ["chain-k2-v16", "tree-2x1-v16", "tree-w2-d2-b3-v16", "dynamic-v16",
                                  "dynamic-w2-d3-b6-v16", "fallback-ngram+chain-k2-v16"])
def test_registry_names(tiny_pair, cached_ranking, name):
    drafter = build_drafter(name, tiny_pair)
    result = speculative_generate(tiny_pair.target, drafter, PROMPT, max_new_tokens=12, stop_at_eos=False)
    assert result.output_ids == plain_generate(tiny_pair.target, PROMPT, max_new_tokens=12,
                                               stop_at_eos=False).output_ids
    assert parse_strategy("chain-k2").param("vocab") is None
    assert parse_strategy("chain-k2-v16").param("vocab") == 16
    with pytest.raises(ValueError, match="must be >= 1"):
        parse_strategy("chain-k2-v0")


def test_batched_rows_draft_with_their_own_sequences_tokens(tiny_pair, cached_ranking):
    from specviz.decode.engine import speculative_generate_batch

    prompts = [PROMPT, "Count: one two three four five six seven eight nine ten eleven twelve"]
    config = SamplingConfig(temperature=0.9)
    drafter = ChainDrafter(tiny_pair.draft, 3, vocab=16)
    batched = speculative_generate_batch(tiny_pair.target, drafter, prompts, max_new_tokens=20, config=config,
                                         verifier="chain", seed=[5, 6], stop_at_eos=False)
    alone = [speculative_generate(tiny_pair.target, ChainDrafter(tiny_pair.draft, 3, vocab=16), p, max_new_tokens=20,
                                  config=config, verifier="chain", seed=s, stop_at_eos=False)
             for p, s in zip(prompts, [5, 6])]
    for b, a in zip(batched, alone):
        assert b.output_ids == a.output_ids
        assert [s.tree.tokens.tolist() for s in b.steps] == [s.tree.tokens.tolist() for s in a.steps]
    copy = drafter.spawn()
    assert copy._head is not drafter._head and copy._head.base is drafter._head.base
