"""The int8 paths' keeping rule (specviz.bench.int8_paths.verdict) on made-up timings, and
its command reading an earlier run's CSV."""

import pandas as pd
import pytest

from specviz.bench.int8_paths import REFERENCE, main, verdict, verdict_path


def _row(variant, family, ms, rel_err=None, scope="linear", m=1, status="ok", agreement=None):
    return dict(scope=scope, shape="qkv N=8 K=8" if scope == "linear" else "whole model", variant=variant,
                family=family, M=m, status=status, median_ms=ms, rel_err=rel_err, top1_agreement=agreement,
                machine="test CPU, 2 cores", cpu_flags="avx2=yes")


@pytest.fixture
def table():
    return pd.DataFrame([
        _row("fp32 nn.Linear", "reference", 4.0, 0.0),
        _row(REFERENCE, "specviz", 1.0, 0.01),
        _row("per-tensor library", "library", 0.8, 0.07),  # faster, seven times the error
        _row("per-token library", "library", 1.5, 0.012),  # as accurate, slower
        _row("broken library", "library", None, None, status="unavailable"),
        _row(REFERENCE, "specviz", 1.0, m=4),
        _row("per-token library", "library", 1.05, 0.012, m=4),
        _row(REFERENCE, "specviz", 100.0, scope="decode", agreement=0.98),
        _row("per-token library", "library", 600.0, scope="decode", agreement=0.97),
    ])


def test_the_rule_keeps_the_kernel_only_where_it_is_more_than_ten_percent_faster(table):
    v = verdict(table).set_index(["scope", "M"])
    one = v.loc[("linear", 1)]
    assert one.best_library == "per-tensor library" and one.specviz_faster_by == pytest.approx(-0.2)
    assert not one.keep  # the fastest library path wins on speed alone
    assert one.as_accurate == "per-token library" and one.specviz_faster_than_as_accurate_by == pytest.approx(0.5)
    assert one.reference_error == pytest.approx(0.01) and one.best_library_error == pytest.approx(0.07)
    four = v.loc[("linear", 4)]
    assert four.specviz_faster_by == pytest.approx(0.05) and not four.keep  # 5% is inside the 10% margin
    decode = v.loc[("decode", 1)]
    assert decode.keep and decode.reference_error == pytest.approx(0.02)  # 1 - top-1 agreement
    assert decode.as_accurate == "per-token library"  # 0.03 <= 2 x 0.02
    assert set(v.machine) == {"test CPU, 2 cores"}
    assert len(verdict(table[table.family != "library"])) == 0  # nothing to compare


def test_from_an_earlier_run_writes_its_verdict_beside_it(table, tmp_path, capsys):
    run = tmp_path / "int8-paths.csv"
    table.to_csv(run, index=False)
    main(["--from", str(run)])
    assert verdict_path(run) == str(tmp_path / "int8-paths.verdict.csv")
    written = pd.read_csv(verdict_path(run))
    assert len(written) == 3 and "wrote 3 verdict rows" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not an int8-paths CSV"):
        pd.DataFrame({"a": [1]}).to_csv(tmp_path / "other.csv", index=False)
        main(["--from", str(tmp_path / "other.csv")])
    with pytest.raises(SystemExit, match="--from .*missing.csv"):
        main(["--from", str(tmp_path / "missing.csv")])
