"""The benchmark command line (specviz.bench) on the tiny random pair: CSV rows and columns,
the definitions behind them, the summary line, resuming, and the exit status of bad input."""

import json
import re

import pandas as pd
import pytest

from specviz.models.tiny import tiny_pair

import specviz.bench.__main__ as cli
import specviz.bench.cost_passes as cost_passes
import specviz.bench.e2e as bench

PROMPTS = (
    {"question_id": 1, "category": "code", "turns": ["def add(a, b): return a + b\ndef add(a, b): return"]},
    {"question_id": 2, "category": "qa", "turns": ["What is the capital of France? The capital of France is"]},
    {"question_id": 3, "category": "code", "turns": ["Write fizzbuzz in Python."]},
)
METHODS = ("plain", "hf-assisted", "hf-prompt-lookup", "specviz-plain", "chain-k2", "ngram")
SUMMARY = re.compile(
    r"^best specviz strategy: (\S+) \| mean speedup (\d+\.\d\d)x over plain decoding"
    r" \| (\d+\.\d\d)x hf-assisted's speedup \((\d+\.\d\d)x\)$")


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.fixture
def use_tiny(monkeypatch, tiny_pair):
    """Serve the session's tiny pair instead of building one per call (the CLI would)."""
    monkeypatch.setattr(cli, "_load_models", lambda args: tiny_pair)


def _argv(prompts_file, out, *extra, methods=METHODS):
    return ["--models", "tiny", "--dtype", "fp32", "--prompts", str(prompts_file), "--limit", "2",
            "--max-new-tokens", "8", "--warmup-tokens", "2", "--out", str(out), "--methods", *methods, *extra]


def _last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_parse_method_grammar():
    assert bench.parse_method("tree-2x2x1").params == (("branching", (2, 2, 1)),)
    assert bench.parse_method("dynamic-w2-d3-b6").params == (("topk", 2), ("depth", 3), ("budget", 6))
    assert bench.parse_method("ngram-trie").family == "ngram-trie"
    assert bench.parse_method("ngram").family == "ngram"
    assert bench.parse_method("hf-prompt-lookup-k4").param("k") == 4
    spec = bench.parse_method("self-spec-L3-k2")
    assert spec.is_strategy and spec.params == (("n_layers", 3), ("k", 2))
    assert not bench.parse_method("specviz-plain").is_strategy
    assert bench.parse_method("chain-k4").verifier(0.7) == "chain"
    assert bench.parse_method("dynamic").verifier(0.7) == "topk"
    assert bench.parse_method("dynamic").verifier(0.0) == "greedy"
    assert bench.parse_method("hf-assisted").verifier(0.0) == ""
    with pytest.raises(ValueError, match="unknown method 'beam'.*chain-k<K>"):
        bench.parse_method("beam")
    with pytest.raises(ValueError, match="k must be >= 1"):
        bench.parse_method("chain-k0")


