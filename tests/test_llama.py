"""llama.cpp as a benchmark peer (specviz.bench.llama) against stand-in programs that print what
llama.cpp's print: finding the programs, reading their timings and counts, their failures, and
the benchmark's refusals when they are missing."""

import json
import stat
import sys
from pathlib import Path

import pytest

from specviz.bench.__main__ import main as bench_main
from specviz.bench.e2e import parse_method
from specviz.bench.llama import LLAMA_BINARIES, find_llama_cpp, llama_ngram, llama_plain, llama_speculative

PROMPT = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"

FAKE_BENCH = """
import json, sys
args = sys.argv[1:]
pg = args[args.index("-pg") + 1]
p, n = map(int, pg.split(","))
print(json.dumps([{"n_prompt": p, "n_gen": n, "avg_ns": 2_500_000_000, "avg_ts": (p + n) / 2.5}]))
"""

FAKE_SPEC = """
import json, os, sys
args = sys.argv[1:]
if os.environ.get("FAKE_LLAMA_ARGS"):
    open(os.environ["FAKE_LLAMA_ARGS"], "w").write(json.dumps(args))
if "--fail" in open(args[args.index("-f") + 1]).read():
    print("error: cannot load model", file=sys.stderr)
    sys.exit(3)
prompt = open(args[args.index("-f") + 1]).read()
prompt = prompt[:-1] if prompt.endswith("\\n") else prompt  # as llama.cpp reads a prompt file
k = int(args[args.index("--spec-draft-n-max") + 1]) if "--spec-draft-n-max" in args else 16
print("\\n\\n" + prompt + "Hello there!\\n\\n")
for line in ("encoded   12 tokens in    0.500 seconds, speed:   24.000 t/s",
             "decoded   10 tokens in    1.500 seconds, speed:    6.667 t/s",
             f"n_draft   = {k}", "n_predict = 10", "n_drafted = 8", "n_accept  = 6", "accept    = 75.000%"):
    print("0.01.000.000 I " + line, file=sys.stderr)
"""


def _program(path: Path, body: str) -> None:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def fake_llama(tmp_path):
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    _program(bin_dir / "llama-bench", FAKE_BENCH)
    _program(bin_dir / "llama-speculative-simple", FAKE_SPEC)
    return tmp_path


def test_find_looks_in_the_directory_its_bin_and_build_bin(fake_llama, tmp_path):
    assert find_llama_cpp(fake_llama) == fake_llama / "build" / "bin"
    assert find_llama_cpp(fake_llama / "build" / "bin") == fake_llama / "build" / "bin"
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="llama-bench, llama-speculative-simple not found in .*cmake"):
        find_llama_cpp(tmp_path / "empty")


def test_find_on_path(fake_llama, monkeypatch):
    monkeypatch.setenv("PATH", str(fake_llama / "build" / "bin"))
    assert find_llama_cpp() == fake_llama / "build" / "bin"
    monkeypatch.setenv("PATH", str(fake_llama))
    assert find_llama_cpp() is None


def test_plain_reads_llama_bench_json(fake_llama):
    run = llama_plain(find_llama_cpp(fake_llama), Path("t.gguf"), 87, 128, threads=2)
    assert run.wall_s == pytest.approx(2.5) and run.new_tokens == 128 and run.steps == 128
    assert run.text == "" and run.drafted == 0


def test_speculative_reads_counts_times_and_text(fake_llama):
    run = llama_speculative(find_llama_cpp(fake_llama), Path("t.gguf"), Path("d.gguf"), PROMPT, 10, k=4, threads=2)
    assert run.wall_s == pytest.approx(2.0)  # encode + decode
    assert (run.new_tokens, run.drafted, run.accepted, run.steps) == (10, 8, 6, 4)
    assert run.text == "Hello there!"


def test_ngram_runs_prompt_lookup_without_a_draft_model(fake_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_ARGS", str(tmp_path / "args.json"))
    run = llama_ngram(find_llama_cpp(fake_llama), Path("t.gguf"), PROMPT, 10, threads=2, n=3, k=8)
    assert (run.new_tokens, run.drafted, run.accepted, run.steps) == (10, 8, 6, 4) and run.text == "Hello there!"
    args = json.loads((tmp_path / "args.json").read_text())
    assert "-md" not in args and args[args.index("--spec-type") + 1] == "ngram-simple"
    assert args[args.index("--spec-ngram-simple-size-n") + 1] == "3"
    assert args[args.index("--spec-ngram-simple-size-m") + 1] == "8" and args[args.index("--spec-draft-n-max") + 1] == "8"
    llama_ngram(find_llama_cpp(fake_llama), Path("t.gguf"), PROMPT, 10, threads=2)  # llama.cpp's own sizes
    args = json.loads((tmp_path / "args.json").read_text())
    assert not {"--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m", "--spec-draft-n-max"} & set(args)


def test_a_failing_program_is_reported_with_its_log(fake_llama):
    with pytest.raises(RuntimeError, match="(?s)llama-speculative-simple failed \\(exit 3\\).*cannot load model"):
        llama_speculative(find_llama_cpp(fake_llama), Path("t.gguf"), Path("d.gguf"), PROMPT + "--fail", 10, 3, 2)


def test_method_names():
    assert parse_method("llama-spec").arguments() == {"k": 3}
    assert parse_method("llama-spec-k5").arguments() == {"k": 5}
    assert parse_method("llama-ngram").arguments() == {"n": None, "k": None}
    assert parse_method("llama-ngram-n3-k8").arguments() == {"n": 3, "k": 8}
    assert parse_method("llama-plain").family == "llama-plain"
    assert set(LLAMA_BINARIES) == {"llama-bench", "llama-speculative-simple"}


def test_bench_refuses_llama_methods_without_the_programs(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert bench_main(["--methods", "llama-spec", "--limit", "1", "--out", str(tmp_path / "x.csv")]) == 2
    assert "need llama.cpp's llama-bench and llama-speculative-simple" in capsys.readouterr().err
    assert bench_main(["--llama-cpp", str(tmp_path), "--limit", "1", "--out", str(tmp_path / "x.csv")]) == 2
    assert "--llama-cpp: llama.cpp programs llama-bench, llama-speculative-simple not found" in capsys.readouterr().err


def test_bench_refuses_llama_methods_on_the_tiny_pair(fake_llama, tmp_path, capsys):
    assert bench_main(["--models", "tiny", "--llama-cpp", str(fake_llama), "--methods", "llama-plain",
                       "--limit", "1", "--out", str(tmp_path / "x.csv")]) == 2
    assert "run the built-in pair's GGUF files" in capsys.readouterr().err


def test_default_methods_add_llama_when_found(fake_llama, tmp_path, monkeypatch, capsys):
    seen = {}

    class Stop(Exception):
        pass

    def stop(args, specs, *rest):
        seen["methods"] = [s.name for s in specs]
        raise Stop

    import specviz.bench.__main__ as cli

    monkeypatch.setattr(cli, "_measure", stop)
    with pytest.raises(Stop):
        bench_main(["--models", "tiny", "--limit", "1", "--max-new-tokens", "2", "--out", str(tmp_path / "y.csv")])
    assert not any(m.startswith("llama") for m in seen["methods"])
    monkeypatch.setenv("PATH", str(fake_llama / "build" / "bin"))
    with pytest.raises(Stop):
        bench_main(["--limit", "1", "--max-new-tokens", "2", "--out", str(tmp_path / "z.csv")])
    assert {"llama-plain", "llama-spec"} <= set(seen["methods"])
