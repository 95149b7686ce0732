"""The slow-check machinery (specviz.checks) on the tiny pair, so the real-model command
``python -m specviz.checks`` cannot rot unnoticed."""

import json
import math

import pytest
import torch

from specviz.checks.__main__ import main
from specviz.checks.identity import (
    DrafterCheck,
    Mismatch,
    check_identity,
    compare_schedules,
    format_checks,
    format_schedules,
    logit_gap,
)
from specviz.decode.engine import encode_prompt
from specviz.draft.model import ChainDrafter, DynamicTreeDrafter
from specviz.draft.ngram import NgramDrafter
from specviz.data.store import ResultStore

PROMPTS = ["def square(x):", "Name three colours."]


def test_identity_check_passes_on_an_exact_engine(tiny_pair):
    drafters = [ChainDrafter(tiny_pair.draft, 3), DynamicTreeDrafter(tiny_pair.draft, 2, 3, 5), NgramDrafter(n=2)]
    checks = check_identity(tiny_pair, PROMPTS, drafters, 12, log=lambda _: None)
    assert [c.drafter for c in checks] == [d.name for d in drafters]
    for c in checks:
        assert c.identical == c.n_prompts == 2 and c.match_rate == 1.0 and c.token_match_rate == 1.0
        assert c.mismatches == () and c.tau >= 1.0
    text = format_checks(checks)
    assert "chain(k=3)" in text and "2/2" in text


def test_identity_check_resumes_from_its_store(tiny_pair, tmp_path, monkeypatch):
    path = tmp_path / "partial" / "checks.jsonl"
    chain3 = ChainDrafter(tiny_pair.draft, 3)
    first = check_identity(tiny_pair, PROMPTS, [chain3], 10, log=lambda _: None, store=ResultStore(path))
    # a rerun reads every finished unit back instead of decoding again
    import specviz.checks.identity as checks_module

    def no_decoding(*args, **kwargs):
        raise AssertionError("a finished unit was recomputed")

    import specviz.decode.replay as sweep_module

    monkeypatch.setattr(sweep_module, "plain_generate", no_decoding)
    monkeypatch.setattr(checks_module, "speculative_generate_batch", no_decoding)
    again = check_identity(tiny_pair, PROMPTS, [chain3], 10, log=lambda _: None, store=ResultStore(path))
    assert again == first
    # a drafter the store has not seen yet still runs
    with pytest.raises(AssertionError, match="recomputed"):
        check_identity(tiny_pair, PROMPTS, [NgramDrafter(n=2)], 10, log=lambda _: None, store=ResultStore(path))
    # a result stored for other prompts is not reused: the drafter runs again
    with pytest.raises(AssertionError, match="recomputed"):
        check_identity(tiny_pair, PROMPTS[:1], [chain3], 10, log=lambda _: None, store=ResultStore(path))


def test_logit_gap_reads_the_targets_own_logits(tiny_pair):
    target = tiny_pair.target
    ids = encode_prompt(target.tokenizer, PROMPTS[0])
    with torch.no_grad():
        logits = target.model(torch.tensor([ids])).logits[0, -1]
    gap, top, step = logit_gap(target, ids, 5, 9)
    assert gap == pytest.approx(float(logits[5] - logits[9]), abs=1e-5)
    assert top == pytest.approx(max(float(logits[5]), float(logits[9])), abs=1e-5)
    assert 0 < step <= abs(top) * torch.finfo(torch.float32).eps


def test_mismatches_are_listed_with_their_gap():
    check = DrafterCheck("d", "bf16", 2, 1, 70, 100, 2.5,
                         (Mismatch(1, 30, 11, 12, 0.0625, 17.25, 0.0625),), 3.0)
    assert check.match_rate == 0.5 and check.token_match_rate == 0.7
    assert "logit gap +0.0625 at logit 17.250 (rounding step 0.0625)" in format_checks([check])
    empty = DrafterCheck("d", "fp32", 1, 1, 0, 0, 1.0, (), 0.0)
    assert math.isnan(empty.token_match_rate)


def test_schedule_comparison_runs_by_replay(tiny_pair):
    results = compare_schedules(tiny_pair, PROMPTS, 16, cost_ratio=0.3, log=lambda _: None)
    names = [r.drafter for r in results]
    assert names == ["chain(k=2)", "chain(k=4)", "chain(k=6)", "adaptive-heuristic", "adaptive-throughput"]
    for r in results:
        assert r.new_tokens == 32 and r.tau >= 1.0 and r.modelled_speedup > 0
    assert "adaptive-throughput" in format_schedules(results)


def test_command_line_rejects_unknown_sections(capsys):
    with pytest.raises(SystemExit):
        main(["--sections", "identity,speed"])
    assert "unknown sections ['speed']" in capsys.readouterr().err


def test_command_line_rejects_unknown_accuracy_modes(capsys):
    with pytest.raises(SystemExit):
        main(["--sections", "accuracy", "--accuracy-modes", "bf16,int3"])
    assert "unknown --accuracy-modes ['int3']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--sections", "accuracy", "--chunk", "0"])
    assert "--chunk must be >= 1" in capsys.readouterr().err


def test_accuracy_section_labels_modes_against_the_bar(tiny_pair, tmp_path, monkeypatch, capsys):
    import specviz.checks.__main__ as cli
    from specviz.models.loading import load_model

    monkeypatch.setattr(cli, "load_model", lambda name, mode, device=None: load_model(tiny_pair.target, mode, device=device))
    monkeypatch.setattr(cli, "OUTPUTS_DIR", tmp_path, raising=False)
    out = tmp_path / "acc.json"
    assert main(["--sections", "accuracy", "--prompts", "2", "--tokens", "6", "--accuracy-modes", "bf16,w4a8-token",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())["accuracy"]
    bar = {row["weight_mode"]: row for row in report["bar"]}
    assert set(bar) == {"bf16", "w4a8-token"} and report["chunk"] == 4
    assert bar["bf16"]["bar"] == pytest.approx(bar["bf16"]["agreement"] - 0.02)
    assert bar["w4a8-token"]["lossy"] == (bar["w4a8-token"]["agreement"] < bar["w4a8-token"]["bar"])
    assert "weight_mode" in capsys.readouterr().out
