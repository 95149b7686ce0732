"""Trained draft heads (specviz.heads) on the tiny random target: features, training with
checkpoints and resume, the result cache and its load errors, the reduced vocabulary,
greedy identity of the Medusa and EAGLE drafters with the target, and the command line."""

import copy
import dataclasses
import functools
import itertools
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import specviz.heads.corpus as corpus_module
import specviz.draft.heads as drafters_module
import specviz.heads.training as training
from specviz.decode.engine import (
    encode_prompt,
    plain_generate,
    speculative_generate,
    speculative_generate_batch,
)
from specviz.decode.replay import replay_acceptance
from specviz.draft.merged import MergedDrafter
from specviz.draft.model import grow_dynamic_tree
from specviz.draft.ngram import NgramDrafter
from specviz.draft.registry import build_drafter, heads_kinds, parse_strategy
from specviz.heads import (
    Corpus,
    EagleDrafter,
    EagleHead,
    HEADS_ENV,
    HeadConfig,
    MedusaDrafter,
    MedusaHeads,
    PRECISIONS,
    SELF_OPENERS,
    TASK_KINDS,
    build_corpus,
    config_hash,
    draft_vocab,
    extract_features,
    features_dir,
    find_heads,
    head_accuracy,
    head_calibration,
    head_drafter,
    heads_dir,
    heads_validation,
    load_features,
    load_heads,
    medusa_tree,
    out_of_vocab_share,
    reduced_vocab,
    self_prompts,
    stdlib_prompts,
    target_features,
    task_prompts,
    train_heads,
    training_precision,
    validation_split,
)
from specviz.heads.__main__ import main
from specviz.models.kvcache import forward_tokens, new_cache
from specviz.quant.extension import w4a8_token_op
from specviz.models.tiny import tiny_model
from specviz.models.tiny import tiny_pair as make_tiny_pair
from specviz.quant.w4a8 import W4A8TokenLinear
from specviz.quant.weights import SharedInputSlice, W8A8TokenLinear, parse_weight_mode
from specviz.sampling import GREEDY, SamplingConfig
from specviz.data.prompts import DEFAULT_PROMPTS_PATH, load_prompts
from specviz.data.store import ResultStore
from specviz.tree.core import pad_trees, tree_attention_mask
from specviz.tree.shapes import chain, from_paths, kary

PROMPTS = ("def fizzbuzz(n):", "What is 17 * 23? Think step by step.",
           "Translate to French: the cat sleeps on the warm window sill.")
#: small, fast training settings
SMALL = HeadConfig(window=24, batch_size=4, lr=3e-3)
STEPS = 40


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: tiny models gain nothing from more, and on a busy machine
    waiting on the thread pool would dominate the run time."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus(tiny_pair) -> Corpus:
    """The target's greedy continuations of a few prompts (plain text: the tiny target's
    continuations of chat-wrapped prompts hardly depend on the prompt)."""
    seqs, lens = [], []
    for prompt in ("def add(a, b):", "Translate: the cat sleeps.", "List three colours.") + PROMPTS:
        out = plain_generate(tiny_pair.target, prompt, max_new_tokens=24, stop_at_eos=False, chat=False)
        seqs.append(list(out.prompt_ids) + list(out.output_ids))
        lens.append(len(out.prompt_ids))
    return Corpus.from_sequences(seqs, lens)


@pytest.fixture(scope="module")
def trained(tiny_pair, corpus, cache):
    """Medusa heads and an EAGLE head trained briefly into the cache."""
    return {kind: train_heads(kind, tiny_pair.target, corpus, steps=STEPS, config=SMALL, progress=False)
            for kind in ("medusa", "eagle")}


# -- features -------------------------------------------------------------------------------------

def test_forward_hidden_equals_target_features(tiny_pair):
    model = tiny_pair.target.model
    ids = encode_prompt(tiny_pair.target.tokenizer, "def add(a, b):")
    cache = new_cache(model)
    forward_tokens(model, cache, torch.tensor([ids[:-1]]), torch.arange(len(ids) - 1)[None], None)
    tree = build_drafter("tree-2x2", tiny_pair).draft(torch.tensor(ids), GREEDY, "greedy", None)
    batch = pad_trees([tree], [len(ids) - 1])
    plain = forward_tokens(model, cache, batch.tokens, batch.position_ids, batch.mask)
    cache = new_cache(model)
    forward_tokens(model, cache, torch.tensor([ids[:-1]]), torch.arange(len(ids) - 1)[None], None)
    logits, hidden = forward_tokens(model, cache, batch.tokens, batch.position_ids, batch.mask, hidden=True)
    assert torch.equal(logits, plain)  # the hidden option changes nothing else
    assert hidden.shape == (1, tree.n_nodes, model.config.hidden_size)
    for node in range(tree.n_nodes):
        path = [node]
        while path[-1] > 0:
            path.append(int(tree.parents[path[-1]]))
        seq = ids[:-1] + [int(tree.tokens[i]) for i in reversed(path)]
        torch.testing.assert_close(hidden[0, node], target_features(tiny_pair.target, seq)[-1], atol=1e-5, rtol=1e-5)
    assert target_features(tiny_pair.target, []).shape == (0, model.config.hidden_size)


def test_features_are_cached_in_shards_and_resume(tiny_pair, corpus, tmp_path):
    out = extract_features(tiny_pair.target, corpus.sequences, tmp_path, sha256=corpus.sha256, shard_size=2,
                           progress=False)
    shards = sorted(p.name for p in out.glob("shard-*.pt"))
    assert shards == ["shard-00000.pt", "shard-00001.pt", "shard-00002.pt"]
    feats = load_features(out, sha256=corpus.sha256)
    assert [f.shape[0] for f in feats] == [len(s) for s in corpus.sequences]
    torch.testing.assert_close(feats[1].float(), target_features(tiny_pair.target, corpus.sequences[1]),
                               atol=1e-2, rtol=1e-2)  # stored in float16
    (out / "shard-00001.pt").unlink()
    before = (out / "shard-00000.pt").stat().st_mtime_ns
    extract_features(tiny_pair.target, corpus.sequences, tmp_path, sha256=corpus.sha256, shard_size=2,
                     progress=False)
    assert (out / "shard-00001.pt").exists() and (out / "shard-00000.pt").stat().st_mtime_ns == before
    with pytest.raises(ValueError, match="holds data_sha256"):
        extract_features(tiny_pair.target, corpus.sequences, tmp_path, sha256="0" * 64, shard_size=2, progress=False)
    other_mode = dataclasses.replace(tiny_pair.target, weight_mode="bf16")  # features of another weight mode
    with pytest.raises(ValueError, match="holds weight_mode 'fp32', not 'bf16'"):
        extract_features(other_mode, corpus.sequences, tmp_path, sha256=corpus.sha256, shard_size=2, progress=False)


# -- data -----------------------------------------------------------------------------------------

def test_stdlib_prompts_are_deterministic():
    a = stdlib_prompts(4, seed=1, max_chars=200)
    assert a == stdlib_prompts(4, seed=1, max_chars=200) and a != stdlib_prompts(4, seed=2, max_chars=200)
    assert all(p.startswith(("Explain", "Summarise", "Complete")) for p in a)


def test_task_prompts_cover_the_task_kinds_without_evaluation_prompts():
    a = task_prompts(14, seed=3)
    assert a == task_prompts(14, seed=3) and a != task_prompts(14, seed=4) and len(set(a)) == 14
    starts = {"translation": "Translate the following text into ", "summarization": "Summarize the following text",
              "rag": "Context:\n", "code": "Write a Python function ", "math_reasoning": ""}
    kinds = TASK_KINDS * 2  # round-robin over the kinds
    for kind, prompt in zip(kinds, a):
        assert prompt.startswith(starts.get(kind, "")), (kind, prompt)
    assert all(p.endswith("Reason step by step, then give the final answer.")
               for k, p in zip(kinds, a) if k == "math_reasoning")
    evaluation = {p.turns[0] for p in load_prompts(DEFAULT_PROMPTS_PATH)}
    many = [p for seed in range(3) for p in task_prompts(1500, seed=seed)]
    assert not evaluation & set(many)  # nothing of the evaluation file
    # nor any of its questions inside another prompt (the last sentence before each "?")
    questions = {text.split("?")[0].split("\n")[-1].split(". ")[-1] for text in evaluation if "?" in text}
    questions = {q for q in questions if len(q.split()) >= 6}
    assert len(questions) > 10
    assert not [q for q in questions if any(q in p for p in many)]
    assert all(p.startswith("Translate") for p in task_prompts(3, kinds=["translation"]))
    assert task_prompts(0) == []
    with pytest.raises(ValueError, match="unknown task kind 'poetry'"):
        task_prompts(2, kinds=["qa", "poetry"])


def test_task_prompts_without_the_python_reference(monkeypatch):
    monkeypatch.setattr(corpus_module, "_prose_passages", lambda: [])  # a Python without pydoc_data
    prompts = task_prompts(14, seed=0)
    assert len(prompts) == 14 and all(p.strip() for p in prompts)
    assert prompts[3].startswith("Context:\n") and prompts[4].startswith("Summarize the following text")


def test_build_corpus_adds_task_prompts(tiny_pair):
    kwargs = dict(max_new_tokens=4, temperatures=(0.0,), progress=False)
    data = build_corpus(tiny_pair.target, prompts=1, tasks=2, max_prompt_chars=120, **kwargs)
    only_tasks = build_corpus(tiny_pair.target, prompts=0, tasks=2, **kwargs)
    assert len(data) == 3 and data.sequences[1:] == only_tasks.sequences
    with pytest.raises(ValueError, match="tasks must be"):
        build_corpus(tiny_pair.target, prompts=1, tasks=-1, **kwargs)


def _loose(monkeypatch):
    """Keep every turn the tiny random target writes (it never ends one, nor writes words)."""
    monkeypatch.setattr(corpus_module, "self_prompts", functools.partial(
        corpus_module.self_prompts, complete=False, min_words=0, latin=0.0))