def test_greedy_run_writes_rows_and_summary(prompts_file, tmp_path, capsys, use_tiny):
    out = tmp_path / "greedy.csv"
    assert cli.main(_argv(prompts_file, out)) == 0
    printed = capsys.readouterr().out
    match = SUMMARY.match(printed.strip().splitlines()[-1])
    assert match and match.group(1) in ("chain-k2", "ngram")
    # the cost curve's passes: before the rounds and after each of the 2 rounds
    assert re.search(r"one-token forward \d+ ms, \d+-\d+ over 3 passes", printed)

    rows = bench.load_results(out)
    assert list(rows.columns) == list(bench.COLUMNS)
    assert len(rows) == len(METHODS) * 2
    assert set(rows["method"]) == set(METHODS)
    assert set(zip(rows["question_id"], rows["category"])) == {(1, "code"), (2, "qa")}  # round-robin limit
    assert (rows["new_tokens"] == 8).all() and (rows["max_new_tokens"] == 8).all()
    # every method of a prompt saw the same prompt ids
    assert rows.groupby("question_id")["prompt_tokens"].nunique().eq(1).all()
    # each prompt's methods ran in a different rotation
    assert set(rows[rows["method"] == "plain"]["position"]) == {0, len(METHODS) - 1}

    plain = rows[rows["method"] == "plain"]
    assert (plain["speedup"] == 1.0).all() and (plain["tau"] == 1.0).all() and (plain["drafted"] == 0).all()
    # tiny fp32 models: every method reproduces plain greedy decoding
    assert rows["matches_plain"].astype(str).eq("True").all()
    assert (rows["prefix_match"] == 8).all()
    for _, r in rows.iterrows():
        assert r["speedup"] == pytest.approx(
            r["tokens_per_s"] / plain.set_index("question_id").loc[r["question_id"], "tokens_per_s"])
        assert r["tau"] == pytest.approx(r["new_tokens"] / r["steps"])
        assert 0 <= r["accepted"] <= r["drafted"]
        assert r["steps"] <= r["target_calls"] <= r["steps"] + 1  # specviz adds one prefill call
    timed = rows["method"].isin(["chain-k2", "ngram"])
    assert (rows.loc[timed, "draft_s"] > 0).all() and (rows.loc[timed, "verify_s"] > 0).all()
    # the device's bandwidth on every row; plain decoding's bandwidth bound on the plain rows only
    assert (rows["bandwidth_gb_s"] > 0).all() and rows["device_name"].astype(str).str.len().gt(0).all()
    plain_rows = rows["method"].isin(bench.PLAIN_METHODS)
    assert set(rows.loc[plain_rows, "method"]) == {"plain", "specviz-plain"}
    assert (rows.loc[plain_rows, "bound_tokens_per_s"] > 0).all()
    assert rows.loc[~plain_rows, "bound_tokens_per_s"].isna().all()
    assert re.search(r"memory bandwidth \d+\.\d GB/s \(copy\) on .+: plain decoding's bound \d+\.\d tokens/s",
                     printed)
    assert rows.loc[~timed, ["draft_s", "verify_s"]].isna().all().all()
    assisted = rows[rows["method"] == "hf-assisted"]
    assert (assisted["drafted"] > 0).all() and (assisted["target_calls"] < 8).all()

    # the cost model: the target's curve and prefills, kept next to the CSV, price every strategy row
    # (timed before the rounds, then once more after each round)
    costs = pd.read_csv(tmp_path / "greedy.costs.csv")
    rounds = [f"q{q}-r0" for q in dict.fromkeys(rows["question_id"])]
    assert list(dict.fromkeys(costs["pass"])) == [cost_passes.BEFORE_ROUNDS] + rounds
    for label in [cost_passes.BEFORE_ROUNDS] + rounds:
        mine = costs[costs["pass"] == label]
        assert list(mine.loc[mine["prefix_len"] > 0, "n_tokens"]) == list(cost_passes.CURVE_SIZES)
    before = costs[costs["pass"] == cost_passes.BEFORE_ROUNDS]
    assert set(before.loc[before["prefix_len"] == 0, "n_tokens"]) == set(rows["prompt_tokens"] - 1)
    for q, label in zip(dict.fromkeys(rows["question_id"]), rounds):  # each round's own prompt
        mine = costs[(costs["pass"] == label) & (costs["prefix_len"] == 0)]
        assert list(mine["n_tokens"]) == [int(rows.loc[rows["question_id"] == q, "prompt_tokens"].iloc[0]) - 1]
    wall = cost_passes.predicted_wall(rows, tmp_path / "greedy.costs.csv")
    assert wall[timed].gt(0).all() and wall[~timed].isna().all()
    predicted = bench.summarize(rows, METHODS, wall).per_method.set_index("method")
    for method in ("chain-k2", "ngram"):
        r = rows[rows["method"] == method]
        want = (r["speedup"] * r["wall_s"] / wall[r.index]).mean()
        assert predicted.loc[method, "predicted"] == pytest.approx(want)
        assert predicted.loc[method, "error"] == pytest.approx(predicted.loc[method, "speedup"] / want - 1)
    assert predicted.loc[["plain", "hf-assisted"], "predicted"].isna().all()

    summary = bench.summarize(rows, METHODS)
    assert "predicted" not in summary.per_method.columns
    assert list(summary.per_method["method"]) == list(METHODS)
    assert list(summary.per_category.columns) == ["code", "qa"]
    hf = summary.per_method.set_index("method").loc["hf-assisted"]
    assert hf["vs_hf_assisted"] == pytest.approx(1.0)
    assert summary.ratio_to_assisted == pytest.approx(summary.best_speedup / hf["speedup"])


