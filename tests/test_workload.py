"""The follow-up workload (specviz.bench.workload) on the tiny pair: the requests it builds, one
drafter per strategy across them, live runs for lookahead, the timed comparison and the command."""

import pandas as pd
import pytest

import specviz.bench.workload as workload
from specviz.bench.workload import (FOLLOW_UP, follow_up_references, load_references, save_references,
                                    workload_acceptance, workload_speed)
from specviz.data.prompts import Prompt


PROMPTS = [Prompt(1, "code", ("def add(a, b):",)), Prompt(2, "qa", ("What is the capital of France?", "And of Spain?"))]


@pytest.fixture(scope="module")
def requests(tiny_pair):
    return follow_up_references(tiny_pair.target, PROMPTS, max_new_tokens=12, batch_size=2)


def test_turn_two_carries_the_conversation_and_the_follow_up(tiny_pair, requests):
    tok = tiny_pair.target.tokenizer
    assert [(r.session, r.turn, r.prompt.question_id) for r in requests] == [(0, 1, 1), (0, 2, 1), (1, 1, 2), (1, 2, 2)]
    for first, second in ((requests[0], requests[1]), (requests[2], requests[3])):
        text = tok.decode(second.reference.prompt_ids)
        assert tok.decode(first.reference.output_ids, skip_special_tokens=True).strip() in text
        assert first.prompt.text in text and len(second.reference.output_ids) == 12
    assert FOLLOW_UP in tok.decode(requests[1].reference.prompt_ids)
    assert "And of Spain?" in tok.decode(requests[3].reference.prompt_ids)  # the prompt's own second turn
    with pytest.raises(ValueError, match="at least one prompt"):
        follow_up_references(tiny_pair.target, [])


def test_one_drafter_per_strategy_meets_the_requests_in_order(tiny_pair, requests):
    table = workload_acceptance(tiny_pair, requests, ["suffix", "ngram-trie", "lookahead-w3-n3-g3"], live_sessions=1)
    assert table["matches_reference"].all()  # greedy: every strategy reproduces the target's answers
    counts = table.groupby("strategy", sort=False)["mode"].agg(["first", "size"])
    assert counts.to_dict("index") == {"suffix": {"first": "replay", "size": 4},
                                       "ngram-trie": {"first": "replay", "size": 4},
                                       "lookahead-w3-n3-g3": {"first": "live", "size": 2}}
    assert (table["tau"] >= 1).all() and (table["new_tokens"] == 12).all()


def test_timed_runs_and_the_command(tiny_pair, requests, tmp_path, monkeypatch, capsys):
    speed = workload_speed(tiny_pair, requests, ["suffix", "ngram"], sessions=2)
    assert list(speed["method"]) == ["plain", "suffix", "ngram", "plain", "ngram", "suffix"]  # rotating order
    assert speed["matches_plain"].all() and (speed["speedup"] > 0).all()
    monkeypatch.setattr(workload, "load_pair", lambda dtype: tiny_pair)
    monkeypatch.setattr(workload, "load_prompts", lambda limit: PROMPTS[:limit])
    out = tmp_path / "w.csv"
    assert workload.main(["--limit", "1", "--max-new-tokens", "6", "--strategies", "suffix,ngram",
                          "--timed-sessions", "1", "--out", str(out)]) == 0
    table = pd.read_csv(out)
    assert set(table["strategy"]) == {"suffix", "ngram"} and len(table) == 4
    assert table["command"].iloc[0].startswith("python -m specviz.bench.workload --limit 1")
    assert set(pd.read_csv(out.with_suffix(".speed.csv"))["method"]) == {"plain", "suffix", "ngram"}
    summary = pd.read_csv(out.with_suffix(".summary.csv"))
    assert list(summary["turn"]) == [1, 2, 1, 2] and (summary["tau"] == summary["new_tokens"] / summary["steps"]).all()
    with pytest.raises(SystemExit):
        workload.main(["--strategies", "sufix", "--out", str(out)])
    assert "unknown strategy 'sufix'" in capsys.readouterr().err


def test_references_are_saved_and_a_rerun_decodes_nothing(tiny_pair, requests, tmp_path, monkeypatch, capsys):
    path = save_references(requests, tmp_path / "w.references.jsonl")
    back = load_references(path)
    assert [(r.session, r.turn, r.prompt, r.reference.prompt_ids, r.reference.output_ids) for r in back] == \
        [(r.session, r.turn, r.prompt, r.reference.prompt_ids, r.reference.output_ids) for r in requests]

    def no_decoding(*args, **kwargs):
        raise AssertionError("the references were decoded again")

    monkeypatch.setattr(workload, "follow_up_references", no_decoding)
    monkeypatch.setattr(workload, "load_pair", lambda dtype: tiny_pair)
    out = tmp_path / "again.csv"
    assert workload.main(["--references", str(path), "--strategies", "suffix", "--timed-sessions", "0", "--arctic",
                          "--out", str(out)]) == 0
    assert len(pd.read_csv(out)) == len(requests)
    err = capsys.readouterr().err
    assert "does not import here" in err or out.with_suffix(".arctic.csv").exists()
    path.write_text(path.read_text() + '{"session": 9}\n')
    with pytest.raises(ValueError, match=r"references.jsonl, line 5: expected a workload request"):
        load_references(path)