def test_self_prompts_are_written_by_the_target(tiny_pair, tmp_path, monkeypatch):
    kw = dict(max_tokens=6, batch_size=3, complete=False, min_words=0, latin=0.0, progress=False)
    store = tmp_path / "written.jsonl"
    a = self_prompts(tiny_pair.target, 5, seed=2, store=store, **kw)
    assert len(a) == 5 and len(set(a)) == 5
    for j, text in enumerate(a):  # attempt j writes a turn of kind j (round-robin) after that kind's first words
        assert text.startswith(SELF_OPENERS[TASK_KINDS[j % len(TASK_KINDS)]]), (j, text)
    assert len(store.read_text().splitlines()) == 6  # attempts run in batches of 3, each kept
    monkeypatch.setattr("specviz.decode.engine.plain_generate_batch",
                        lambda *a, **k: pytest.fail("a finished attempt ran again"))
    assert self_prompts(tiny_pair.target, 5, seed=2, store=store, **kw) == a  # read back from the store
    monkeypatch.undo()
    assert self_prompts(tiny_pair.target, 5, seed=2, **{**kw, "batch_size": 5}) == a  # the batch does not matter
    assert self_prompts(tiny_pair.target, 5, seed=3, **kw) != a
    assert all(p.startswith(SELF_OPENERS["qa"]) for p in self_prompts(tiny_pair.target, 2, kinds=["qa"], **kw))
    assert self_prompts(tiny_pair.target, 0) == []


def test_self_prompts_reject_bad_input_and_unusable_turns(tiny_pair, monkeypatch):
    target = tiny_pair.target
    with pytest.raises(ValueError, match="wrote 0 usable prompts of 2 in 3 attempts"):
        self_prompts(target, 2, max_tokens=4, max_attempts=3, progress=False)  # random tokens never end a turn
    with pytest.raises(ValueError, match="temperature must be > 0"):
        self_prompts(target, 2, temperature=0.0)
    with pytest.raises(ValueError, match="unknown task kind 'poetry'"):
        self_prompts(target, 2, kinds=["poetry"])
    with pytest.raises(ValueError, match="latin must be a share"):
        self_prompts(target, 2, latin=1.5)
    monkeypatch.setattr(target.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="has no chat template, so it cannot write prompts itself"):
        self_prompts(target, 2)


def test_usable_prompt_filters_short_and_other_script_turns():
    usable = corpus_module._usable_prompt
    assert usable("Why do cats purr so loudly?")
    assert usable("Traduisez en français : « où est la gare ? »")  # Latin letters with accents count
    assert not usable("Why cats?")  # under four words
    assert not usable("Explain how 网关 与 Nginx 规则 work together")
    assert not usable("Summarize the main points of the text.\n\nAssistant: The text discusses")
    assert usable("Why?", min_words=0) and usable("网关 与 Nginx 规则 规则", latin=0.0)


def test_build_corpus_adds_written_prompts(tiny_pair, tmp_path, monkeypatch):
    _loose(monkeypatch)
    kwargs = dict(prompts=0, max_new_tokens=4, temperatures=(0.0,), batch_size=2, progress=False)
    store = tmp_path / "corpus.jsonl"
    data = build_corpus(tiny_pair.target, tasks=1, written=2, store=store, **kwargs)
    written = corpus_module.self_prompts(tiny_pair.target, 2, seed=0, store=ResultStore(None), progress=False)
    assert len(data) == 3 and data.sequences[0] == build_corpus(tiny_pair.target, tasks=1, **kwargs).sequences[0]
    prompts = [tiny_pair.target.tokenizer.decode(s[:n]) for s, n in zip(data.sequences, data.prompt_lengths)]
    assert all(w in p for w, p in zip(written, prompts[1:]))
    assert len(store.read_text().splitlines()) == 2 + 3  # the attempts (a batch of 2) and the continuations
    assert build_corpus(tiny_pair.target, tasks=1, written=2, store=store, **kwargs) == data
    with pytest.raises(ValueError, match="written must be"):
        build_corpus(tiny_pair.target, written=-1, **kwargs)


def test_build_corpus_samples_in_batches(tiny_pair):
    kwargs = dict(prompts=3, max_new_tokens=6, max_prompt_chars=120, temperatures=(0.0, 0.9, 0.9), seed=4,
                  progress=False)
    one_by_one = build_corpus(tiny_pair.target, batch_size=1, **kwargs)
    assert build_corpus(tiny_pair.target, batch_size=3, **kwargs) == one_by_one and len(one_by_one) == 6
    prompt = one_by_one.sequences[1][:one_by_one.prompt_lengths[1]]  # prompt 0 sampled, seed 4 + 0
    sampled = plain_generate(tiny_pair.target, list(prompt), max_new_tokens=6, config=SamplingConfig(temperature=0.9),
                             seed=4)
    assert one_by_one.sequences[1] == tuple(prompt) + sampled.output_ids


def test_build_corpus_decodes_greedy_continuations_in_batches(tiny_pair, tmp_path):
    kwargs = dict(prompts=3, max_new_tokens=5, max_prompt_chars=120, temperatures=(0.0,), progress=False)
    one_by_one = build_corpus(tiny_pair.target, batch_size=1, **kwargs)
    store = tmp_path / "corpus.jsonl"
    batched = build_corpus(tiny_pair.target, batch_size=2, store=store, **kwargs)
    assert len(batched) == 3 and batched == one_by_one  # same continuations, same order
    assert len(store.read_text().splitlines()) == 3  # every continuation kept for a resume
    with pytest.raises(ValueError, match="batch_size"):
        build_corpus(tiny_pair.target, batch_size=0, **kwargs)


def test_build_corpus_keeps_the_decodings_features(tiny_pair, tmp_path, monkeypatch):
    store = tmp_path / "corpus.jsonl"
    kwargs = dict(prompts=0, tasks=3, max_new_tokens=5, temperatures=(0.0,), batch_size=2, store=store,
                  progress=False)
    data = build_corpus(tiny_pair.target, **kwargs)
    assert len(list(Path(str(store) + ".features").glob("*.pt"))) == 3  # one file per continuation
    again = build_corpus(tiny_pair.target, **kwargs)  # read back from the store, features from their files
    width = tiny_pair.target.model.config.hidden_size
    for i, seq in enumerate(data.sequences):
        name, mode, feats = again.features(i)
        assert (name, mode) == (tiny_pair.target.name, "fp32") and feats.shape == (len(seq), width)
        torch.testing.assert_close(feats.float(), target_features(tiny_pair.target, seq), atol=1e-2, rtol=1e-2)
    monkeypatch.setattr("specviz.models.features.target_features", lambda *a: pytest.fail("a kept sequence again"))
    out = extract_features(tiny_pair.target, again.sequences, tmp_path / "f", sha256=again.sha256, shard_size=2,
                           progress=False, kept=again.features)
    assert [f.shape[0] for f in load_features(out)] == [len(s) for s in data.sequences]
    monkeypatch.undo()
    in_memory = build_corpus(tiny_pair.target, **{**kwargs, "store": None})
    assert in_memory == data and in_memory.features(0)[2].shape == (len(data.sequences[0]), width)
    # features of another weight mode, or of a sequence they do not cover, are computed again
    other_mode = dataclasses.replace(tiny_pair.target, weight_mode="bf16")
    computed = []
    monkeypatch.setattr("specviz.models.features.target_features",
                        lambda target, seq: computed.append(len(seq)) or torch.zeros(len(seq), width))
    extract_features(other_mode, again.sequences, tmp_path / "g", sha256=again.sha256, progress=False,
                     kept=again.features)
    assert computed == [len(s) for s in data.sequences]
    (next(Path(str(store) + ".features").glob("*.pt"))).write_bytes(b"damaged")
    assert sum(build_corpus(tiny_pair.target, **kwargs).features(i) is None for i in range(3)) == 1


def test_build_corpus_records_size_and_hash(tiny_pair, tmp_path):
    store = tmp_path / "corpus.jsonl"
    data = build_corpus(tiny_pair.target, prompts=1, max_new_tokens=6, max_prompt_chars=120, store=store,
                        progress=False)
    assert len(data) == 2  # one greedy, one sampled continuation
    assert data.tokens == sum(len(s) for s in data.sequences)
    assert data.sequences[0][:data.prompt_lengths[0]] == data.sequences[1][:data.prompt_lengths[1]]
    again = build_corpus(tiny_pair.target, prompts=1, max_new_tokens=6, max_prompt_chars=120, store=store,
                         progress=False)  # read back from the store
    assert again == data and len(data.sha256) == 64
    assert Corpus.from_sequences(data.sequences[:1], data.prompt_lengths[:1]).sha256 != data.sha256
    with pytest.raises(ValueError, match="held-out category"):
        build_corpus(tiny_pair.target, prompts=0, spec_bench=DEFAULT_PROMPTS_PATH, progress=False)


# -- training -------------------------------------------------------------------------------------

def _mean(values) -> float:
    return sum(values) / len(values)


def test_training_lowers_the_loss(trained):
    for kind, result in trained.items():
        losses = [h[1] for h in result.history]
        assert result.step == STEPS and len(losses) == STEPS
        assert _mean(losses[-5:]) < 0.5 * _mean(losses[:5]), kind
        meta = json.loads((result.path / "meta.json").read_text())
        assert meta["finished"] and meta["step"] == STEPS and meta["kind"] == kind


def test_checkpoint_and_resume_continue_from_the_saved_step(tiny_pair, corpus, tmp_path, monkeypatch):
    feats = tmp_path / "features"
    cfg = HeadConfig(window=16, batch_size=2, noise=0.1)
    straight = train_heads("eagle", tiny_pair.target, corpus, steps=6, out_dir=tmp_path / "a", config=cfg,
                           features=feats, progress=False)
    calls = {"n": 0}
    real = training._eagle_loss

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "_eagle_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_heads("eagle", tiny_pair.target, corpus, steps=6, out_dir=tmp_path / "b", config=cfg, features=feats,
                    progress=False)
    saved = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert saved["step"] == 3 and not saved["finished"]
    monkeypatch.setattr(training, "_eagle_loss", real)
    resumed = train_heads("eagle", tiny_pair.target, corpus, steps=6, out_dir=tmp_path / "b", config=cfg,
                          features=feats, progress=False)
    assert resumed.step == 6 and [h[0] for h in resumed.history] == [1, 2, 3, 4, 5, 6]
    assert repr(resumed.history) == repr(straight.history)  # accuracies may be nan
    for key, value in straight.heads.state_dict().items():
        assert torch.equal(value, resumed.heads.state_dict()[key]), key
    again = train_heads("eagle", tiny_pair.target, corpus, steps=6, out_dir=tmp_path / "b", config=cfg,
                        features=feats, progress=False)  # finished: nothing more to do
    assert again.step == 6
    with pytest.raises(ValueError, match="holds a training run with kind 'eagle', not 'medusa'"):
        train_heads("medusa", tiny_pair.target, corpus, steps=1, out_dir=tmp_path / "b", config=cfg, features=feats,
                    progress=False)


