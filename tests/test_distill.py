"""Distilling a draft towards its target (specviz.heads.distill) on the tiny pair: the
divergences, a run that raises held-out agreement, resuming and the cache, the distilled
draft in the engine, the refusal beside another target, and the command line."""

import json
import math

import pytest
import torch

from specviz.decode.engine import plain_generate, speculative_generate
from specviz.draft.registry import build_drafter
from specviz.heads import build_corpus
from specviz.heads.__main__ import main
from specviz.heads.distill import DIVERGENCES, DistillConfig, distill_draft, divergence
from specviz.models.loading import DISTILLED_META, load_model, load_pair


@pytest.fixture(scope="module")
def corpus(tiny_pair, cache):
    return build_corpus(tiny_pair.target, prompts=3, tasks=3, max_new_tokens=24, temperatures=(0.0,),
                        max_prompt_chars=200, progress=False)


def test_divergences_against_their_definitions():
    gen = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(5, 11, generator=gen), torch.randn(5, 11, generator=gen)
    p, q = p_logits.softmax(-1), q_logits.softmax(-1)
    kl = lambda a, b: (a * (a / b).log()).sum(-1).mean()  # noqa: E731
    m = (p + q) / 2
    expected = {"fkl": kl(p, q), "rkl": kl(q, p), "jsd": (kl(p, m) + kl(q, m)) / 2,
                "tvd": 0.5 * (p - q).abs().sum(-1).mean()}
    for kind in DIVERGENCES:
        assert divergence(p_logits, q_logits, kind).item() == pytest.approx(expected[kind].item(), rel=1e-5)
        assert divergence(p_logits, p_logits, kind).item() == pytest.approx(0.0, abs=1e-6)
    assert divergence(p_logits, q_logits, "jsd").item() == pytest.approx(divergence(q_logits, p_logits, "jsd").item())
    assert 0 <= divergence(p_logits, q_logits, "jsd").item() <= math.log(2)
    q_logits.requires_grad_(True)
    divergence(p_logits, q_logits, "fkl").backward()  # the student's side is differentiated
    assert q_logits.grad is not None and q_logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="divergence must be one of"):
        divergence(p_logits, q_logits, "kl")


@pytest.mark.parametrize("kwargs, message", [
    ({"divergence": "l2"}, "divergence must be one of"), ({"lora_rank": 0}, "lora_rank must be"),
    ({"lr": 0}, "lr must be > 0"), ({"validation": 1.0}, "validation must be a share"),
    ({"max_tokens": 1}, "max_tokens must be"),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistillConfig(**kwargs)


def test_distillation_raises_held_out_agreement_resumes_and_is_cached(tiny_pair, corpus, tmp_path):
    config = DistillConfig(lr=3e-3, eval_every=5, validation=0.25, checkpoint_minutes=1e-6)
    out = tmp_path / "run"
    first = distill_draft(tiny_pair.target, tiny_pair.draft, corpus, steps=5, config=config, out_dir=out,
                          progress=False)
    assert first.step == 5 and not (out / "checkpoint.pt").exists()
    meta = json.loads((out / DISTILLED_META).read_text())
    assert meta["finished"] and meta["target"] == tiny_pair.target.name and meta["data"]["sha256"] == corpus.sha256
    # a finished result is returned as it is, whatever the budget asked for
    again = distill_draft(tiny_pair.target, tiny_pair.draft, corpus, steps=50, config=config, out_dir=out,
                          progress=False)
    assert again.step == 5 and again.after == first.after
    # an interrupted run resumes from its checkpoint: 5 steps, then 20 in all
    other = tmp_path / "resumed"
    state = {"calls": 0}

    def interrupt(teacher, student, kind):
        state["calls"] += kind == "fkl"  # the training loss (held-out agreement uses "tvd")
        if state["calls"] == 6:
            raise KeyboardInterrupt
        return real(teacher, student, kind)

    import specviz.heads.distill as distill
    real = distill.divergence
    distill.divergence = interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            distill_draft(tiny_pair.target, tiny_pair.draft, corpus, steps=20, config=config, out_dir=other,
                          progress=False)
    finally:
        distill.divergence = real
    assert (other / "checkpoint.pt").exists()
    assert json.loads((other / DISTILLED_META).read_text())["step"] == 5
    done = distill_draft(tiny_pair.target, tiny_pair.draft, corpus, steps=20, config=config, out_dir=other,
                         progress=False)
    assert done.step == 20
    assert done.after["top1"] > done.before["top1"]  # the noisy tiny draft moves towards its target
    assert done.after["accept"] > done.before["accept"]
    with pytest.raises(ValueError, match="holds a distillation of other settings"):
        distill_draft(tiny_pair.target, tiny_pair.draft, corpus, steps=1, out_dir=other, progress=False,
                      config=DistillConfig(divergence="tvd"))
    with pytest.raises(ValueError, match="distil the draft in fp32"):
        distill_draft(tiny_pair.target, load_model(tiny_pair.draft, "bf16"), corpus, steps=1, progress=False)
    with pytest.raises(ValueError, match="give steps or minutes"):
        distill_draft(tiny_pair.target, tiny_pair.draft, corpus, progress=False)


def test_a_distilled_draft_drafts_losslessly_and_only_for_its_target(tiny_pair, corpus, tmp_path):
    out = tmp_path / "distilled"
    distill_draft(tiny_pair.target, tiny_pair.draft, corpus, steps=3, config=DistillConfig(validation=0),
                  out_dir=out, progress=False)
    draft = load_model(str(out), "fp32")
    pair = load_pair(tiny_pair.target, str(out))
    assert pair.draft.name == str(out)
    prompt = "def add(a, b):"
    plain = plain_generate(tiny_pair.target, prompt, max_new_tokens=16).output_ids
    for strategy in ("chain-k3", "dynamic-w2-d3-b6"):
        got = speculative_generate(tiny_pair.target, build_drafter(strategy, pair), prompt, max_new_tokens=16)
        assert got.output_ids == plain  # greedy: the target's own output, whatever the draft
    assert draft.vocab_size == tiny_pair.target.vocab_size
    meta = json.loads((out / DISTILLED_META).read_text())
    (out / DISTILLED_META).write_text(json.dumps({**meta, "target": "another-target"}))
    with pytest.raises(ValueError, match="distilled towards 'another-target'"):
        load_pair(tiny_pair.target, str(out))


def test_cli_tiny_distill(tmp_path, cache, capsys):
    out = tmp_path / "cli"
    argv = ["distill", "--tiny", "--steps", "2", "--prompts", "1", "--tasks", "1", "--new-tokens", "6",
            "--on-policy", "1", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "tiny-qwen2-seed0-draft distilled towards tiny-qwen2-seed0: 2 steps" in printed and str(out) in printed
    assert (out / "config.json").exists() and (out / DISTILLED_META).exists()


@pytest.mark.parametrize("argv, message", [
    (["distill", "--steps", "1"], "give --target NAME or --tiny"),
    (["distill", "--tiny", "--draft", "x", "--steps", "1"], "leave out --draft"),
    (["distill", "--tiny", "--steps", "0"], "--steps must be > 0"),
    (["distill", "--tiny", "--steps", "1", "--divergence", "kl"], "invalid choice: 'kl'"),
    (["distill", "--tiny", "--steps", "1", "--on-policy", "-1"], "--on-policy must be >= 0"),
    (["distill", "--tiny", "--steps", "1", "--lora-rank", "0"], "lora_rank must be"),
])
def test_cli_distill_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