def test_resume_skips_done_rows_and_runs_new_ones(prompts_file, tmp_path, capsys, monkeypatch, tiny_pair):
    out = tmp_path / "resume.csv"
    monkeypatch.setattr(cli, "_load_models", lambda args: tiny_pair)
    assert cli.main(_argv(prompts_file, out, methods=("plain", "ngram"))) == 0
    first = bench.load_results(out)
    assert len(first) == 4

    def no_models(args):
        raise AssertionError("nothing to run, yet the models were loaded")

    # the same command again: nothing to run, the same summary
    monkeypatch.setattr(cli, "_load_models", no_models)
    capsys.readouterr()
    assert cli.main(_argv(prompts_file, out, methods=("plain", "ngram"))) == 0
    printed = capsys.readouterr().out
    assert "4 already there, 0 to run" in printed
    assert printed.strip().splitlines()[-1].startswith("best specviz strategy: ngram | mean speedup ")
    assert "hf-assisted not measured" in printed.strip().splitlines()[-1]
    pd.testing.assert_frame_equal(bench.load_results(out), first)

    # a new method runs alone, against the plain rows already there
    monkeypatch.setattr(cli, "_load_models", lambda args: tiny_pair)
    assert cli.main(_argv(prompts_file, out, methods=("plain", "ngram", "chain-k2"))) == 0
    rows = bench.load_results(out)
    assert len(rows) == 6
    pd.testing.assert_frame_equal(rows.iloc[:4], first)
    new = rows[rows["method"] == "chain-k2"]
    plain_tps = first[first["method"] == "plain"].set_index("question_id")["tokens_per_s"]
    assert (new["speedup"].to_numpy() == pytest.approx(
        (new["tokens_per_s"] / new["question_id"].map(plain_tps)).to_numpy()))
    assert new["matches_plain"].astype(str).eq("True").all()

    # other settings do not mix into the same file; --fresh starts over
    assert cli.main(_argv(prompts_file, out, "--max-new-tokens", "6", methods=("plain",))) == 2
    assert "max_new_tokens" in capsys.readouterr().err
    costs = tmp_path / "resume.costs.csv"
    measured = pd.read_csv(costs)
    # timed before the first run's rounds (the curve and 2 prompt lengths), then after each round of the first
    # run and of the one that added chain-k2 (2 prompts each); the resume with nothing to run timed nothing
    assert len(measured) == (1 + 4) * len(cost_passes.CURVE_SIZES) + 2 + 4
    assert list(measured["pass"]).count(cost_passes.BEFORE_ROUNDS) == len(cost_passes.CURVE_SIZES) + 2
    assert cli.main(_argv(prompts_file, out, "--fresh", methods=("plain",))) == 0
    assert len(bench.load_results(out)) == 2
    assert not costs.exists()  # the costs went with the rows they priced (and a peers-only run times none)
    assert cli.main(_argv(prompts_file, tmp_path / "quick.csv", "--no-predict", methods=("plain", "ngram"))) == 0
    assert not (tmp_path / "quick.costs.csv").exists() and " predicted " not in capsys.readouterr().out


def test_resuming_a_file_from_before_the_bandwidth_columns(prompts_file, tmp_path, use_tiny):
    out = tmp_path / "old.csv"
    argv = ("--no-predict", "--limit", "1")
    assert cli.main(_argv(prompts_file, out, *argv, methods=("plain",))) == 0
    pd.read_csv(out).drop(columns=["device_name", "bandwidth_gb_s", "bound_tokens_per_s"]).to_csv(out, index=False)
    old = bench.load_results(out)
    assert list(old.columns) == list(bench.COLUMNS) and old["bandwidth_gb_s"].isna().all()
    assert cli.main(_argv(prompts_file, out, *argv, methods=("plain", "ngram"))) == 0
    assert list(pd.read_csv(out, nrows=0).columns) == list(bench.COLUMNS)  # rewritten before the new rows
    rows = bench.load_results(out)
    assert len(rows) == 2 and rows.loc[rows["method"] == "plain", "bandwidth_gb_s"].isna().all()
    assert (rows.loc[rows["method"] == "ngram", "bandwidth_gb_s"] > 0).all()