def test_checkpoints_are_written_while_training(tiny_pair, corpus, tmp_path, monkeypatch):
    saved = []
    real = training._save
    monkeypatch.setattr(training, "_save", lambda path, payload, meta: (saved.append(meta["step"]),
                                                                        real(path, payload, meta)))
    train_heads("medusa", tiny_pair.target, corpus, steps=3, out_dir=tmp_path / "run", features=tmp_path / "f",
                config=HeadConfig(window=16, batch_size=2, checkpoint_minutes=1e-9), progress=False)
    assert saved == [1, 2, 3, 3]  # after every step (the interval is tiny), then the final one


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_training_in_bfloat16_lowers_the_loss(tiny_pair, corpus, tmp_path, kind):
    cfg = dataclasses.replace(SMALL, precision="bf16", validation=0.0)
    result = train_heads(kind, tiny_pair.target, corpus, steps=STEPS, config=cfg, out_dir=tmp_path / kind,
                         progress=False)
    losses = [loss for _, loss, _ in result.history]
    assert all(math.isfinite(x) for x in losses) and _mean(losses[-5:]) < _mean(losses[:5])
    assert all(p.dtype == torch.float32 for p in result.heads.parameters())  # float32 weights, bf16 products
    assert training_precision("cpu") in PRECISIONS and training_precision("meta") == "fp32"
    with pytest.raises(ValueError, match="precision must be one of"):
        HeadConfig(precision="fp16")


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_training_on_soft_labels_lowers_the_loss(tiny_pair, corpus, tmp_path, kind):
    cfg = dataclasses.replace(SMALL, soft_labels=1.0, validation=0.0)
    result = train_heads(kind, tiny_pair.target, corpus, steps=STEPS, config=cfg, out_dir=tmp_path / kind,
                         progress=False)
    losses = [loss for _, loss, _ in result.history]
    assert all(math.isfinite(x) for x in losses) and _mean(losses[-5:]) < _mean(losses[:5])
    for bad, message in ((1.5, "soft_labels must be a share"), (-0.1, "soft_labels must be a number >= 0")):
        with pytest.raises(ValueError, match=message):
            HeadConfig(soft_labels=bad)


def test_eagle_head_with_a_narrow_mlp(tiny_pair, corpus, tmp_path):
    cfg = dataclasses.replace(SMALL, mlp_size=32, validation=0.0)
    result = train_heads("eagle", tiny_pair.target, corpus, steps=STEPS, config=cfg, out_dir=tmp_path / "narrow",
                         progress=False)
    head = result.heads
    hidden = tiny_pair.target.model.config.hidden_size
    assert head.mlp_size == 32 and tiny_pair.target.model.config.intermediate_size == 2 * hidden  # target untouched
    assert tuple(head.layer.mlp.gate_proj.weight.shape) == (32, hidden)
    assert tuple(head.layer.mlp.down_proj.weight.shape) == (hidden, 32)
    losses = [loss for _, loss, _ in result.history]
    assert all(math.isfinite(x) for x in losses) and _mean(losses[-5:]) < _mean(losses[:5])
    # loaded back at its own width, with the same weights
    loaded = load_heads(result.path, tiny_pair.target)
    assert loaded.mlp_size == 32
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    # drafts losslessly, as trained and packed to w8a8-token
    plain = plain_generate(tiny_pair.target, PROMPTS[0], max_new_tokens=24, chat=False)
    for dtype in (None, "w8a8-token"):
        drafter = EagleDrafter(tiny_pair.target, loaded, topk=2, depth=3, budget=6, dtype=dtype)
        spec = speculative_generate(tiny_pair.target, drafter, PROMPTS[0], max_new_tokens=24, chat=False)
        assert spec.output_ids == plain.output_ids, dtype
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="mlp_size"):
            HeadConfig(mlp_size=bad)
    with pytest.raises(ValueError, match="mlp_size"):
        EagleHead(tiny_pair.target, mlp_size=0)


