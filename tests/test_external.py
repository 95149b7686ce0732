"""Other tools' results (specviz.metrics.external): Spec-Bench answer files, vLLM, SGLang, llama.cpp
and llama-server logs and vLLM's Prometheus counters read from sample files in those tools' formats,
with exact numbers; format detection; malformed input; and the Spec-Bench round trip of specviz step
tables."""

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from specviz.decode.engine import speculative_generate
from specviz.decode.records import StepRecord, records_from_result
from specviz.draft.model import ChainDrafter
from specviz.metrics import (EXTERNAL_TOOLS, ExternalCounters, acceptance_summary, counters_from_steps, counters_table,
                             detect_format, llama_cpp_runs, parse_llama_cpp_log, parse_llama_server_log,
                             parse_sglang_log, parse_vllm_log, parse_vllm_metrics, read_external,
                             read_specbench_answers, records_table, write_specbench_answers)

DATA = Path(__file__).parent / "data" / "external"
SPECBENCH = DATA / "specbench_eagle.jsonl"
VLLM_V1 = DATA / "vllm_v1.log"
VLLM_V0 = DATA / "vllm_v0.log"
SGLANG = DATA / "sglang.log"
LLAMA = DATA / "llama_speculative_simple.log"
LLAMA_SERVER = DATA / "llama_server.log"
VLLM_METRICS = DATA / "vllm_metrics.prom"

# accept_lengths of the Spec-Bench sample, minus the bonus token, in file order
SPECBENCH_ACCEPTED = [3, 0, 2, 4, 1, 1, 5, 0, 2, 2, 2, 0, 3, 0, 1, 6, 4, 4, 1, 0, 3, 2]


# -- Spec-Bench -----------------------------------------------------------------------------------