def test_sampling_run(prompts_file, tmp_path, capsys, use_tiny):
    out = tmp_path / "sampled.csv"
    argv = _argv(prompts_file, out, "--temperature", "0.7", "--limit", "1",
                 methods=("plain", "hf-prompt-lookup", "tree-2x1", "ngram-trie"))
    assert cli.main(argv) == 0
    assert re.match(r"^best specviz strategy: (tree-2x1|ngram-trie) \| mean speedup \d+\.\d\dx over plain "
                    r"decoding \| hf-assisted not measured$", _last_line(capsys))
    rows = bench.load_results(out)
    assert len(rows) == 4 and (rows["temperature"] == 0.7).all()
    assert rows["matches_plain"].isna().all()  # identity is a greedy notion
    assert set(rows.loc[rows["method"].isin(["tree-2x1", "ngram-trie"]), "verifier"]) == {"topk"}


@pytest.mark.parametrize("extra, message", [
    (("--methods", "plain", "beam-4"), "unknown method 'beam-4'"),
    (("--limit", "0"), "--limit must be >= 1"),
    (("--max-new-tokens", "0"), "--max-new-tokens must be >= 1"),
    (("--temperature", "-1"), "--temperature must be"),
    (("--verifier", "nope"), "unknown --verifier 'nope'"),
    (("--limit", "two"), "invalid int value"),
    (("--threads", "0"), "--threads must be >= 1"),
    (("--repeats", "0"), "--repeats must be >= 1"),
    (("--dtype", "int3"), "--dtype: unknown weight mode 'int3'"),
    (("--heads", "/nonexistent/heads"), "--heads: /nonexistent/heads holds no trained heads"),
])
def test_bad_arguments_exit_2(prompts_file, tmp_path, capsys, extra, message):
    argv = ["--models", "tiny", "--prompts", str(prompts_file), "--out", str(tmp_path / "x.csv"), *extra]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.csv").exists()


def test_weight_modes_and_the_bf16_baseline(prompts_file, tmp_path, capsys, monkeypatch):
    pair = tiny_pair(dtype="w8a8-token")
    monkeypatch.setattr(cli, "_load_models", lambda args: pair)
    out = tmp_path / "w8a8-token.csv"
    argv = _argv(prompts_file, out, methods=("plain", "chain-k2"))
    argv[argv.index("--dtype") + 1] = "w8a8-token"
    assert cli.main(argv) == 0
    rows = bench.load_results(out)
    assert set(rows.dtype) == {"w8a8-token"} and set(rows.method) == {"plain", "chain-k2"}
    # plain-bf16 runs the target cast to bf16 next to the run's own mode (here fp32).
    fp32 = tiny_pair()
    monkeypatch.setattr(cli, "_load_models", lambda args: fp32)
    assert cli.main(_argv(prompts_file, tmp_path / "fp32.csv", methods=("plain", "plain-bf16"))) == 0
    rows = bench.load_results(tmp_path / "fp32.csv")
    assert (rows.loc[rows.method == "plain-bf16", "new_tokens"] > 0).all()
    assert fp32.target.weight_mode == "fp32"  # the twin is a copy