def _perturbed(module, seed: int = 0):
    """``module`` with every trained parameter moved off its initial value."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return module


def test_medusa_soft_labels_are_the_targets_distribution_after_the_position_before(tiny_pair, corpus):
    target = tiny_pair.target
    feats = [target_features(target, s) for s in corpus.sequences]
    k_heads, decay = 3, 0.8
    heads = _perturbed(MedusaHeads.from_target(target, n_heads=k_heads))
    p0, n1 = corpus.prompt_lengths[0], len(corpus.sequences[1])
    wins = [(0, p0 - 4, p0 + 8), (1, n1 - 10, n1 - 1)]  # across the prompt's end; up to the sequence's last label
    batch = training._medusa_batch(feats, corpus, k_heads, wins)
    with torch.no_grad():
        hard, right, counted = training._medusa_loss(heads, *batch, decay)
        soft, right_soft, _ = training._medusa_loss(heads, *batch, decay, soft=1.0)
        half, _, _ = training._medusa_loss(heads, *batch, decay, soft=0.5)
    assert right_soft == right  # accuracy is measured against the data's tokens either way
    # by hand: head k at position t learns the target's distribution at t + 1 + k, its LM head on feature t + k
    total = 0.0
    for k in range(k_heads):
        terms = []
        for s, a, b in wins:
            seq, p = corpus.sequences[s], corpus.prompt_lengths[s]
            for t in range(a, b):
                if not p <= t + 1 + (k + 1) < len(seq):
                    continue
                with torch.no_grad():
                    student = heads.scores(heads.states(feats[s][t])[k]).log_softmax(-1)
                    teacher = heads.scores(feats[s][t + 1 + k]).softmax(-1)
                terms.append(float(-(teacher * student).sum()))
        total += decay ** k * sum(terms) / len(terms)
    assert float(soft) == pytest.approx(total / sum(decay ** k for k in range(k_heads)), rel=1e-5)
    assert float(half) == pytest.approx(0.5 * float(hard) + 0.5 * float(soft), rel=1e-5)
    assert float(soft) != pytest.approx(float(hard), rel=1e-3)


def test_eagle_soft_labels_are_the_targets_distribution_from_its_next_feature(tiny_pair, corpus):
    target = tiny_pair.target
    feats = [target_features(target, s) for s in corpus.sequences]
    head = _perturbed(EagleHead.from_target(target)).eval()
    wins = [(s, corpus.prompt_lengths[s] - 3, min(corpus.prompt_lengths[s] + 9, len(corpus.sequences[s]) - 1))
            for s in (0, 2)]  # across the prompt's end: labels from its last position on
    batch = training._eagle_batch(feats, corpus, wins)
    only_tokens = HeadConfig(regression_weight=0.0, classification_weight=1.0, noise=0.0)
    with torch.no_grad():
        hard, right, _ = training._eagle_loss(head, batch, only_tokens, None)
        soft, right_soft, _ = training._eagle_loss(head, batch, dataclasses.replace(only_tokens, soft_labels=1.0),
                                                   None)
        inputs, tokens, positions, valid, _, labels = batch
        logp = head.scores(head(inputs, tokens, positions, valid)).log_softmax(-1)  # (B, W, V)
    assert right_soft == right
    terms = []
    for r, (s, a, b) in enumerate(wins):
        for i, t in enumerate(range(a, b)):
            if labels[r, i] == -100:
                continue
            teacher = head.scores(feats[s][t + 1]).softmax(-1)  # the target's distribution of token t + 2
            terms.append(float(-(teacher * logp[r, i]).sum()))
    assert float(soft) == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    assert float(soft) != pytest.approx(float(hard), rel=1e-3)


def test_eagle_rollout_trains_deeper_depths_on_the_heads_own_predictions_as_drafting_runs_them(tiny_pair, corpus):
    target = tiny_pair.target
    feats = [target_features(target, s) for s in corpus.sequences]
    head = _perturbed(EagleHead.from_target(target)).eval()
    s = 1
    a, b = corpus.prompt_lengths[s] - 2, min(corpus.prompt_lengths[s] + 10, len(corpus.sequences[s]) - 1)
    batch = training._eagle_batch(feats, corpus, [(s, a, b)])
    inputs, tokens, positions, valid, targets, labels = batch
    only_reg = HeadConfig(regression_weight=1.0, classification_weight=0.0, noise=0.0)
    with torch.no_grad():
        one, right1, count1 = training._eagle_loss(head, batch, only_reg, None)
        three, right3, count3 = training._eagle_loss(head, batch, dataclasses.replace(only_reg, rollout=3), None)
        decayed, _, _ = training._eagle_loss(head, batch, dataclasses.replace(only_reg, rollout=3, rollout_decay=0.5),
                                             None)
        # what drafting computes: the true context in the cache, then a chain fed with the head's own predictions
        first = head(inputs, tokens, positions, valid)[0]  # (W, H) depth 1 at every position
        terms = {1: [], 2: [], 3: []}
        for j in range(b - a):
            terms[1].append(F.smooth_l1_loss(first[j], targets[0, j], reduction="sum"))
            for depth in (2, 3):
                if j < depth - 1:
                    continue
                start = j - depth + 1  # the last position whose true feature the chain starts from
                cache = new_cache(head)
                held = start + 1
                causal = torch.ones(held, held, dtype=torch.bool).tril()[None]
                pred = head.step(inputs[:, :held], tokens[:, :held], positions[:, :held], cache, causal)[:, -1:]
                for k in range(start + 1, j + 1):
                    seen = torch.ones(1, 1, held + 1, dtype=torch.bool)
                    pred = head.step(pred, tokens[:, k:k + 1], positions[:, k:k + 1], cache, seen)
                    held += 1
                terms[depth].append(F.smooth_l1_loss(pred[0, 0], targets[0, j], reduction="sum"))
    hidden = inputs.shape[-1]
    means = {d: float(sum(t)) / (len(t) * hidden) for d, t in terms.items()}
    assert float(one) == pytest.approx(means[1], rel=1e-4)
    assert float(three) == pytest.approx(sum(means.values()) / 3, rel=1e-4)
    assert float(decayed) == pytest.approx((means[1] + 0.5 * means[2] + 0.25 * means[3]) / 1.75, rel=1e-4)
    assert means[2] != pytest.approx(means[1], rel=1e-3)  # the deeper depths are other terms
    assert (right1, count1) == (right3, count3)  # the accuracy counted is depth 1's
    mask = training._rollout_mask(torch.ones(1, 4, dtype=torch.bool), 2)[0].int()
    assert mask.tolist() == [[0, 0, 0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 1, 0, 0], [1, 1, 0, 0, 0, 0, 1, 0],
                             [1, 1, 1, 0, 0, 0, 0, 1]]


def test_eagle_head_trained_with_a_rollout(tiny_pair, corpus, tmp_path):
    cfg = dataclasses.replace(SMALL, rollout=2, validation=0.2)
    result = train_heads("eagle", tiny_pair.target, corpus, steps=STEPS, config=cfg, out_dir=tmp_path / "rollout",
                         progress=False)
    losses = [loss for _, loss, _ in result.history]
    assert all(math.isfinite(x) for x in losses) and _mean(losses[-5:]) < _mean(losses[:5])
    assert json.loads((result.path / "meta.json").read_text())["config"]["rollout"] == 2
    assert cfg.key_fields("eagle")["rollout"] == 2 and "rollout" not in SMALL.key_fields("eagle")
    assert "rollout" not in cfg.key_fields("medusa")
    loaded = load_heads(result.path, tiny_pair.target)
    plain = plain_generate(tiny_pair.target, PROMPTS[1], max_new_tokens=24, chat=False)
    drafter = EagleDrafter(tiny_pair.target, loaded, topk=2, depth=3, budget=6)
    spec = speculative_generate(tiny_pair.target, drafter, PROMPTS[1], max_new_tokens=24, chat=False)
    assert spec.output_ids == plain.output_ids
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="rollout"):
            HeadConfig(rollout=bad)
    with pytest.raises(ValueError, match="rollout_decay"):
        HeadConfig(rollout=2, rollout_decay=-0.5)
    assert "rollout_decay" not in HeadConfig(rollout_decay=0.5).key_fields("eagle")  # no deeper depth to weight


def test_validation_split():
    assert validation_split(10, 0.1, 0) == validation_split(10, 0.1, 0)
    assert len(validation_split(10, 0.3, 0)) == 3 and len(validation_split(3, 0.01, 0)) == 1
    assert len(validation_split(3, 0.9, 0)) == 2  # never every sequence
    assert validation_split(1, 0.5, 0) == () and validation_split(10, 0.0, 0) == ()
    assert validation_split(50, 0.2, 0) != validation_split(50, 0.2, 1)
    assert all(0 <= i < 50 for i in validation_split(50, 0.2, 3))
    with pytest.raises(ValueError, match=r"validation must be a share in \[0, 1\), got 1.0"):
        HeadConfig(validation=1.0)
    with pytest.raises(ValueError, match="eval_every"):
        HeadConfig(eval_every=0)
    # held-out sequences get no training windows
    gen = torch.Generator().manual_seed(0)
    wins = training._windows([30, 30, 30], [0, 0, 0], [1.0, 0.0, 1.0], 64, 8, gen)
    assert {s for s, _, _ in wins} == {0, 2}


def test_validation_keeps_the_best_weights_and_records_them(trained, tiny_pair, corpus):
    held = validation_split(len(corpus), SMALL.validation, SMALL.seed)
    assert held
    for kind, result in trained.items():
        val = result.validation
        assert val == json.loads((result.path / "meta.json").read_text())["validation"] == heads_validation(result.path)
        assert val["sequences"] == len(held) and val["tokens"] == sum(len(corpus.sequences[s]) for s in held)
        assert [h[0] for h in val["history"]] == [25, STEPS]  # every eval_every steps, and at the end
        best = min(val["history"], key=lambda h: h[1])
        assert (val["best_step"], val["loss"], val["top1"]) == tuple(best)
        # the weights returned and loaded are the best ones: they reproduce the recorded loss
        loaded = load_heads(result.path, tiny_pair.target)
        for key, value in result.heads.state_dict().items():
            assert torch.equal(value, loaded.state_dict()[key]), key
        feats = load_features(features_dir(tiny_pair.target.name, corpus.sha256), sha256=corpus.sha256)
        firsts = ([max(p - 1 - SMALL.n_heads, 0) for p in corpus.prompt_lengths] if kind == "medusa"
                  else [0] * len(corpus))
        loss, top1 = training._validate(kind, loaded, feats, corpus, held, firsts, SMALL)
        assert loss == pytest.approx(val["loss"], rel=1e-5) and top1 == pytest.approx(val["top1"])
    heads = trained["medusa"].validation["heads"]
    assert [h["head"] for h in heads] == [1, 2, 3, 4]
    table = head_accuracy(trained["medusa"].heads, [feats[s] for s in held], [corpus.sequences[s] for s in held],
                          k=5, start=[corpus.prompt_lengths[s] for s in held], by_rank=True)
    for h, row in zip(heads, table.itertuples()):
        assert h["rank_accuracy"] == pytest.approx([row.rank_1, row.rank_2, row.rank_3, row.rank_4, row.rank_5])
        assert h["top1"] == pytest.approx(row.top1) and h["positions"] == row.positions


def test_find_heads_prefers_listed_then_the_most_data(tmp_path, monkeypatch):
    monkeypatch.delenv(HEADS_ENV, raising=False)
    folder = tmp_path / "heads" / "t"

    def result(name, kind="medusa", tokens=100, updated=1.0, finished=True):
        (folder / name).mkdir(parents=True)
        (folder / name / "meta.json").write_text(json.dumps({"kind": kind, "target": "t", "finished": finished,
                                                              "data_tokens": tokens, "updated": updated}))
        return folder / name

    small_new = result("medusa-a", tokens=100, updated=5.0)
    big_old = result("medusa-b", tokens=900, updated=1.0)
    result("medusa-c", tokens=5000, updated=9.0, finished=False)
    eagle = result("eagle-a", kind="eagle")
    assert find_heads("t", "medusa", cache=tmp_path) == big_old
    monkeypatch.setenv(HEADS_ENV, f"{eagle}{os.pathsep}{small_new}")
    assert find_heads("t", "medusa", cache=tmp_path) == small_new  # the listed one of the kind
    assert find_heads("t", "eagle", cache=tmp_path) == eagle
    monkeypatch.setenv(HEADS_ENV, str(eagle))
    assert find_heads("t", "medusa", cache=tmp_path) == big_old  # none listed of the kind: the cache's
    monkeypatch.setenv(HEADS_ENV, str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match=rf"\${HEADS_ENV} lists .*absent: no training result at"):
        find_heads("t", "medusa", cache=tmp_path)


def test_cache_keys(corpus):
    cfg = HeadConfig()
    base = heads_dir("tiny-qwen2-seed0", "medusa", cfg, corpus.sha256)
    assert base.parent.name == "tiny-qwen2-seed0" and base.name.startswith("medusa-fp32-c")
    assert base == heads_dir("tiny-qwen2-seed0", "medusa", HeadConfig(checkpoint_minutes=1.0), corpus.sha256)
    others = [heads_dir("tiny-qwen2-seed1", "medusa", cfg, corpus.sha256),
              heads_dir("tiny-qwen2-seed0", "eagle", cfg, corpus.sha256),
              heads_dir("tiny-qwen2-seed0", "medusa", HeadConfig(lr=1e-4), corpus.sha256),
              heads_dir("tiny-qwen2-seed0", "medusa", HeadConfig(vocab=100), corpus.sha256),
              heads_dir("tiny-qwen2-seed0", "medusa", cfg, "f" * 64),
              heads_dir("tiny-qwen2-seed0", "medusa", cfg, corpus.sha256, weight_mode="bf16"),
              heads_dir("tiny-qwen2-seed0", "medusa", HeadConfig(precision="bf16"), corpus.sha256),
              heads_dir("tiny-qwen2-seed0", "medusa", HeadConfig(soft_labels=1.0), corpus.sha256),
              heads_dir("tiny-qwen2-seed0", "eagle", HeadConfig(mlp_size=64), corpus.sha256)]
    assert len({base, *others}) == 10
    # the float32 default hashes as before the setting existed (results trained then keep their key)
    assert "precision" not in cfg.key_fields("medusa")
    assert "precision" in HeadConfig(precision="bf16").key_fields("eagle")
    assert "soft_labels" not in cfg.key_fields("eagle")
    assert "soft_labels" in HeadConfig(soft_labels=0.5).key_fields("eagle")
    assert "mlp_size" not in cfg.key_fields("eagle")  # the target's width hashes as before the setting existed
    assert HeadConfig(mlp_size=64).key_fields("eagle")["mlp_size"] == 64
    assert "mlp_size" not in HeadConfig(mlp_size=64).key_fields("medusa")  # an EAGLE setting
    assert config_hash("eagle", HeadConfig(n_heads=2)) == config_hash("eagle", HeadConfig(n_heads=5))
    assert config_hash("medusa", HeadConfig(n_heads=2)) != config_hash("medusa", HeadConfig(n_heads=5))


def test_load_errors_name_the_problem(trained, tiny_pair, tmp_path):
    path = trained["medusa"].path
    heads = load_heads(path, tiny_pair.target)
    assert isinstance(heads, MedusaHeads) and not heads.training
    assert isinstance(load_heads(path / "checkpoint.pt", tiny_pair.target), MedusaHeads)
    with pytest.raises(ValueError, match=r"trained for target 'tiny-qwen2-seed0', not 'tiny-qwen2-seed1'"):
        load_heads(path, tiny_model(seed=1))
    with pytest.raises(ValueError, match=r"hidden size 64, but target 'tiny-qwen2-seed0' has 32"):
        load_heads(path, tiny_model(seed=0, hidden=32))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "checkpoint.pt")):
        load_heads(tmp_path, tiny_pair.target)
    with pytest.raises(FileNotFoundError, match="no trained heads at"):
        load_heads(tmp_path / "absent", tiny_pair.target)
    assert find_heads("tiny-qwen2-seed0", "eagle") == trained["eagle"].path


# -- reduced vocabulary ---------------------------------------------------------------------------

def test_reduced_vocabulary(tiny_pair, corpus, tmp_path):
    ids = reduced_vocab(corpus.sequences, 10, always=[5])
    assert ids.numel() == 10 and 5 in ids.tolist() and ids.tolist() == sorted(ids.tolist())
    counts = torch.bincount(torch.tensor([t for s in corpus.sequences for t in s]))
    top = [t for t in counts.argsort(descending=True, stable=True).tolist() if t != 5][:9]
    assert set(top) <= set(ids.tolist())
    tokens = [t for s in corpus.sequences for t in s]
    share = out_of_vocab_share(ids, corpus.sequences)
    assert share == pytest.approx(sum(t not in set(ids.tolist()) for t in tokens) / len(tokens))
    assert out_of_vocab_share(None, corpus.sequences) == 0.0
    # a vocabulary larger than the data's distinct tokens: only those, or filled with the first ids
    seen = sorted({t for s in corpus.sequences for t in s} | {5})
    vocab = tiny_pair.target.vocab_size
    assert reduced_vocab(corpus.sequences, len(seen) + 20, always=[5]).tolist() == seen
    low = [t for t in range(vocab) if t not in seen][:20]
    assert reduced_vocab(corpus.sequences, len(seen) + 20, always=[5], fill_to=vocab).tolist() == sorted(seen + low)
    assert reduced_vocab(corpus.sequences, 10 * vocab, fill_to=vocab).tolist() == list(range(vocab))
    assert draft_vocab(tiny_pair.target, corpus, HeadConfig(vocab=len(seen) + 20)).numel() == len(seen) + 20
    assert draft_vocab(tiny_pair.target, corpus, HeadConfig(vocab=len(seen) + 20, vocab_fill=False)).numel() \
        <= len(seen)
    assert draft_vocab(tiny_pair.target, corpus, HeadConfig()) is None
    with pytest.raises(ValueError, match="vocab_fill must be True or False"):
        HeadConfig(vocab_fill="yes")
    heads = MedusaHeads(tiny_pair.target, 2, vocab_map=ids)
    hidden = torch.randn(3, 64)
    full = heads.full_logits(heads.states(hidden))  # (3, 2, V)
    outside = torch.ones(tiny_pair.target.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(full[..., outside]).all() and torch.isfinite(full[..., ids]).all()
    torch.testing.assert_close(full[..., ids], heads(hidden))
    assert heads.label_index(torch.tensor([int(ids[3]), int(outside.nonzero()[0]), -100])).tolist() == [3, -100, -100]
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        MedusaHeads(tiny_pair.target, 2, vocab_map=torch.tensor([0, 10_000]))
    result = train_heads("medusa", tiny_pair.target, corpus, steps=2, out_dir=tmp_path / "r",
                         config=HeadConfig(vocab=40, n_heads=2, window=16, batch_size=2), features=tmp_path / "f",
                         progress=False)
    loaded = load_heads(result.path, tiny_pair.target)
    assert loaded.vocab_map.numel() == 40 and torch.equal(loaded.vocab_map, result.heads.vocab_map)
    drafter = MedusaDrafter(tiny_pair.target, loaded, kary(2, 2))
    for prompt in PROMPTS[:1]:
        ref = plain_generate(tiny_pair.target, prompt, max_new_tokens=16)
        out = speculative_generate(tiny_pair.target, drafter, prompt, max_new_tokens=16)
        assert out.output_ids == ref.output_ids
        allowed = set(loaded.vocab_map.tolist())
        assert all(set(s.tree.tokens[1:].tolist()) <= allowed for s in out.steps)


def test_eagle_drafts_over_its_reduced_vocabulary(tiny_pair, corpus, tmp_path):
    result = train_heads("eagle", tiny_pair.target, corpus, steps=2, out_dir=tmp_path / "r",
                         config=HeadConfig(vocab=40, window=16, batch_size=2), features=tmp_path / "f", progress=False)
    head = load_heads(result.path, tiny_pair.target)
    assert head.scored_vocab == 40
    drafter = EagleDrafter(tiny_pair.target, head, topk=3, depth=3, budget=8)
    allowed = set(head.vocab_map.tolist())
    ctx = encode_prompt(tiny_pair.target.tokenizer, PROMPTS[0])
    tree = drafter.draft(torch.tensor(ctx), GREEDY, "greedy", None)
    # the same tree as growing over the full vocabulary with -inf outside the scored tokens
    with torch.no_grad():
        feats = target_features(tiny_pair.target, ctx[:-1])
        cache = drafters_module._HeadCache(head)
        root = cache.sync(ctx, feats)
        grow = grow_dynamic_tree(ctx[-1], head.full_logits(root), GREEDY, 3, 3, 8)
        predicted, handle = {-1: root}, {-1: -1}
        try:
            frontier = next(grow)
            while True:
                out, handles = cache.expand(torch.stack([predicted[p] for _, _, p in frontier]),
                                            [t for _, t, _ in frontier], [handle[p] for _, _, p in frontier])
                for (i, _, _), h, f in zip(frontier, handles, out):
                    handle[i], predicted[i] = h, f
                frontier = grow.send(head.full_logits(out))
        except StopIteration as done:
            ref = done.value
    assert tree.tokens.tolist() == ref.tokens.tolist() and tree.parents.tolist() == ref.parents.tolist()
    torch.testing.assert_close(tree.q, ref.q)
    assert set(tree.tokens[1:].tolist()) <= allowed and tree.n_nodes > 1
    packed = head.cast("w8a8-token", head_calibration(tiny_pair.target))
    assert isinstance(packed.scorer, W8A8TokenLinear) and packed.scorer.out_features == 40
    got, want = packed.scores(root), head.scores(root)
    # int8 steps of weights and activations (0.9% of the largest score measured)
    assert (got - want).abs().max() <= 0.02 * want.abs().max() and got.argmax() == want.argmax()
    plain = plain_generate(tiny_pair.target, PROMPTS[0], max_new_tokens=16)
    for d in (drafter, EagleDrafter(tiny_pair.target, head, topk=3, depth=3, budget=8, dtype="w8a8-token")):
        out = speculative_generate(tiny_pair.target, d, PROMPTS[0], max_new_tokens=16)
        assert out.output_ids == plain.output_ids
        assert all(set(s.tree.tokens[1:].tolist()) <= allowed for s in out.steps)


@pytest.mark.parametrize("mode", ["w8a8-token", "w4a8-token"])
def test_heads_for_a_target_in_an_integer_weight_mode(corpus, tmp_path, mode):
    # the target's LM head is a packed layer: the heads score with its dequantized weights
    target = make_tiny_pair(dtype=mode).target
    lm = target.model.get_output_embeddings()
    for kind in ("medusa", "eagle"):
        result = train_heads(kind, target, corpus, steps=2, out_dir=tmp_path / kind,
                             config=HeadConfig(vocab=40, n_heads=2, window=16, batch_size=2),
                             features=tmp_path / "f", progress=False)
        heads = load_heads(result.path, target)
        rows = heads.vocab_map.to(torch.long)
        torch.testing.assert_close(heads.out_weight.float(), lm.dequantized_weight()[rows].to(target.model.dtype).float())
        drafter = drafters_module.head_drafter(SimpleNamespace(target=target), result.path, shape=kary(2, 2), topk=2, depth=2,
                               budget=4)
        plain = plain_generate(target, PROMPTS[0], max_new_tokens=12)
        out = speculative_generate(target, drafter, PROMPTS[0], max_new_tokens=12)
        assert out.output_ids == plain.output_ids and out.steps


# -- per-head accuracy ----------------------------------------------------------------------------

def test_head_accuracy(trained, tiny_pair, corpus):
    heads = trained["medusa"].heads
    seqs = corpus.sequences[:2]
    feats = [target_features(tiny_pair.target, s) for s in seqs]
    table = head_accuracy(heads, feats, seqs, k=5, start=list(corpus.prompt_lengths[:2]))
    assert list(table.columns) == ["head", "offset", "top1", "top5", "positions"]
    assert table["head"].tolist() == [1, 2, 3, 4] and table["offset"].tolist() == [2, 3, 4, 5]
    assert (table["top5"] >= table["top1"]).all() and table["top1"].between(0, 1).all()
    # head 2 of one sequence by hand: position t predicts token t + 3
    seq, start = seqs[0], corpus.prompt_lengths[0]
    with torch.no_grad():
        best = heads.full_logits(heads.states(feats[0]))[:, 1].argmax(-1)  # (T,)
    hits = [int(best[t]) == seq[t + 3] for t in range(len(seq) - 3) if t + 3 >= start]
    one = head_accuracy(heads, feats[0], seq, k=1, start=start)
    assert one["positions"][1] == len(hits) == len(seq) - start
    assert one["top1"][1] == pytest.approx(sum(hits) / len(hits))

    ranked = head_accuracy(heads, feats, seqs, k=5, start=list(corpus.prompt_lengths[:2]), by_rank=True)
    assert list(ranked.columns[5:]) == [f"rank_{r}" for r in range(1, 6)]
    assert ranked["rank_1"].tolist() == table["top1"].tolist()
    assert ranked.filter(like="rank_").sum(axis=1).tolist() == pytest.approx(table["top5"].tolist())


def test_medusa_tree_takes_the_best_paths():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.0], [0.9, 0.0, 0.0]]
    # path products: (0) .6, (1) .2, (2) .1, (0,0) .3, (0,1) .18, (0,0,0) .27, (1,0) .1, (0,1,0) .162, ...
    shape = medusa_tree(acc, 5)
    assert set(_paths(shape)) == {(0,), (1,), (0, 0), (0, 1), (0, 0, 0)}
    assert medusa_tree(acc, 1) == chain(1) and shape.depth == 3
    assert expected_tokens_of(shape, acc) == pytest.approx(0.6 + 0.2 + 0.3 + 0.18 + 0.27)
    for budget in range(1, 6):  # best first is optimal: no other parent-closed set of that size does better
        best = max(expected_tokens_of(s, acc) for s in _closed_shapes(acc, budget))
        assert expected_tokens_of(medusa_tree(acc, budget), acc) == pytest.approx(best)
    assert medusa_tree([[1.0, 0.0]], 4) == chain(1)  # only paths with a chance are taken
    table = pd.DataFrame({"head": [1, 2], "rank_2": [0.2, 0.3], "rank_1": [0.6, 0.5]})
    assert medusa_tree(table, 3) == medusa_tree([[0.6, 0.2], [0.5, 0.3]], 3)
    for bad, match in (([[1.5]], "probability"), ([[float("nan")]], "probability"), ([], "at least one"),
                       (pd.DataFrame({"top1": [0.5]}), "by_rank=True")):
        with pytest.raises(ValueError, match=match):
            medusa_tree(bad, 2)
    with pytest.raises(ValueError, match="budget"):
        medusa_tree(acc, 0)


def _paths(shape):
    paths = {0: ()}
    for i in range(1, shape.n_nodes):
        paths[i] = paths[shape.parents[i]] + (shape.ranks[i],)
    return [paths[i] for i in range(1, shape.n_nodes)]


def expected_tokens_of(shape, acc):
    return sum(math.prod(acc[d][r] for d, r in enumerate(p)) for p in _paths(shape))


def _closed_shapes(acc, budget):
    """Every parent-closed set of ``budget`` rank paths of the table (brute force)."""
    nodes = [p for n in range(1, len(acc) + 1) for p in itertools.product(range(len(acc[0])), repeat=n)]
    for combo in itertools.combinations(nodes, budget):
        chosen = set(combo)
        if all(len(p) == 1 or p[:-1] in chosen for p in chosen):
            yield from_paths(chosen)


# -- drafters -------------------------------------------------------------------------------------

def _drafters(tiny_pair, trained):
    medusa, eagle = trained["medusa"].heads, trained["eagle"].heads
    target = tiny_pair.target
    return {
        "medusa": MedusaDrafter(target, medusa),
        "medusa-paths": MedusaDrafter(target, medusa, [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0)]),
        "medusa-kary": MedusaDrafter(target, medusa, kary(2, 2)),
        "eagle": EagleDrafter(target, eagle, topk=3, depth=4, budget=10),
        "eagle-wide": EagleDrafter(target, eagle, topk=4, depth=5, budget=24),
        "eagle-small": EagleDrafter(target, eagle, topk=2, depth=2, budget=3),
        "eagle-chain": EagleDrafter(target, eagle, topk=1, depth=4, budget=4),
        "eagle-bf16": EagleDrafter(target, eagle, topk=3, depth=4, budget=10, dtype="bf16"),
        # merged trees: the heads read the target's hidden states at the merged tree's nodes
        "merged-medusa-ngram": MergedDrafter([MedusaDrafter(target, medusa, kary(2, 2)), NgramDrafter(n=2, k=4)]),
        "merged-eagle-medusa": MergedDrafter([EagleDrafter(target, eagle, topk=2, depth=3, budget=6),
                                              MedusaDrafter(target, medusa, kary(2, 2))]),
        # a shared budget: the lookup's chain first, the EAGLE tree grown to what it leaves (none, at times)
        "merged-budget-ngram-eagle": MergedDrafter([NgramDrafter(n=2, k=4),
                                                    EagleDrafter(target, eagle, topk=3, depth=4, budget=10)], budget=4),
    }


def test_greedy_identity(tiny_pair, trained):
    accepted = 0
    cases = [(p, False) for p in PROMPTS] + [(PROMPTS[0], True)]
    refs = {c: plain_generate(tiny_pair.target, c[0], max_new_tokens=32, chat=c[1]) for c in cases}
    for name, drafter in _drafters(tiny_pair, trained).items():
        for prompt, chat in cases:
            out = speculative_generate(tiny_pair.target, drafter, prompt, max_new_tokens=32, chat=chat)
            assert out.output_ids == refs[prompt, chat].output_ids, (name, prompt, chat)
            accepted += sum(s.acceptance.n_accepted for s in out.steps)
    assert accepted > 0  # the drafts are sometimes right, so accepted paths are exercised


def test_batched_identity_and_engine_features(tiny_pair, trained):
    drafter = EagleDrafter(tiny_pair.target, trained["eagle"].heads, topk=2, depth=3, budget=6)
    outs = speculative_generate_batch(tiny_pair.target, drafter, list(PROMPTS), max_new_tokens=16, chat=False)
    assert any(s.acceptance.n_accepted for out in outs for s in out.steps)
    for prompt, out in zip(PROMPTS, outs):
        assert out.output_ids == plain_generate(tiny_pair.target, prompt, max_new_tokens=16, chat=False).output_ids
    # the features the engine handed over are the target's own
    single = speculative_generate(tiny_pair.target, drafter, PROMPTS[0], max_new_tokens=16, chat=False)
    track = drafter.features
    context = list(single.prompt_ids) + list(single.output_ids)
    assert track.tokens == context[:len(track.tokens)] and len(track.tokens) >= len(single.prompt_ids)
    torch.testing.assert_close(track.features, target_features(tiny_pair.target, track.tokens), atol=1e-4, rtol=1e-4)


def test_drafts_without_the_engine_equal_drafts_in_it(tiny_pair, trained, monkeypatch):
    drafters = _drafters(tiny_pair, trained)
    for drafter in (drafters["medusa"], drafters["eagle"]):
        live = speculative_generate(tiny_pair.target, drafter, PROMPTS[2], max_new_tokens=16, stop_at_eos=False,
                                    chat=False)
        ref = plain_generate(tiny_pair.target, PROMPTS[2], max_new_tokens=16, stop_at_eos=False, chat=False)
        replayed = replay_acceptance(tiny_pair.target, drafter, ref, stop_at_eos=False)  # drafter's own features
        assert [s.tree.tokens.tolist() for s in replayed.steps] == [s.tree.tokens.tolist() for s in live.steps]
        # the same replay from features computed once for the whole recorded sequence, no target forward
        sequence = list(ref.prompt_ids) + list(ref.output_ids)
        drafter.provide_features(sequence, target_features(tiny_pair.target, sequence))
        monkeypatch.setattr(drafters_module, "target_features", _no_target_forward)
        fast = replay_acceptance(tiny_pair.target, drafter, ref, stop_at_eos=False)
        assert [s.tree.tokens.tolist() for s in fast.steps] == [s.tree.tokens.tolist() for s in live.steps]
        monkeypatch.undo()
        drafter.provide_features([], torch.zeros(0, 64))  # forgotten: a live run computes its own again
        other = plain_generate(tiny_pair.target, PROMPTS[1], max_new_tokens=8, stop_at_eos=False, chat=False)
        assert replay_acceptance(tiny_pair.target, drafter, other, stop_at_eos=False).n_new_tokens == 8
    with pytest.raises(ValueError, match=r"features must be \(3, 64\) for 3 token ids, got \(2, 64\)"):
        drafters["medusa"].provide_features([1, 2, 3], torch.zeros(2, 64))


def test_a_merged_tree_hands_provided_features_to_its_head(tiny_pair, trained, monkeypatch):
    """A replay of a budgeted merge of prompt lookup and an EAGLE tree drafts the live run's
    trees from features provided once, through the composite, with no target forward."""
    from functools import partial

    from specviz.draft.merged import merged_drafter
    prompt = "the cat and the dog and the cat and the dog and the"
    make = partial(merged_drafter, parts=[partial(build_drafter, parse_strategy("ngram-n2-k3")),
                                          partial(head_drafter, path=trained["eagle"].path, topk=3, depth=3,
                                                  budget=8)], budget=5)
    live = speculative_generate(tiny_pair.target, make(tiny_pair), prompt, max_new_tokens=16, stop_at_eos=False,
                                chat=False)
    ref = plain_generate(tiny_pair.target, prompt, max_new_tokens=16, stop_at_eos=False, chat=False)
    assert live.output_ids == ref.output_ids
    drafter = make(tiny_pair)
    assert drafter.budget == 5 and drafter.name.startswith("merged(n=5:ngram(n=2,k=3)+eagle(k=3,d=3,n=8")
    sequence = list(ref.prompt_ids) + list(ref.output_ids)
    drafter.provide_features(sequence, target_features(tiny_pair.target, sequence))
    monkeypatch.setattr(drafters_module, "target_features", _no_target_forward)
    replayed = replay_acceptance(tiny_pair.target, drafter, ref, stop_at_eos=False)
    assert [s.tree.tokens.tolist() for s in replayed.steps] == [s.tree.tokens.tolist() for s in live.steps]
    with pytest.raises(ValueError, match="at least one part"):
        merged_drafter(tiny_pair, [])


def test_eagle_tree_within_a_step_limit_is_the_smaller_budgets_tree(tiny_pair, trained):
    from specviz.draft.base import run_draft_steps

    head = load_heads(trained["eagle"].path, tiny_pair.target)
    prompt = "the cat and the dog and the cat and the"
    ids = plain_generate(tiny_pair.target, prompt, max_new_tokens=6, stop_at_eos=False, chat=False)
    context = torch.tensor(list(ids.prompt_ids) + list(ids.output_ids))
    big = EagleDrafter(tiny_pair.target, head, topk=3, depth=3, budget=9)
    small = EagleDrafter(tiny_pair.target, head, topk=3, depth=3, budget=4)
    within = run_draft_steps(big.draft_steps_within(4, context, GREEDY, "greedy", None))
    expected = small.draft(context, GREEDY, "greedy", None)
    assert within.budget == 4 and big.budget == 9
    assert within.tokens.tolist() == expected.tokens.tolist() and within.parents.tolist() == expected.parents.tolist()
    whole = run_draft_steps(big.draft_steps_within(50, context, GREEDY, "greedy", None))
    assert whole.tokens.tolist() == big.draft(context, GREEDY, "greedy", None).tokens.tolist()
    with pytest.raises(ValueError, match="max_nodes"):
        run_draft_steps(big.draft_steps_within(0, context, GREEDY, "greedy", None))


def _no_target_forward(*args, **kwargs):
    raise AssertionError("the drafter ran the target although its features were provided")


def test_merged_trees_hand_the_heads_the_engines_hidden_states(tiny_pair, trained, monkeypatch):
    drafters = _drafters(tiny_pair, trained)
    monkeypatch.setattr(drafters_module, "target_features", _no_target_forward)  # only the engine's states
    for name in ("merged-medusa-ngram", "merged-eagle-medusa", "merged-budget-ngram-eagle"):
        out = speculative_generate(tiny_pair.target, drafters[name], PROMPTS[0], max_new_tokens=16, chat=False)
        assert out.n_new_tokens == 16, name
    # with the lookup taking the whole budget in some steps, the head skips them and still reads the engine's states
    prompt = "the cat and the dog and the cat and the dog and the"
    out = speculative_generate(tiny_pair.target, drafters["merged-budget-ngram-eagle"], prompt, max_new_tokens=24,
                               chat=False)
    sources = [s.tree.source.tolist() for s in out.steps if s.tree.source is not None]
    assert any(src.count(0) == 5 for src in sources)  # root and four lookup nodes: the head left out
    assert all(s.tree.budget <= 4 for s in out.steps)
    assert out.output_ids == plain_generate(tiny_pair.target, prompt, max_new_tokens=24, chat=False).output_ids


def test_a_cascade_hands_the_heads_the_prefill_when_lookup_drafts_first(tiny_pair, trained, monkeypatch):
    """In a cascade whose first part is prompt lookup, the heads may draft only later steps:
    they still read the prefill's and the engine's hidden states, never a target forward of
    their own, and the output is plain decoding's."""
    from specviz.draft.fallback import FallbackDrafter
    drafters = _drafters(tiny_pair, trained)
    monkeypatch.setattr(drafters_module, "target_features", _no_target_forward)
    prompt = "the cat and the dog and the cat and the dog and the"
    ref = plain_generate(tiny_pair.target, prompt, max_new_tokens=24, chat=False)
    for name in ("medusa", "eagle"):
        cascade = FallbackDrafter([NgramDrafter(n=2, k=2, min_n=1), drafters[name]])
        out = speculative_generate(tiny_pair.target, cascade, prompt, max_new_tokens=24, chat=False)
        assert out.output_ids == ref.output_ids, name
        parts = [int(s.tree.source[0]) if s.tree.n_nodes > 1 else None for s in out.steps]
        assert parts[0] == 0 and 1 in parts, (name, parts)  # lookup drafted first, the heads later