def test_specbench_answers_become_one_row_per_step_of_every_turn():
    t = read_specbench_answers(SPECBENCH)
    assert len(t) == 22
    assert t["accepted"].tolist() == SPECBENCH_ACCEPTED
    assert (t["committed"] == t["accepted"] + 1).all()
    assert t["question_id"].tolist() == [81] * 9 + [82] * 7 + [3] * 6
    assert t["turn"].tolist() == [0] * 5 + [1] * 4 + [0] * 4 + [1] * 3 + [0] * 6
    # step and position restart with every turn
    q81 = t[t["question_id"] == 81]
    assert q81["step"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert q81["position"].tolist() == [0, 4, 5, 8, 13, 0, 2, 8, 9]
    assert t.loc[t["question_id"] == 82, "category"].unique().tolist() == ["roleplay"]
    assert t.loc[t["question_id"] == 3, "category"].isna().all()  # the line has no category
    assert t["drafted"].isna().all() and t["depth"].isna().all() and t["extendable"].isna().all()
    assert set(t["model_id"]) == {"vicuna-7b-v1.3-eagle-float16-temperature-0.0"}
    assert t.attrs["source"] == "spec-bench"


def test_specbench_tau_is_specbench_mean_accepted_tokens():
    t = read_specbench_answers(SPECBENCH)
    s = acceptance_summary(t.assign(run="eagle"), ["run"]).iloc[0]
    assert (s["sequences"], s["steps"], s["accepted_tokens"], s["new_tokens"]) == (3, 22, 46, 68)
    # Spec-Bench's #MAT is the mean of accept_lengths: 68 / 22
    assert s["tau"] == pytest.approx(68 / 22)
    assert math.isnan(s["acceptance_rate"])  # drafted tokens are not in the file
    by_category = acceptance_summary(t.dropna(subset=["category"]), ["category"]).set_index("category")
    assert by_category.loc["writing", "tau"] == pytest.approx(27 / 9)
    assert by_category.loc["roleplay", "tau"] == pytest.approx(21 / 7)


def test_specbench_counters_have_per_position_acceptance():
    (c,) = counters_from_steps(read_specbench_answers(SPECBENCH))
    assert c.source == "spec-bench"
    assert (c.steps, c.accepted, c.emitted) == (22, 46, 68)
    assert c.tau == pytest.approx(68 / 22)
    assert math.isnan(c.drafted) and math.isnan(c.acceptance_rate)
    # P(accepted >= k) over the 22 steps
    assert c.per_position == pytest.approx([17 / 22, 13 / 22, 8 / 22, 5 / 22, 2 / 22, 1 / 22])
    assert c.given == ("steps", "accepted", "emitted")
    assert set(c.derived) == {"tau", "per_position"}
    by_q = {x.label: x for x in counters_from_steps(read_specbench_answers(SPECBENCH), by=["question_id"])}
    assert by_q["question_id=3"].per_position == pytest.approx([5 / 6, 4 / 6, 3 / 6, 2 / 6])


def test_specbench_turns_that_do_not_add_up_are_kept_as_one_sequence():
    line = {"question_id": 7, "category": "qa", "model_id": "m",
            "choices": [{"index": 0, "turns": ["a", "b"], "new_tokens": [5, 9], "wall_time": [0.1, 0.1],
                         "accept_lengths": [3, 3, 2, 4]}]}
    with pytest.warns(UserWarning, match="line 1: choice 0: the turns' new_tokens"):
        t = read_specbench_answers(json.dumps(line) + "\n")
    assert t["turn"].isna().all()
    assert t["step"].tolist() == [0, 1, 2, 3] and t["position"].tolist() == [0, 3, 6, 8]


def test_specbench_baseline_has_no_accepted_tokens():
    line = {"question_id": 1, "category": "math_reasoning", "model_id": "vanilla",
            "choices": [{"index": 0, "turns": ["42"], "new_tokens": [4], "wall_time": [0.2],
                         "accept_lengths": [1, 1, 1, 1]}]}
    t = read_specbench_answers(json.dumps(line))
    assert t["accepted"].tolist() == [0, 0, 0, 0]
    assert acceptance_summary(t, ["model_id"]).iloc[0]["tau"] == 1.0


# -- vLLM -----------------------------------------------------------------------------------------

def test_vllm_v1_intervals_are_summed():
    (c,) = parse_vllm_log(VLLM_V1)
    assert c.source == "vllm" and c.label == "vllm_v1.log" and c.intervals == 2
    assert (c.accepted, c.drafted) == (732 + 400, 1200 + 750)
    assert c.acceptance_rate == pytest.approx(1132 / 1950)
    # drafts per interval 400 and 250, recovered from the printed ratios
    assert c.tau == pytest.approx(1 + 1132 / 650)
    assert c.per_position == pytest.approx([510 / 650, 372 / 650, 250 / 650])
    assert c.num_speculative_tokens == 3
    # vLLM prints no number of drafts: steps and emitted tokens stay unknown
    assert math.isnan(c.steps) and math.isnan(c.emitted)
    assert c.given == ("accepted", "drafted")


def test_vllm_v1_per_interval_numbers_are_as_printed():
    first, second = parse_vllm_log(VLLM_V1, per_interval=True)
    assert (first.accepted, first.drafted, first.tau) == (732, 1200, 2.83)
    assert first.per_position == (0.8, 0.605, 0.425)
    assert first.acceptance_rate == pytest.approx(0.61)
    assert (second.accepted, second.drafted, second.tau) == (400, 750, 2.6)
    assert {"tau", "per_position"} <= set(first.given)
    assert first.derived == ("acceptance_rate",)


def test_vllm_v1_first_format_has_no_tau():
    text = ("INFO 03-20 10:01:02 [loggers.py:80] SpecDecoding metrics: Draft acceptance rate: 60.0%, "
            "Accepted: 300 tokens, Drafted: 500 tokens\n")
    (c,) = parse_vllm_log(text)
    assert (c.accepted, c.drafted, c.acceptance_rate) == (300, 500, 0.6)
    assert math.isnan(c.tau) and c.per_position == ()
    two = text + text.replace("300", "100")
    (c,) = parse_vllm_log(two)
    assert (c.accepted, c.drafted) == (400, 1000) and math.isnan(c.tau)


def test_vllm_v0_counts_are_running_totals():
    (c,) = parse_vllm_log(VLLM_V0)
    assert c.source == "vllm-v0" and c.intervals == 2
    # the last line holds the run: 3000 draft tokens of k = 4 are 750 steps
    assert (c.steps, c.drafted, c.emitted, c.num_speculative_tokens) == (750, 3000, 2175, 4)
    assert c.accepted == 2175 - 750
    assert c.tau == pytest.approx(2.9)
    # accepted-path tokens / drafted, not vLLM's printed 0.530 (which counts tokens after a rejection)
    assert c.acceptance_rate == pytest.approx(1425 / 3000)
    first, second = parse_vllm_log(VLLM_V0, per_interval=True)
    assert (first.steps, first.emitted) == (300, 870)
    assert (second.steps, second.drafted, second.emitted) == (450, 1800, 1305)


def test_vllm_v0_restarts_add_up_and_old_wording_reads():
    line = ("INFO metrics.py:300] Speculative metrics: Draft acceptance rate: 0.500, System efficiency: 0.600, "
            "Number of speculative tokens: 2, Number of accepted tokens: {a}, Number of draft tokens tokens: {d}, "
            "Number of emitted tokens tokens: {e}.\n")
    text = line.format(a=50, d=100, e=90) + line.format(a=80, d=160, e=150) + line.format(a=10, d=20, e=18)
    (c,) = parse_vllm_log(text)
    assert (c.drafted, c.emitted, c.steps) == (180, 168, 90)
    assert c.tau == pytest.approx(168 / 90)


# -- SGLang ---------------------------------------------------------------------------------------

def test_sglang_tau_is_the_mean_of_the_intervals():
    (c,) = parse_sglang_log(SGLANG)
    assert c.source == "sglang" and c.intervals == 4
    assert c.tau == pytest.approx(3.0)
    assert c.accepted_per_step == pytest.approx(2.0)
    for name in ("steps", "drafted", "accepted", "emitted", "acceptance_rate"):
        assert math.isnan(getattr(c, name))
    assert [x.tau for x in parse_sglang_log(SGLANG, per_interval=True)] == [3.12, 2.96, 3.40, 2.52]


def test_sglang_newer_lines_and_idle_intervals():
    text = ("[2025-09-01 12:00:01 TP0] Decode batch, #running-req: 2, #token: 1208, token usage: 0.02, "
            "accept len: 2.88, accept rate: 0.72, cuda graph: True, gen throughput (token/s): 151.20, #queue-req: 0, \n"
            "[2025-09-01 12:00:02 TP0] Decode batch, #running-req: 0, #token: 0, token usage: 0.00, "
            "accept len: 0.00, accept rate: 0.00, cuda graph: True, gen throughput (token/s): 0.00, #queue-req: 0, \n")
    (c,) = parse_sglang_log(text)
    assert c.tau == 2.88 and c.intervals == 1
    assert math.isnan(c.acceptance_rate)  # SGLang's "accept rate" has no stable definition


# -- llama.cpp ------------------------------------------------------------------------------------

def test_llama_cpp_summary():
    (c,) = parse_llama_cpp_log(LLAMA)
    assert c.source == "llama.cpp"
    assert (c.emitted, c.drafted, c.accepted, c.num_speculative_tokens) == (129, 272, 95, 8)
    assert c.steps == 34  # n_predict - n_accept
    assert c.tau == pytest.approx(129 / 34)
    assert c.acceptance_rate == pytest.approx(0.34926, abs=1e-5)  # the printed accept = 34.926%
    assert set(c.derived) == {"steps", "tau", "acceptance_rate"}
    (run,) = llama_cpp_runs(LLAMA.read_text())
    assert (run["encode_s"], run["decode_s"], run["accept_pct"]) == (0.412, 3.208, 34.926)


def test_llama_cpp_several_runs_add_up():
    text = LLAMA.read_text()
    two = text + text.replace("n_predict = 129", "n_predict = 64").replace("n_accept  = 95", "n_accept  = 40") \
        .replace("n_drafted = 272", "n_drafted = 96")
    (c,) = parse_llama_cpp_log(two)
    assert (c.emitted, c.drafted, c.accepted, c.steps, c.intervals) == (193, 368, 135, 58, 2)
    assert [x.steps for x in parse_llama_cpp_log(two, per_interval=True)] == [34, 24]


def test_llama_server_tasks_with_the_statistics_exact_steps():
    (run,) = parse_llama_server_log(LLAMA_SERVER)
    # the tasks' tokens add up to the eagle3 statistics' (167 + 60, 259 + 120), so its 127 drafts are the steps
    assert (run.accepted, run.drafted, run.steps, run.emitted, run.intervals) == (227, 379, 127, 354, 2)
    assert run.tau == pytest.approx(1 + 227 / 127) and run.acceptance_rate == pytest.approx(227 / 379)
    # positions weighted by each task's steps as recovered from its rounded rates: 167 / 1.92 and 60 / 1.5
    w0, w1 = 167 / 1.920, 60 / 1.5
    assert run.per_position == pytest.approx([(p * w0 + q * w1) / (w0 + w1)
                                              for p, q in ((0.805, 0.75), (0.632, 0.5), (0.483, 0.25))])
    assert run.per_position[0] == pytest.approx(100 / 127, abs=2e-3)  # the statistics' '#acc drafts' / drafts
    assert run.given == ("steps", "accepted", "drafted") and run.label == "llama_server.log"


def test_llama_server_per_task_and_per_implementation():
    t0, t5, stats = parse_llama_server_log(LLAMA_SERVER, per_interval=True)
    assert [c.label for c in (t0, t5, stats)] == ["llama_server.log slot 0 task 0", "llama_server.log slot 1 task 5",
                                                  "llama_server.log draft-eagle3"]
    assert (t0.accepted, t0.drafted, t0.tau, t0.per_position) == (167, 259, 2.92, (0.805, 0.632, 0.483))
    assert math.isnan(t0.steps) and t0.num_speculative_tokens == 3 and "tau" in t0.given
    assert (stats.steps, stats.accepted, stats.drafted, stats.per_position) == (127, 227, 379, (100 / 127,))
    assert stats.tau == pytest.approx(1 + 227 / 127)


def test_llama_server_older_lines_and_statistics_alone():
    old = "slot print_timing: id  0 | task 3 | \ndraft acceptance rate = 0.64479 (  167 accepted /   259 generated)\n"
    (c,) = parse_llama_server_log(old)
    assert (c.accepted, c.drafted, c.acceptance_rate, c.label) == (167, 259, 167 / 259, "<text>")
    assert math.isnan(c.tau) and c.per_position == ()  # no steps printed: tau is not guessed
    stats = "statistics ngram-map: #gen drafts = 10, #acc drafts = 4, #gen tokens = 40, #acc tokens = 9\n"
    early = "statistics ngram-map: #gen drafts = 4, #acc drafts = 1, #gen tokens = 16, #acc tokens = 2\n"
    (s,) = parse_llama_server_log(early + stats)  # running totals: the last line counts
    assert (s.steps, s.tau, s.per_position, s.intervals) == (10, 1.9, (0.4,), 1)
    # tasks whose tokens differ from the statistics' (an earlier run's) keep their own, inexact steps
    (mixed,) = parse_llama_server_log(old + stats)
    assert mixed.accepted == 167 and math.isnan(mixed.steps)
    with pytest.raises(ValueError, match=r"line 1: a llama-server 'statistics ngram-map:' line without '#acc tokens"):
        parse_llama_server_log("statistics ngram-map: #gen drafts = 10, #acc drafts = 4, #gen tokens = 40\n")
    with pytest.raises(ValueError, match=r"line 1: .*more accepted \(9\) than generated \(4\)"):
        parse_llama_server_log("draft acceptance = 2.25 (  9 accepted /   4 generated)")
    with pytest.raises(ValueError, match="expected llama-server's 'draft acceptance"):
        parse_llama_server_log("slot print_timing: id  0 | task 3 |\n")


def test_vllm_prometheus_counters_are_exact():
    (c,) = parse_vllm_metrics(VLLM_METRICS)
    assert (c.steps, c.drafted, c.accepted, c.emitted, c.intervals) == (127, 381, 227, 354, 2)
    assert c.tau == pytest.approx(1 + 227 / 127) and c.num_speculative_tokens == 3
    assert c.per_position == pytest.approx((100 / 127, 75 / 127, 52 / 127))
    assert sum(c.per_position) == pytest.approx(c.tau - 1)
    e0, e1 = parse_vllm_metrics(VLLM_METRICS, per_interval=True)
    assert e0.label == "engine=0, model_name=Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert (e1.steps, e1.accepted, e1.per_position) == (40, 60, (0.75, 0.5, 0.25))
    text = VLLM_METRICS.read_text()
    lacking = "\n".join(line for line in text.splitlines() if "draft_tokens" not in line or 'engine="1"' not in line)
    with pytest.raises(ValueError, match=r'series \{engine="1", .*\} lacks vllm:spec_decode_num_draft_tokens_total'):
        parse_vllm_metrics(lacking)
    with pytest.raises(ValueError, match="without a position"):
        parse_vllm_metrics(text.replace('position="1"', 'pos="1"'))
    with pytest.raises(ValueError, match="expected vLLM's Prometheus counters"):
        parse_vllm_metrics("vllm:generation_tokens_total 5.0\n")


# -- one table for all ----------------------------------------------------------------------------

def test_counters_table_uses_specviz_column_names():
    counters = (parse_vllm_log(VLLM_V1) + parse_sglang_log(SGLANG) + parse_llama_cpp_log(LLAMA)
                + counters_from_steps(read_specbench_answers(SPECBENCH)))
    table = counters_table(counters)
    summary = acceptance_summary(read_specbench_answers(SPECBENCH), ["model_id"])
    shared = {"steps", "new_tokens", "drafted_tokens", "accepted_tokens", "acceptance_rate", "accepted_per_step", "tau"}
    assert shared <= set(table.columns) and shared <= set(summary.columns)
    assert table["source"].tolist() == ["vllm", "sglang", "llama.cpp", "spec-bench"]
    assert table["tau"].tolist() == pytest.approx([1 + 1132 / 650, 3.0, 129 / 34, 68 / 22])
    # per-position columns reach the longest row; NaN beyond a row's positions
    assert [c for c in table.columns if c.startswith("p_accept_")] == [f"p_accept_{k}" for k in range(1, 7)]
    assert table.loc[0, "p_accept_3"] == pytest.approx(250 / 650) and math.isnan(table.loc[0, "p_accept_4"])
    assert table.loc[2, ["p_accept_1"]].isna().all()
    assert table.loc[1, "given"] == "" and table.loc[2, "given"] == "emitted,drafted,accepted,num_speculative_tokens"
    with pytest.raises(TypeError, match="ExternalCounters"):
        counters_table([{"tau": 2.0}])


def test_counters_hold_floats_and_name_what_was_given():
    c = ExternalCounters("x", "y", steps=10, accepted=15, drafted=40, per_position=[1, 0.5],
                         given=["steps", "accepted", "drafted"])
    assert isinstance(c.steps, float) and c.per_position == (1.0, 0.5) and c.given == ("steps", "accepted", "drafted")
    assert math.isnan(c.tau)  # nothing is filled in by the constructor itself
    assert c.derived == ("per_position",)
    with pytest.raises(ValueError, match="unknown attributes"):
        ExternalCounters("x", "y", given=("speed",))


# -- detection and malformed input ----------------------------------------------------------------

@pytest.mark.parametrize("path, fmt", [(SPECBENCH, "spec-bench"), (VLLM_V1, "vllm"), (VLLM_V0, "vllm"),
                                       (SGLANG, "sglang"), (LLAMA, "llama.cpp"), (LLAMA_SERVER, "llama-server"),
                                       (VLLM_METRICS, "vllm-metrics")])
def test_formats_are_detected(path, fmt):
    assert detect_format(path.read_text()) == fmt
    table = read_external(path)
    assert table.attrs["source"].startswith(fmt)
    table_from_text = read_external(path.read_text())
    pd.testing.assert_frame_equal(table.drop(columns="label", errors="ignore"),
                                  table_from_text.drop(columns="label", errors="ignore"))


def test_read_external_returns_counters_of_logs_and_steps_of_answers():
    assert read_external(str(LLAMA)).loc[0, "steps"] == 34
    assert read_external(LLAMA, label="gpu-run").loc[0, "label"] == "gpu-run"
    assert len(read_external(SPECBENCH)) == 22
    assert set(EXTERNAL_TOOLS) == {"spec-bench", "vllm", "vllm-metrics", "sglang", "llama.cpp", "llama-server"}
    with pytest.raises(ValueError, match="unknown tool 'tgi'"):
        read_external(LLAMA, tool="tgi")
    # forcing a tool on the wrong file says what that tool's parser expected
    with pytest.raises(ValueError, match="llama_speculative_simple.log: expected SGLang"):
        read_external(LLAMA, tool="sglang")


def test_unknown_format_names_the_file(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("tokens/s: 41.2\naccepted: many\n")
    with pytest.raises(ValueError, match=r"notes.txt: unknown format; expected Spec-Bench answers"):
        read_external(f)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_external(str(tmp_path / "missing.jsonl"))


def test_malformed_specbench_lines_name_file_line_and_expectation(tmp_path):
    good = SPECBENCH.read_text().splitlines()[0]
    f = tmp_path / "answers.jsonl"
    f.write_text(good + "\n" + '{"question_id": 82, "choices": [\n')
    with pytest.raises(ValueError, match=r"answers.jsonl, line 2: expected one JSON object per line .*not JSON"):
        read_external(f)
    f.write_text(good + "\n\n" + json.dumps({"question_id": 9, "choices": [{"turns": ["x"]}]}) + "\n")
    with pytest.raises(ValueError, match=r"answers.jsonl, line 3: choice 0 has no 'accept_lengths' list"):
        read_external(f)
    f.write_text(json.dumps({"question_id": 9, "choices": [{"accept_lengths": [2, 0, 3]}]}))
    with pytest.raises(ValueError, match=r"line 1: choice 0: accept_lengths must be whole numbers >= 1 .*got 0"):
        read_specbench_answers(f)
    f.write_text(json.dumps({"id": 9, "answer": "x"}))
    with pytest.raises(ValueError, match=r"line 1: expected a Spec-Bench answer with 'question_id' and a 'choices'"):
        read_external(f)
    f.write_text("\n\n")
    with pytest.raises(ValueError, match="answers.jsonl: empty"):
        read_specbench_answers(f)


def test_malformed_log_lines_name_file_line_and_expectation(tmp_path):
    f = tmp_path / "server.log"
    f.write_text("INFO start\nINFO SpecDecoding metrics: Mean acceptance length: 2.10, Accepted: 55 tokens\n")
    with pytest.raises(ValueError, match=r"server.log, line 2: a vLLM 'SpecDecoding metrics:' line without 'Drafted"):
        read_external(f)
    f.write_text("INFO Speculative metrics: Draft acceptance rate: 0.500, Number of draft tokens: 10\n")
    with pytest.raises(ValueError, match=r"line 1: a vLLM 'Speculative metrics:' line without 'Number of accepted"):
        read_external(f)
    f.write_text("n_draft   = 4\nn_predict = 10\nn_drafted = 8\n\nllama_perf_context_print: total time = 1 ms\n")
    with pytest.raises(ValueError, match=r"server.log, line 1: llama.cpp run summary lacks n_accept"):
        read_external(f)
    f.write_text("[x] Decode batch. #running-req: 1, accept len: n/a, #queue-req: 0\n")
    with pytest.raises(ValueError, match=r"line 1: an SGLang 'Decode batch' line whose 'accept len:' has no number"):
        read_external(f)


# -- writing Spec-Bench answers -------------------------------------------------------------------

def _steps() -> pd.DataFrame:
    a = [StepRecord(0, 0, 4, 4, 3, True, 4), StepRecord(1, 4, 4, 4, 0, True, 1), StepRecord(2, 5, 4, 4, 4, False, 2)]
    b = [StepRecord(0, 0, 6, 3, 2, True, 3), StepRecord(1, 3, 6, 3, 1, True, 2)]
    return pd.concat([records_table(a, strategy="chain-k4", question_id=12, category="coding"),
                      records_table(b, strategy="chain-k4", question_id=5, category="math")], ignore_index=True)


def test_counters_of_a_specviz_step_table():
    by_label = {c.label: c for c in counters_from_steps(_steps(), by=["question_id"])}
    q12, q5 = by_label["question_id=12"], by_label["question_id=5"]
    assert q12.source == "specviz"
    assert (q12.steps, q12.drafted, q12.accepted) == (3, 12, 7)
    assert q12.emitted == 7  # committed tokens: the last step was cut at end-of-sequence
    assert q12.tau == pytest.approx(1 + 7 / 3) and q12.acceptance_rate == pytest.approx(7 / 12)
    assert q12.per_position == pytest.approx([2 / 3, 2 / 3, 2 / 3, 1 / 3])
    # depth 3 trees: the third position was drafted but never accepted
    assert q5.per_position == pytest.approx([1.0, 0.5, 0.0])


def test_write_specbench_answers_uses_specbench_convention(tmp_path):
    path = write_specbench_answers(_steps(), tmp_path / "out" / "specviz.jsonl", model_id="qwen-chain-k4",
                                   wall_time={12: [0.5]})
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["question_id"] for x in lines] == [5, 12]  # sorted, as Spec-Bench's files
    q12 = lines[1]
    assert (q12["category"], q12["model_id"]) == ("coding", "qwen-chain-k4")
    (choice,) = q12["choices"]
    # tokens per step including the bonus token, before the end-of-sequence cut of the last step
    assert choice["accept_lengths"] == [4, 1, 5]
    assert choice["new_tokens"] == [10] and choice["decoding_steps"] == [3] and choice["wall_time"] == [0.5]
    assert math.isnan(lines[0]["choices"][0]["wall_time"][0])
    with pytest.raises(ValueError, match=r"lacks columns \['question_id'\]"):
        write_specbench_answers(_steps().drop(columns="question_id"), tmp_path / "x.jsonl")


def test_specbench_round_trip_keeps_accepted_counts_and_tau(tmp_path):
    steps = _steps()
    back = read_specbench_answers(write_specbench_answers(steps, tmp_path / "a.jsonl"))
    key = ["question_id", "step"]
    merged = steps.merge(back, on=key, suffixes=("", "_back"))
    assert len(merged) == len(steps) == 5
    assert (merged["accepted"] == merged["accepted_back"]).all()
    assert (merged["category"] == merged["category_back"]).all()
    before = acceptance_summary(steps, ["question_id"]).set_index("question_id")
    after = acceptance_summary(back, ["question_id"]).set_index("question_id")
    assert after["tau"].to_dict() == pytest.approx(before["tau"].to_dict())
    assert after.loc[12, "tau"] == pytest.approx(1 + 7 / 3)


def test_round_trip_of_a_live_run_with_turns(tmp_path, tiny_pair):
    tables = []
    for qid, prompt in enumerate(["def f(x):", "import os"]):
        for turn in range(2):
            result = speculative_generate(tiny_pair.target, ChainDrafter(tiny_pair.draft, 3), prompt + " " * turn,
                                          max_new_tokens=16)
            tables.append(records_table(records_from_result(result), question_id=qid, turn=turn))
    steps = pd.concat(tables, ignore_index=True)
    back = read_specbench_answers(write_specbench_answers(steps, tmp_path / "live.jsonl"))
    cols = ["question_id", "turn", "step", "accepted"]
    pd.testing.assert_frame_equal(back[cols].reset_index(drop=True),
                                  steps[cols].astype({"turn": "Int64"}).reset_index(drop=True), check_dtype=False)
    assert acceptance_summary(back, ["question_id"])["tau"].tolist() == \
        pytest.approx(acceptance_summary(steps, ["question_id"])["tau"].tolist())