def test_bad_prompt_files_exit_2(tmp_path, capsys):
    assert cli.main(["--models", "tiny", "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "prompt file not found" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question_id": 1, "category": "qa"}\n')
    assert cli.main(["--models", "tiny", "--prompts", str(broken)]) == 2
    assert "line 1: missing key(s) 'turns'" in capsys.readouterr().err


def test_list_methods(capsys):
    assert cli.main(["--list-methods"]) == 0
    text = capsys.readouterr().out
    for rule in bench.METHOD_GRAMMAR:
        assert rule.usage in text


def test_attention_subcommand(tmp_path, capsys):
    out = tmp_path / "attention.csv"
    argv = ["attention", "--budgets", "3", "--shapes", "2x1", "--batch-sizes", "1", "--prefix-lens", "8",
            "--layout", "0.5b", "--repeats", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    assert re.match(r"^tree attention: per-path attention takes \d+\.\d\dx its time and causal attention over "
                    r"the same tokens \d+\.\d\dx \(means over 2 settings, float32, \d+ threads\)$",
                    _last_line(capsys))
    table = pd.read_csv(out)
    assert list(table["shape"]) == ["sequoia-3", "tree-2x1"]
    assert (table["max_abs_diff"] < 1e-4).all()
    assert cli.main(["attention", "--shapes", "2-1", "--out", str(out)]) == 2
    assert "--shapes entries look like 2x2x1" in capsys.readouterr().err


def test_heads_option_picks_the_heads_the_head_methods_use(prompts_file, tmp_path, capsys, use_tiny, tiny_pair,
                                                           monkeypatch):
    import os

    from specviz.heads import HEADS_ENV, Corpus, HeadConfig, train_heads

    monkeypatch.delenv(HEADS_ENV, raising=False)
    seqs = [list(range(5, 45)), list(range(50, 90)), list(range(7, 47))]
    result = train_heads("medusa", tiny_pair.target, Corpus.from_sequences(seqs, [4, 4, 4]), steps=2,
                         out_dir=tmp_path / "medusa", features=tmp_path / "f", progress=False,
                         config=HeadConfig(n_heads=2, window=16, batch_size=2))
    out = tmp_path / "heads.csv"
    assert cli.main(_argv(prompts_file, out, "--heads", str(result.path), methods=("medusa-2x1", "medusa-b3"))) == 0
    assert f"medusa heads: {result.path.resolve()}" in capsys.readouterr().out
    rows = bench.load_results(out)
    assert set(rows["method"]) == {"plain", "medusa-2x1", "medusa-b3"} and rows["matches_plain"].all()
    assert HEADS_ENV not in os.environ  # the option does not outlive the run
    head_rows = rows[rows["method"] != "plain"]
    assert head_rows["drafter"].str.endswith(f" heads={result.path.name}").all()
    # other heads do not resume into rows drafted by these ones
    other = train_heads("medusa", tiny_pair.target, Corpus.from_sequences(seqs, [4, 4, 4]), steps=2,
                        out_dir=tmp_path / "medusa-other", features=tmp_path / "f", progress=False,
                        config=HeadConfig(n_heads=2, window=16, batch_size=2))
    capsys.readouterr()
    assert cli.main(_argv(prompts_file, out, "--heads", str(other.path), methods=("medusa-2x1",))) == 2
    err = capsys.readouterr().err
    assert f"holds medusa-2x1 rows drafted by ['medusa(n=4,d=2) heads={result.path.name}']" in err
    assert "this run's heads are medusa-other" in err
    assert cli.main(_argv(prompts_file, out, "--heads", str(result.path), methods=("medusa-2x1",))) == 0


def test_costs_of_a_run_begun_before_passes_were_recorded_gain_the_column(tmp_path, tiny_pair):
    path = tmp_path / "old.costs.csv"
    old = pd.DataFrame({"model": [tiny_pair.target.name] * 2, "dtype": ["float32"] * 2, "threads": [1, 1],
                        "n_tokens": [1, 2], "prefix_len": [200, 200], "median_ms": [5.0, 6.0], "min_ms": [4.0, 5.0]})
    old.to_csv(path, index=False)
    cost_passes.append_costs(tiny_pair, [(0, [7], 0, 1)], path, "q1-r0")
    costs = pd.read_csv(path)
    assert list(costs["pass"]) == [cost_passes.BEFORE_ROUNDS, cost_passes.BEFORE_ROUNDS, "q1-r0"]
    pd.testing.assert_frame_equal(costs.iloc[:2].drop(columns="pass"), old)
    assert costs.iloc[2]["prefix_len"] == 0 and costs.iloc[2]["n_tokens"] == 7


def test_the_prediction_takes_the_median_of_every_pass(tmp_path):
    path = tmp_path / "p.costs.csv"
    passes = {"before": (80.0, 100.0, 900.0), "q1-r0": (40.0, 50.0, 500.0), "q2-r0": (50.0, 60.0, 700.0)}
    pd.DataFrame([{"model": "t", "dtype": "float32", "threads": 2, "n_tokens": n, "prefix_len": prefix,
                   "median_ms": ms, "min_ms": ms, "pass": label}
                  for label, (t1, t2, prefill) in passes.items()
                  for n, prefix, ms in ((1, 200, t1), (2, 200, t2), (10, 0, prefill))]).to_csv(path, index=False)
    rows = pd.DataFrame({"target": ["t"], "threads": [2], "prompt_tokens": [11], "steps": [4], "drafted": [4],
                         "draft_s": [0.1]})
    # medians: t(1) 50 ms, t(2) 60 ms, prefill of 10 tokens 700 ms; each step verifies 1 + 4 / 4 = 2 tokens
    assert cost_passes.predicted_wall(rows, path).iloc[0] == pytest.approx(0.7 + 0.1 + 4 * 0.060)
    assert cost_passes.curve_spread(rows, path) == "one-token forward 50 ms, 40-80 over 3 passes"
    assert cost_passes.curve_spread(rows.assign(threads=1), path) == ""  # no pass at that thread count