def test_drafter_checks(tiny_pair, trained):
    with pytest.raises(ValueError, match="depth 5 but the heads draft only 4"):
        MedusaDrafter(tiny_pair.target, trained["medusa"].heads, chain(5))
    with pytest.raises(TypeError, match="heads must be EagleHead, got MedusaHeads"):
        EagleDrafter(tiny_pair.target, trained["medusa"].heads)
    with pytest.raises(ValueError, match="hidden size 64, but target"):
        MedusaDrafter(tiny_model(seed=0, hidden=32), trained["medusa"].heads)
    drafter = EagleDrafter(tiny_pair.target, trained["eagle"].heads)
    with pytest.raises(ValueError, match="sibling_sampling 'topk'"):
        drafter.draft(torch.tensor([1, 2, 3]), SamplingConfig(temperature=1.0), "iid", None)
    assert drafter.draft(torch.tensor([7]), GREEDY, "greedy", None).n_nodes == 1  # nothing verified yet: no proposal
    assert isinstance(trained["eagle"].heads, EagleHead)


def test_eagle_head_cast_shares_the_target_tensors(tiny_pair, trained):
    head = trained["eagle"].heads
    half = head.cast(torch.bfloat16)
    assert half is not head and head.cast(torch.float32) is head
    assert half.fc.weight.dtype == half.layer.mlp.up_proj.weight.dtype == torch.bfloat16
    assert head.fc.weight.dtype == torch.float32  # the trained head is left as it is
    assert half.embed_weight is head.embed_weight and half.out_weight is head.out_weight
    torch.testing.assert_close(half.fc.weight.float(), head.fc.weight, atol=1e-2, rtol=1e-2)
    drafter = EagleDrafter(tiny_pair.target, head, topk=2, depth=2, budget=4, dtype=torch.bfloat16)
    assert drafter.heads.fc.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown weight mode 'int7'"):
        EagleDrafter(tiny_pair.target, head, dtype="int7")
    with pytest.raises(ValueError, match="floating-point dtype or a weight mode"):
        head.cast(torch.int8)
    with pytest.raises(ValueError, match="w8a8-token needs the input ranges of the eagle heads' layers"):
        head.cast("w8a8-token")
    with pytest.raises(ValueError, match="cast the float32 head"):
        half.cast("w4a8-token")


