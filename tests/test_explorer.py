"""Explorer logic without a browser: settings, drafters, caching and what the widget shows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specviz.draft.chooser import ChooserDrafter
from specviz.draft.fallback import FallbackDrafter
from specviz.draft.model import ChainDrafter, DynamicTreeDrafter, TreeDrafter
from specviz.draft.lookahead import LookaheadDrafter
from specviz.draft.merged import MergedDrafter
from specviz.draft.ngram import AdaptiveNgramDrafter, NgramTrieDrafter
from specviz.draft.switch import SwitchDrafter
from specviz.draft.suffix import SuffixDrafter
from specviz.render.explorer import (
    STRATEGIES,
    Explorer,
    ExplorerSettings,
    build_drafter,
    run_settings,
    strategy_spec,
    verifier_for,
)

PLOTLY_MIME = "application/vnd.plotly.v1+json"


@pytest.fixture(autouse=True)
def one_thread():
    # tiny forward passes are ~100x slower with an oversubscribed thread pool on a busy 2-core box
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _settings(**kw) -> ExplorerSettings:
    return ExplorerSettings(prompt="def add(a, b):", max_new_tokens=8, **kw)


@pytest.fixture(scope="module")
def tiny_heads(tiny_pair, tmp_path_factory) -> str:
    """Both head kinds, trained a few steps for the tiny target: the ``$SPECVIZ_HEADS`` value."""
    import os

    from specviz.heads import Corpus, HeadConfig, train_heads

    root = tmp_path_factory.mktemp("heads")
    seqs = [list(range(5, 45)), list(range(50, 90)), list(range(7, 47))]
    corpus = Corpus.from_sequences(seqs, [4, 4, 4])
    paths = [train_heads(kind, tiny_pair.target, corpus, steps=2, out_dir=root / kind, features=root / "f",
                         progress=False, config=HeadConfig(n_heads=3, window=16, batch_size=2)).path
             for kind in ("medusa", "eagle")]
    return os.pathsep.join(map(str, paths))


def test_settings_validate():
    with pytest.raises(ValueError, match="strategy"):
        _settings(strategy="beam")
    with pytest.raises(ValueError, match="depth"):
        _settings(depth=0)
    with pytest.raises(ValueError, match="temperature"):
        _settings(temperature=-1.0)
    with pytest.raises(ValueError, match="prompt"):
        ExplorerSettings(prompt="  ")


def test_canonical_settings_share_cache_entries():
    assert _settings(strategy="chain", width=3, budget=9).canonical() == \
        _settings(strategy="chain", width=5, budget=40).canonical()
    assert _settings(strategy="tree", width=2, depth=2, budget=50).canonical().budget == 6
    dynamic = _settings(strategy="dynamic", budget=5)
    assert dynamic.canonical() != replace(dynamic, budget=6).canonical()


def test_build_drafter_and_verifier(tiny_pair, tiny_heads, monkeypatch):
    from specviz.heads import HEADS_ENV, EagleDrafter, MedusaDrafter

    monkeypatch.setenv(HEADS_ENV, tiny_heads)
    kinds = {"chain": ChainDrafter, "tree": TreeDrafter, "dynamic": DynamicTreeDrafter,
             "ngram-trie": NgramTrieDrafter, "ngram-adaptive": AdaptiveNgramDrafter, "lookahead": LookaheadDrafter,
             "fallback": FallbackDrafter, "switch": SwitchDrafter, "medusa": MedusaDrafter, "eagle": EagleDrafter,
             "merged": MergedDrafter, "suffix": SuffixDrafter, "choose": ChooserDrafter}
    for strategy in STRATEGIES:
        assert isinstance(build_drafter(_settings(strategy=strategy), tiny_pair), kinds[strategy])
    names = {strategy: strategy_spec(_settings(strategy=strategy, width=3, depth=2, budget=5)).name
             for strategy in STRATEGIES}
    assert names == {"chain": "chain-k2", "tree": "tree-w3-d2-b5", "dynamic": "dynamic-w3-d2-b5",
                     "ngram-trie": "ngram-trie-n3-d2-b5-m3", "ngram-adaptive": "ngram-adaptive-n3-k2",
                     "lookahead": "lookahead-w3-n3-g5", "suffix": "suffix-n3-d2-b5", "fallback": "fallback-ngram-n3-k2-min3+chain-k2",
                     "switch": "switch-ngram-adaptive-n3-k2+chain-k2",
                     "choose": "choose-ngram-n3-k2-min3+suffix-n8-d2-b5+chain-k2",
                     "medusa": "medusa-w3-d2-b5", "eagle": "eagle-w3-d2-b5",
                     "merged": "merged-b5-ngram-n3-k2+eagle-w3-d2-b5"}
    # budgets above what the tree can hold share one cache entry, as for the model-drafted trees
    assert _settings(strategy="medusa", width=2, depth=2, budget=50).canonical().budget == 6
    assert _settings(strategy="eagle", width=2, depth=2, budget=50).canonical().budget == 6
    # eagle + lookup: the lookup chain's depth nodes on top of the head's tree
    merged = _settings(strategy="merged", width=2, depth=2, budget=50)
    assert merged.canonical().budget == 8 and replace(merged, budget=7).canonical().budget == 7
    assert build_drafter(merged.canonical(), tiny_pair).budget == 8
    # the adaptive n-gram chain ignores the budget, not the match length
    lookup = _settings(strategy="ngram-adaptive", width=2, depth=4, budget=50)
    assert lookup.canonical() == replace(lookup, budget=9).canonical() != replace(lookup, width=3).canonical()
    assert "budget" not in lookup.describe() and "max length 4" in lookup.describe()
    assert verifier_for(_settings()) == "greedy"
    assert verifier_for(_settings(strategy="chain", temperature=0.7)) == "chain"
    assert verifier_for(_settings(strategy="dynamic", temperature=0.7)) == "topk"


def test_run_settings_reports_steps(tiny_pair):
    seen = []
    settings = _settings(strategy="tree", depth=2, budget=4)
    result = run_settings(settings, tiny_pair, on_step=seen.append)
    assert len(seen) == len(result.steps) > 0
    assert all(s.tree.budget <= 4 for s in result.steps)


def _points(out) -> int:
    spec = out.outputs[0]["data"][PLOTLY_MIME]
    return sum(len(t["x"]) for t in spec["data"] if "markers" in t.get("mode", ""))


def test_explorer_updates_and_caches(tiny_pair):
    ex = Explorer(tiny_pair, _settings(strategy="dynamic", width=2, depth=2, budget=32), background=False)
    assert ex.computations == 1
    before = _points(ex.tree_out)
    assert "accepted per step" in ex.stats.value
    assert PLOTLY_MIME in ex.steps_out.outputs[0]["data"]
    ex.depth.value = 3
    assert ex.computations == 2 and _points(ex.tree_out) != before
    ex.depth.value = 2  # seen before: drawn from the cache
    assert ex.computations == 2 and _points(ex.tree_out) == before
    ex.strategy.value = "chain"
    assert ex.width.disabled and ex.budget.disabled
    ex.width.value = 5  # a chain ignores the width: no new model calls
    assert ex.computations == 3
    ex.step.value = ex.step.max
    assert f"step {ex.step.max}" in ex.stats.value
    ex.show_mask.value = True
    assert PLOTLY_MIME in ex.mask_out.outputs[0]["data"]


def test_explorer_lookahead_shows_its_window_and_two_branch_mask(tiny_pair):
    ex = Explorer(tiny_pair, _settings(strategy="lookahead", width=3, depth=2, budget=4), background=False)
    assert (ex.width.description, ex.depth.description, ex.budget.description) == \
        ("window W", "guess N-1", "guesses G")
    result = next(iter(ex.results.values()))
    assert result.drafter == "lookahead(w=3,n=3,g=4)" and result.steps[0].side_tokens == 3
    assert len(ex.tree_out.outputs) == 2  # the guess tree and the step's window and guesses
    ex.show_mask.value = True
    annotations = [a["text"] for a in ex.mask_out.outputs[0]["data"][PLOTLY_MIME]["layout"]["annotations"]]
    assert any(a.startswith("lookahead branch") for a in annotations)
    ex.strategy.value = "dynamic"
    assert ex.width.description == "width (top-k)" and len(ex.tree_out.outputs) == 1


def test_explorer_draws_the_heads_and_says_when_there_are_none(tiny_pair, tiny_heads, monkeypatch):
    from specviz.decode.engine import plain_generate
    from specviz.heads import HEADS_ENV

    monkeypatch.setenv(HEADS_ENV, tiny_heads)
    ex = Explorer(tiny_pair, _settings(strategy="medusa", width=2, depth=2, budget=4), background=False)
    plain = plain_generate(tiny_pair.target, "def add(a, b):", max_new_tokens=8)
    result = next(iter(ex.results.values()))
    assert result.drafter == "medusa(n=4,d=2)" and result.output_ids == plain.output_ids  # lossless
    assert "accepted per step" in ex.stats.value and _points(ex.tree_out) > 0
    ex.strategy.value = "eagle"
    assert ex.computations == 2 and ex.results[ex.settings().canonical()].output_ids == plain.output_ids
    ex.strategy.value = "merged"  # lookup's chain and the head's tree in the budget of 4
    merged = ex.results[ex.settings().canonical()]
    assert ex.computations == 3 and merged.output_ids == plain.output_ids
    assert merged.drafter.startswith("merged") and all(s.tree.budget <= 4 for s in merged.steps)
    monkeypatch.setenv(HEADS_ENV, "/nonexistent/heads")
    ex.depth.value = 3
    assert ex.computations == 3 and "failed: FileNotFoundError" in ex.status.value
    assert "/nonexistent/heads" in ex.status.value


def test_explorer_background_thread(tiny_pair):
    ex = Explorer(tiny_pair, _settings(strategy="chain", depth=2), background=True)
    ex.depth.value = 3
    assert ex.wait(timeout=60)
    assert ex.computations == 2
    assert ex.progress.layout.visibility == "hidden" and ex.status.value == ""
    assert "chain(k=3)" in ex.stats.value



# -- replay mode -------------------------------------------------------------------------------

import gzip  # noqa: E402
import html  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402

from specviz.decode.records import GenerationResult  # noqa: E402
from specviz.locations import NOTEBOOKS_DIR  # noqa: E402
from specviz.models.builtin import DEFAULT_DRAFT, DEFAULT_TARGET
from specviz.render import (  # noqa: E402
    figure_mimebundle,
    lookahead_mask_figure,
    lookahead_step_figure,
    mask_figure,
    stats_html,
    step_tree_figure,
    step_view_figure,
)
from specviz.render.explorer import (  # noqa: E402
    DEFAULT_TRACES,
    explore,
    load_recording,
    record_traces,
    recording_settings,
)
from specviz.render.traces import TRACE_VERSION, TraceFileError, read_traces  # noqa: E402

RECORDED = (
    _settings(strategy="dynamic", width=2, depth=2, budget=6),  # all 2 + 1 * 2 ** 2 candidates
    _settings(strategy="lookahead", width=3, depth=2, budget=4),  # a side branch
    _settings(strategy="tree", width=2, depth=2, budget=4, temperature=1.0),  # sampled, q and p < 1
)


@pytest.fixture
def recorded(tiny_pair, tmp_path):
    path = tmp_path / "traces.json.gz"
    recording = record_traces(path, RECORDED, tiny_pair, log=lambda _: None)
    return path, recording


def _figures(result: GenerationResult, tokenizer) -> list[dict]:
    figs = []
    for s, step in enumerate(result.steps):
        figs += [step_tree_figure(step, tokenizer=tokenizer), step_view_figure(result, tokenizer=tokenizer,
                                                                               highlight_step=s)]
        if step.side is not None:
            figs += [lookahead_step_figure(step, tokenizer=tokenizer), lookahead_mask_figure(step, tokenizer=tokenizer)]
        else:
            figs.append(mask_figure(step.tree, tokenizer=tokenizer))
    return [figure_mimebundle(f)["application/vnd.plotly.v1+json"] for f in figs]


def _same(a, b) -> bool:
    """Equal tensors (NaN equal to NaN, dtype included), or both None."""
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a.nan_to_num(-7.0), b.nan_to_num(-7.0))


def _without_times(html: str) -> str:
    return re.sub(r"\d+\.\d+ (s|ms)\b|\d+\.\d tokens/s", "TIME", html)


def test_replayed_generations_equal_live_ones(recorded, tiny_pair):
    path, recording = recorded
    assert set(recording.results) == {s.canonical() for s in RECORDED}
    assert recording.info["weights"] == "fp32" and recording.max_new_tokens == 8
    assert recording.info["target"] == tiny_pair.target.name
    for settings in RECORDED:
        replayed = recording.results[settings.canonical()]
        live = run_settings(settings.canonical(), tiny_pair)
        assert replayed.output_ids == live.output_ids and replayed.text == live.text
        assert replayed.drafter == live.drafter and replayed.verifier == live.verifier
        for a, b in zip(replayed.steps, live.steps, strict=True):
            assert torch.equal(a.tree.tokens, b.tree.tokens) and torch.equal(a.tree.parents, b.tree.parents)
            assert _same(a.tree.q, b.tree.q) and _same(a.target_token_probs, b.target_token_probs)
            assert _same(a.acceptance.node_accept_prob, b.acceptance.node_accept_prob)
            assert _same(a.tree.ranks, b.tree.ranks) and torch.equal(a.acceptance.tried, b.acceptance.tried)
            assert a.acceptance.committed_tokens == b.acceptance.committed_tokens
            assert a.expected_accepted == b.expected_accepted or math.isnan(a.expected_accepted)
        # the figures drawn from the recording (its token table, no tokenizer) equal the live ones
        assert _figures(replayed, recording.tokenizer) == _figures(live, tiny_pair.target.tokenizer)
        for s in range(len(live.steps)):
            assert _without_times(stats_html(replayed, s)) == _without_times(stats_html(live, s))
    # the recorded run itself comes back bit for bit, times included
    again = load_recording(path)
    for key, result in recording.results.items():
        assert stats_html(again.results[key], 0) == stats_html(result, 0)
        assert again.results[key].steps[0].draft_time_s == result.steps[0].draft_time_s


def test_replay_explorer_draws_recorded_settings_like_live_mode(recorded, tiny_pair):
    path, recording = recorded
    replay = Explorer(None, RECORDED[0], recording=recording, background=False, live_pair=lambda: tiny_pair)
    live = Explorer(tiny_pair, RECORDED[0], background=False)
    assert replay.computations == 0 and replay.pair is None and "recorded" in replay.source.value
    assert "Replaying a recording" in replay.banner.value and "fp32 weights" in replay.banner.value
    assert "8 new tokens" in replay.banner.value
    for ex in (replay, live):
        ex.step.value = 1
        ex.show_mask.value = True
    for out in ("tree_out", "mask_out", "steps_out"):
        assert getattr(replay, out).outputs == getattr(live, out).outputs
    assert _without_times(replay.stats.value) == _without_times(live.stats.value)
    replay.apply(RECORDED[1])  # the lookahead recording: window and guesses, two-branch mask
    assert replay.computations == 0 and len(replay.tree_out.outputs) == 2


def test_unrecorded_setting_says_so_and_offers_nearest_or_live(recorded, tiny_pair):
    path, recording = recorded
    loads = []
    ex = Explorer(None, RECORDED[0], recording=recording, background=False,
                  live_pair=lambda: loads.append(1) or tiny_pair)
    ex.depth.value = 3  # not recorded: nothing drawn, the reason shown, no model loaded
    assert ex.missing_box.layout.display != "none" and "Not recorded" in ex.missing.value
    assert "depth 3" in ex.missing.value and ex.tree_out.outputs == () and ex.stats.value == ""
    assert ex.step.disabled and ex.source.value == "" and not loads and ex.computations == 0
    assert ex.nearest_button.description == f"nearest recorded: {RECORDED[0].canonical().describe()}"
    ex.nearest_button.click()  # the sliders move to the recorded setting, which is drawn
    assert ex.depth.value == 2 and ex.missing_box.layout.display == "none" and "recorded" in ex.source.value
    assert ex.tree_out.outputs and not loads

    ex.depth.value = 3
    ex.live_button.click()  # computed live with the loaded pair, and labelled so
    assert loads == [1] and ex.computations == 1 and ex.live
    assert "computed live" in ex.source.value and ex.missing_box.layout.display == "none"
    key = ex.settings().canonical()
    assert ex.results[key].output_ids == run_settings(key, tiny_pair).output_ids
    ex.width.value = 3  # live from now on
    assert ex.computations == 2 and ex.tree_out.outputs

    ex3 = Explorer(None, replace(RECORDED[0], depth=3, budget=40), recording=recording, background=False)
    assert ex3.nearest_button.description.endswith("depth 2 · budget 40 · temperature 0")  # the same as 6
    ex3.nearest_button.click()
    assert (ex3.depth.value, ex3.budget.value) == (2, 40) and "recorded" in ex3.source.value

    ex.prompt.value = "print('hi')"  # another prompt: the recording holds only its own
    ex2 = Explorer(None, replace(RECORDED[0], prompt="print('hi')"), recording=recording, background=False)
    assert "holds the prompt 'def add(a, b):' only" in html.unescape(ex2.missing.value)
    assert ex2.live_button.disabled  # no way to load models was given


def test_record_resumes_and_keeps_finished_settings(tiny_pair, tmp_path, monkeypatch):
    path = tmp_path / "t.json.gz"
    import specviz.render.recording as recording_module  # record_traces runs its settings there

    runs = []
    real = recording_module.run_settings

    def flaky(settings, pair, on_step=None):
        runs.append(settings)
        if len(runs) == 2:
            raise KeyboardInterrupt  # interrupted during the second setting
        return real(settings, pair, on_step)

    monkeypatch.setattr(recording_module, "run_settings", flaky)
    with pytest.raises(KeyboardInterrupt):
        record_traces(path, RECORDED[:2], tiny_pair, log=lambda _: None)
    assert set(load_recording(path).results) == {RECORDED[0].canonical()}  # the finished one was stored
    lines = []
    recording = record_traces(path, RECORDED[:2], lambda: tiny_pair, log=lines.append)
    assert runs[2:] == [RECORDED[1].canonical()]  # only the missing one ran
    assert set(recording.results) == {s.canonical() for s in RECORDED[:2]}
    assert "1 setting(s) recorded, 1 to record" in lines[0]
    with pytest.raises(ValueError, match="other settings"):
        record_traces(path, [replace(RECORDED[0], max_new_tokens=9)], tiny_pair, log=lambda _: None)


def _rewrite(path, change) -> None:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    change(data)
    with gzip.open(path, "wt") as f:
        json.dump(data, f)


def test_corrupt_or_foreign_trace_files_are_refused_clearly(recorded, tmp_path):
    path, _ = recorded
    good = path.read_bytes()
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"not a gzip file")
    with pytest.raises(TraceFileError, match="not a gzip'd JSON trace file"):
        load_recording(bad)
    bad.write_bytes(good[: len(good) // 2])
    with pytest.raises(TraceFileError, match="truncated or corrupted"):
        load_recording(bad)
    with pytest.raises(FileNotFoundError, match="--record"):
        load_recording(tmp_path / "absent.json.gz")

    cases = [
        (lambda d: d.update(version=TRACE_VERSION + 1), f"version {TRACE_VERSION + 1}.*reads version {TRACE_VERSION}"),
        (lambda d: d.update(format="something-else"), "not a specviz trace file"),
        (lambda d: d["traces"][1]["result"]["steps"][0]["tree"].pop("parents"), r"traces\[1\].result.steps\[0\].tree lacks 'parents'"),
        (lambda d: d["traces"][0]["result"]["steps"][0]["tree"]["parents"].__setitem__(1, 5), "parent"),
        (lambda d: d["traces"][0]["result"].update(output_ids=[1, 2, 3]), "do not spell the output_ids"),
        (lambda d: d["tokens"].clear(), "token table lacks"),
        (lambda d: d["traces"][0]["settings"].update(depth=0), r"traces\[0\].settings: depth"),
    ]
    for change, message in cases:
        bad.write_bytes(good)
        _rewrite(bad, change)
        with pytest.raises(TraceFileError, match=message):
            load_recording(bad)
    assert read_traces(path).info  # the original is untouched


def test_replay_refuses_other_weights(recorded):
    path, _ = recorded
    with pytest.raises(ValueError, match="replay mode shows and computes fp32"):
        explore("replay", dtype="bf16", traces=path, background=False)
    with pytest.raises(ValueError, match="replay mode's draft runs in fp32"):
        explore("replay", draft_dtype="w4a8-token", traces=path, background=False)


def test_live_draft_in_another_weight_mode():
    ex = explore("tiny", strategy="chain", depth=2, max_new_tokens=6, background=False, draft_dtype="w4a8-token")
    assert ex.pair.draft.weight_mode == "w4a8-token" and ex.pair.target.weight_mode == "fp32"
    assert "fp32 target weights, w4a8-token draft weights" in ex.describe()
    same = explore("tiny", strategy="chain", depth=2, max_new_tokens=6, background=False)
    assert same.describe().endswith("fp32 weights")
    with pytest.raises(ValueError, match="draft_dtype applies to a model given by name"):
        explore(same.pair, draft_dtype="w4a8-token", background=False)


def test_committed_recording_covers_the_notebook_defaults():
    assert DEFAULT_TRACES.stat().st_size < 1_000_000
    recording = load_recording()
    assert (recording.info["target"], recording.info["draft"]) == (DEFAULT_TARGET, DEFAULT_DRAFT)
    assert recording.weights == "fp32" and recording.max_new_tokens == 24 and recording.info["seed"] == 0
    assert set(recording_settings()) <= set(recording.results)
    from specviz.study.runner import declared_parameters

    declared = declared_parameters(NOTEBOOKS_DIR / "07_explorer.ipynb")
    value = {name: ast_literal(info["default"]) for name, info in declared.items()}
    assert value["model"] == "replay"
    defaults = ExplorerSettings(prompt=value["prompt"], strategy=value["strategy"], width=value["width"],
                                depth=value["depth"], budget=value["budget"], temperature=value["temperature"],
                                max_new_tokens=value["max_new_tokens"], seed=value["seed"])
    assert defaults.canonical() in recording.results
    for strategy in STRATEGIES:  # switching the dropdown with the default sliders stays in the recording
        assert replace(defaults, strategy=strategy).canonical() in recording.results
    ex = explore(background=False)  # opens without a model or a tokenizer, with real token texts
    assert ex.pair is None and ex.computations == 0 and PLOTLY_MIME in ex.tree_out.outputs[0]["data"]
    shown = ex.results[defaults.canonical()]
    assert "".join(recording.tokenizer.decode([t]) for t in shown.output_ids) == shown.text
    assert "Fibonacci" in shown.text
    ex.depth.value = value["depth"] + 1  # the browser test's step: recorded too
    assert ex.source.value and "recorded" in ex.source.value


def ast_literal(text: str):
    import ast

    return ast.literal_eval(text)


def test_record_command_writes_and_resumes(tiny_pair, tiny_heads, tmp_path, monkeypatch, capsys):
    import specviz.render.explorer as explorer
    import specviz.render.recording as recording_module  # record_traces loads the pair there
    from specviz.heads import HEADS_ENV

    monkeypatch.setenv(HEADS_ENV, tiny_heads)  # the medusa and eagle settings draft with them
    n = len(recording_settings("x = 1", 4))
    assert n == 22
    loads = []
    monkeypatch.setattr(recording_module, "load_pair", lambda **kw: loads.append(kw) or tiny_pair)
    path = tmp_path / "rec.json.gz"
    assert explorer.main(["--record", str(path), "--max-new-tokens", "4", "--prompt", "x = 1"]) == 0
    assert loads == [{"dtype": "fp32", "device": "cpu"}]
    recording = load_recording(path)
    assert set(recording.results) == set(recording_settings("x = 1", 4))
    assert all(r.n_new_tokens == 4 for r in recording.results.values())
    out = capsys.readouterr().out
    assert f"0 setting(s) recorded, {n} to record" in out and f"{n} settings recorded" in out
    assert explorer.main(["--record", str(path), "--max-new-tokens", "4", "--prompt", "x = 1"]) == 0
    assert len(loads) == 1 and f"{n} setting(s) recorded, 0 to record" in capsys.readouterr().out
    assert explorer.main(["--record", str(path), "--max-new-tokens", "5", "--prompt", "x = 1"]) == 2
    assert "recorded with other settings" in capsys.readouterr().err


def test_a_former_strategy_label_reads_as_its_family_name_and_says_so():
    raw = _settings(strategy="fallback").to_dict() | {"strategy": "cascade"}
    with pytest.warns(UserWarning, match="former strategy label 'cascade' read as 'fallback'"):
        assert ExplorerSettings.from_dict(raw).strategy == "fallback"
    with pytest.raises(ValueError, match="strategy must be one of"):
        ExplorerSettings.from_dict(raw | {"strategy": "no such strategy"})