@pytest.mark.parametrize("mode, layer", [("w8a8-token", W8A8TokenLinear), ("w4a8-token", W4A8TokenLinear)])
def test_eagle_head_in_integer_weight_modes(tiny_pair, trained, mode, layer):
    head = trained["eagle"].heads
    calibrated = parse_weight_mode(mode).calibrated  # smoothed by ranges measured on the target's features
    packed = head.cast(mode, head_calibration(tiny_pair.target) if calibrated else None)
    assert packed.cast(mode) is packed and head.fc.weight.dtype == torch.float32
    assert isinstance(packed.fc, layer) and isinstance(packed.layer.mlp.down_proj, layer)
    # the calibrated modes quantize q/k/v's shared input once (SharedInputSlice of one group)
    assert isinstance(packed.layer.self_attn.q_proj, SharedInputSlice if calibrated else layer)
    assert isinstance(packed.scorer, layer)
    assert packed.embed_weight is head.embed_weight and packed.out_weight is head.out_weight
    # the same predicted features as the float32 head, to the kernels' rounding
    feats = torch.randn(1, 6, head.hidden_size)
    tokens = torch.randint(0, head.vocab_size, (1, 6))
    pos = torch.arange(6)[None]
    with torch.no_grad():
        ref, got = head(feats, tokens, pos), packed(feats, tokens, pos)
    assert got.dtype == parse_weight_mode(mode).activation_dtype
    cos = torch.nn.functional.cosine_similarity(got.float(), ref, dim=-1)
    assert float(cos.min()) > 0.95, cos
    # drafting in the mode stays lossless: greedy output equals plain decoding
    drafter = EagleDrafter(tiny_pair.target, head, topk=2, depth=3, budget=6, dtype=mode)
    assert isinstance(drafter.heads.fc, layer)
    plain = plain_generate(tiny_pair.target, "hello world", max_new_tokens=24, stop_at_eos=False)
    spec = speculative_generate(tiny_pair.target, drafter, "hello world", max_new_tokens=24, stop_at_eos=False)
    assert spec.output_ids == plain.output_ids
    assert sum(len(s.acceptance.accepted_nodes) for s in spec.steps) > 0


@pytest.mark.skipif(w4a8_token_op() is None, reason="the compiled operator is not available")
@pytest.mark.parametrize("context", [9, 20])  # the context fed in one call, or by the modules (over 16 positions)
def test_eagle_head_in_w4a8_token_runs_its_layer_as_one_call(tiny_pair, trained, monkeypatch, context):
    head = trained["eagle"].heads
    fused = head.cast("w4a8-token", head_calibration(tiny_pair.target))
    assert fused._fused_params() is not None and head._fused_params() is None  # float32 heads run the modules
    handle = fused.layer.mlp.register_forward_hook(lambda *a: None)
    assert fused._fused_params() is None  # a hooked layer runs its modules, hook and all ...
    handle.remove()
    assert fused._fused_params() is not None  # ... and one call again without it
    modules = copy.copy(fused)
    modules.fused_layer = False
    assert modules._fused_params() is None
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, head.vocab_size, (1, context), generator=gen)
    feats = torch.randn(1, context, head.hidden_size, generator=gen)
    parents = [-1, -1, 0, 1, 2]
    allowed = tree_attention_mask(parents, context)[None]  # (1, n, context + n)
    nodes = torch.randint(0, head.vocab_size, (1, len(parents)), generator=gen)
    node_feats = torch.randn(1, len(parents), head.hidden_size, generator=gen)
    node_pos = context + torch.tensor([[0, 0, 1, 1, 2]])
    outs = {}
    for name, h in (("fused", fused), ("modules", modules)):
        cache = new_cache(h)
        with torch.no_grad():
            causal = torch.ones(1, context, context, dtype=torch.bool).tril()
            first = h.step(feats, ctx, torch.arange(context)[None], cache, causal)
            if name == "fused":  # the layer's modules are not called
                monkeypatch.setattr(h.layer, "forward", lambda *a, **k: pytest.fail("the modules ran"))
            second = h.step(node_feats, nodes, node_pos, cache, allowed)
            monkeypatch.undo()
        outs[name] = (first, second, cache.layers[0].keys.shape[2])
    for a, b in zip(outs["fused"][:2], outs["modules"][:2]):
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        assert float(cos.min()) > 0.9999, cos  # rounding apart
    assert outs["fused"][2] == outs["modules"][2] == context + len(parents)
    with torch.no_grad(), pytest.raises(ValueError, match="allowed covers"):
        fused.step(node_feats, nodes, node_pos, new_cache(fused), allowed)
    # drafting through it stays lossless
    drafter = EagleDrafter(tiny_pair.target, fused, topk=2, depth=3, budget=6)
    plain = plain_generate(tiny_pair.target, PROMPTS[1], max_new_tokens=24, chat=False)
    spec = speculative_generate(tiny_pair.target, drafter, PROMPTS[1], max_new_tokens=24, chat=False)
    assert spec.output_ids == plain.output_ids
    assert sum(len(s.acceptance.accepted_nodes) for s in spec.steps) > 0


@pytest.mark.parametrize("mode, layer", [(torch.bfloat16, None), ("w8a8-token", W8A8TokenLinear),
                                         ("w4a8-token", W4A8TokenLinear)])
def test_medusa_heads_in_other_weight_modes(tiny_pair, trained, mode, layer):
    heads = trained["medusa"].heads
    calibrated = parse_weight_mode(mode).calibrated
    if calibrated:
        with pytest.raises(ValueError, match="needs the input ranges"):
            heads.cast(mode)
        with pytest.raises(ValueError, match="calibration must be"):
            heads.cast(mode, (torch.zeros(3, heads.hidden_size), torch.zeros(2, dtype=torch.long)))
    packed = heads.cast(mode, head_calibration(tiny_pair.target) if calibrated else None)
    assert packed is not heads and packed.cast(mode) is packed and heads.cast(torch.float32) is heads
    assert heads.blocks[0].weight.dtype == torch.float32  # the trained heads are left as they are
    assert packed.out_weight is heads.out_weight  # the target's LM head rows stay shared
    if layer is None:
        assert packed.blocks[0].weight.dtype == mode and getattr(packed, "scorer", None) is None
    else:
        assert all(isinstance(b, layer) for b in packed.blocks) and isinstance(packed.scorer, layer)
    hidden = torch.randn(5, heads.hidden_size)
    with torch.no_grad():
        ref, got = heads.states(hidden), packed.states(hidden)
        assert got.shape == ref.shape == (5, heads.n_heads, heads.hidden_size)
        assert float(torch.nn.functional.cosine_similarity(got.float(), ref, dim=-1).min()) > 0.95
        torch.testing.assert_close(packed.states(hidden, 2), got[:, :2])  # the first heads alone
        scores = packed.scores(got)
    assert scores.dtype == torch.float32 and scores.shape == (5, heads.n_heads, heads.scored_vocab)
    with pytest.raises(ValueError, match="cast the float32 heads"):
        packed.cast("w8a8-token" if mode != "w8a8-token" else "w4a8-token")
    # drafting in the mode stays lossless: greedy output equals plain decoding
    drafter = MedusaDrafter(tiny_pair.target, heads, dtype=mode)
    assert drafter.name.endswith(f",{parse_weight_mode(mode).name})")
    accepted = 0
    for prompt in PROMPTS:
        plain = plain_generate(tiny_pair.target, prompt, max_new_tokens=24, chat=False)
        spec = speculative_generate(tiny_pair.target, drafter, prompt, max_new_tokens=24, chat=False)
        assert spec.output_ids == plain.output_ids, prompt
        accepted += sum(s.acceptance.n_accepted for s in spec.steps)
    assert accepted > 0  # the drafts are sometimes right, so accepted paths are exercised


def test_registry_builds_head_drafters(tiny_pair, trained):
    assert build_drafter("medusa", tiny_pair).name == "medusa(n=21,d=4)"
    assert build_drafter("medusa-2x1", tiny_pair).name == "medusa(n=4,d=2)"
    assert build_drafter("medusa-w2-d2-b5", tiny_pair).shape.budget == 5
    ranks = [h["rank_accuracy"] for h in trained["medusa"].validation["heads"]]
    assert build_drafter("medusa-b6", tiny_pair).shape == medusa_tree(ranks, 6)
    assert build_drafter("eagle", tiny_pair).name == "eagle(k=4,d=5,n=16)"
    assert build_drafter("eagle-w2-d3-b5", tiny_pair).name == "eagle(k=2,d=3,n=5)"
    chain3 = build_drafter("eagle-chain-k3", tiny_pair)
    assert chain3.name == "eagle-chain(k=3)" and chain3.topk == 1
    # the EAGLE head drafts as trained (fp32) for an fp32 target, packed for another mode on a CPU
    assert chain3.heads.fc.weight.dtype == torch.float32
    # (w4a8-token where the compiled operator runs its VNNI kernel, else w8a8-token where fbgemm
    # runs, else as trained; Medusa's the same)
    half = make_tiny_pair(dtype="bf16")
    from specviz.draft.registry import eagle_head_mode, medusa_head_mode

    e_mode, m_mode = eagle_head_mode(half.target), medusa_head_mode(half.target)
    assert e_mode == m_mode and e_mode in ("w4a8-token", "w8a8-token", None)
    layer = {"w8a8-token": W8A8TokenLinear, "w4a8-token": W4A8TokenLinear, None: torch.nn.Linear}[e_mode]
    suffix = "" if e_mode is None else f",{e_mode}"
    packed = build_drafter("eagle-w2-d2-b4", half)
    assert isinstance(packed.heads.fc, layer) and packed.name == f"eagle(k=2,d=2,n=4{suffix})"
    assert build_drafter("eagle-chain-k2", half).name == f"eagle-chain(k=2{suffix})"
    medusa = build_drafter("medusa-2x1", half)
    assert medusa.name == f"medusa(n=4,d=2{suffix})" and isinstance(medusa.heads.blocks[0], layer)
    assert build_drafter("medusa-2x1", tiny_pair).name == "medusa(n=4,d=2)"
    # and in the target's dtype on an accelerator (bf16 for an fp32 one there)
    from types import SimpleNamespace

    def fake(dtype, device, mode):
        return SimpleNamespace(model=SimpleNamespace(dtype=dtype), device=torch.device(device), weight_mode=mode)

    assert eagle_head_mode(fake(torch.float32, "cpu", "fp32")) is None
    assert eagle_head_mode(fake(torch.float32, "cpu", "w8a8-token")) == e_mode
    assert eagle_head_mode(fake(torch.bfloat16, "cpu", "bf16")) == e_mode
    assert eagle_head_mode(fake(torch.float16, "cuda", "fp16")) == "float16"
    assert eagle_head_mode(fake(torch.float32, "cuda", "fp32")) is None
    assert eagle_head_mode(fake(torch.bfloat16, "mps", "bf16")) == "bfloat16"
    assert medusa_head_mode(fake(torch.float32, "cpu", "fp32")) is None
    assert medusa_head_mode(fake(torch.float32, "cpu", "w8a8-token")) == m_mode
    assert medusa_head_mode(fake(torch.bfloat16, "cpu", "bf16")) == m_mode
    assert medusa_head_mode(fake(torch.float16, "cuda", "fp16")) == "float16"
    assert medusa_head_mode(fake(torch.float32, "cuda", "fp32")) is None
    # head_drafter, which the registry builds with, names the result directory however the heads are given
    from specviz.heads import head_drafter

    for given in (trained["eagle"].path, trained["eagle"].path / "checkpoint.pt"):
        assert head_drafter(tiny_pair, given, topk=1, depth=2, budget=2).heads_path == trained["eagle"].path
    assert chain3.heads_path == trained["eagle"].path
    merged = build_drafter("merged-medusa-b6+ngram-n3-k8", tiny_pair)
    assert merged.drafters[0].shape == medusa_tree(ranks, 6) and merged.drafters[1].name == "ngram(n=3,k=8)"
    assert "hidden" in merged.reads and merged.heads_path == trained["medusa"].path
    assert heads_kinds(parse_strategy("merged-ngram+eagle-chain-k3+medusa+eagle")) == ("eagle", "medusa")
    budgeted = build_drafter("merged-b8-ngram-n3-k4+eagle-w4-d3-b16", tiny_pair)
    assert budgeted.budget == 8 and budgeted.drafters[1].budget == 16 and "hidden" in budgeted.reads
    assert heads_kinds(parse_strategy("merged-b8-ngram+eagle")) == ("eagle",)
    assert heads_kinds(parse_strategy("merged")) == () and heads_kinds(parse_strategy("eagle-chain")) == ("eagle",)


def test_medusa_budget_trees_need_validation_results(tiny_pair, corpus, tmp_path, monkeypatch):
    result = train_heads("medusa", tiny_pair.target, corpus, steps=2, out_dir=tmp_path / "r", features=tmp_path / "f",
                         config=HeadConfig(n_heads=2, window=16, batch_size=2, validation=0.0), progress=False)
    assert result.validation is None
    monkeypatch.setenv(HEADS_ENV, str(result.path))
    assert build_drafter("medusa-2x1", tiny_pair).name == "medusa(n=4,d=2)"  # the listed heads
    with pytest.raises(ValueError, match="record no validation results"):
        build_drafter("medusa-b4", tiny_pair)


# -- command line ---------------------------------------------------------------------------------

def test_cli_tiny_train_and_info(tmp_path, cache, capsys):
    out = tmp_path / "run"
    argv = ["train", "--kind", "medusa", "--tiny", "--steps", "2", "--prompts", "1", "--tasks", "1", "--new-tokens", "6",
            "--window", "16", "--batch", "2", "--heads", "2", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    assert (out / "checkpoint.pt").exists()
    assert "medusa heads for tiny-qwen2-seed0: 2 steps" in capsys.readouterr().out
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "kind: medusa" in text and "step: 2" in text and "finished: True" in text
    assert "validation: 1 sequences" in text and "  head 2: top-1 " in text  # one of the two prompts held out


@pytest.mark.parametrize("argv, message", [
    (["train", "--kind", "hydra", "--tiny", "--steps", "1"], "invalid choice: 'hydra'"),
    (["train", "--kind", "medusa", "--tiny"], "give --steps or --minutes"),
    (["train", "--kind", "medusa", "--steps", "1"], "give --target NAME or --tiny"),
    (["train", "--kind", "medusa", "--tiny", "--steps", "0"], "--steps must be > 0"),
    (["train", "--kind", "medusa", "--tiny", "--steps", "x"], "invalid int value"),
    (["train", "--kind", "medusa", "--tiny", "--steps", "1", "--temperatures", "0,hot"],
     "--temperatures must be numbers"),
    (["train", "--kind", "medusa", "--tiny", "--steps", "1", "--temperatures", "-1"], "values >= 0"),
    (["train", "--kind", "medusa", "--tiny", "--steps", "1", "--decode-batch", "0"], "--decode-batch must be > 0"),
    (["train", "--kind", "medusa", "--tiny", "--steps", "1", "--tasks", "-2"], "--tasks must be >= 0"),
    (["train", "--kind", "medusa", "--tiny", "--steps", "1", "--written", "-1"], "--written must be >= 0"),
    (["train", "--kind", "medusa", "--tiny", "--steps", "1", "--tasks", "0", "--prompts", "0"], "no training prompts"),
    (["train", "--kind", "medusa", "--tiny", "--steps", "1", "--validation", "1.5"], "validation must be a share"),
    (["train", "--kind", "medusa", "--tiny", "--steps", "1", "--soft-labels", "1.5"], "--soft-labels must be a share"),
    (["train", "--kind", "eagle", "--tiny", "--steps", "1", "--mlp-size", "0"], "--mlp-size must be a positive"),
    (["train", "--kind", "eagle", "--tiny", "--steps", "1", "--rollout", "0"], "--rollout must be a positive"),
    (["train", "--kind", "eagle", "--tiny", "--steps", "1", "--rollout-decay", "-1"], "--rollout-decay must be"),
    (["info", "/nonexistent/heads"], "no training result at /nonexistent/heads"),
    ([], "give a command"),
])
def test_cli_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
