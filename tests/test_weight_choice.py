"""dtype="auto" (specviz.bench.auto) on a tiny model saved as a local directory: which modes
the instruction set makes candidates, the probe's table and its cache, its progress lines,
explicit and bad modes, resuming a partial probe, the choice, and resolve_auto."""

import json
import time

import pytest

from specviz.bench import auto
from specviz.models.loading import load_model
from specviz.models.tiny import tiny_model

PROBE = dict(prompts=2, tokens=6, prefix_len=16, repeats=1)
AVX2 = {"fpu", "sse4_2", "fma", "avx", "avx2"}
VNNI = AVX2 | {"avx512f", "avx512bw", "avx512_vnni"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    m = tiny_model()
    m.model.save_pretrained(path)
    m.tokenizer.save_pretrained(path)
    return path


def _probing(said):
    """The per-mode "probing ..." lines (not the probe's opening line)."""
    return [s for s in said if "probing" in s and " on this machine in " not in s]


def _entry(cache):
    path = next((cache / "auto").glob("*.json"))
    (entry,) = json.loads(path.read_text()).values()
    return path, entry


@pytest.mark.parametrize("flags, modes, words", [
    (AVX2, ("fp32", "w8a8-token"), ["bf16 untimed", "fbgemm AVX2"]),
    (VNNI, ("fp32", "w8a8-token"), ["bf16 untimed", "VNNI"]),
    (VNNI | {"avx512_bf16"}, ("fp32", "w8a8-token"), ["native bf16 (avx512_bf16), timed only if w8a8-token misses",
                                                      "VNNI"]),
    (AVX2 | {"amx_bf16", "amx_tile"}, ("fp32", "bf16", "w8a8-token"), ["native bf16 (amx_bf16)"]),
    ({"fpu", "sse4_2", "avx"}, ("fp32",), ["bf16 untimed", "no AVX2"]),
    ({"avx512_bf16"}, ("fp32", "bf16"), ["no AVX2"]),
    (set(), ("fp32", "bf16", "w8a8-token"), ["instruction set unknown"]),
])
def test_candidates_follow_the_instruction_set(flags, modes, words):
    got, reason = auto.candidate_modes(flags)
    assert got == modes
    assert all(w in reason for w in words), reason
    assert set(got) <= set(auto.AUTO_CANDIDATES)


def test_bf16_is_the_fallback_where_the_vnni_kernel_runs():
    assert auto.fallback_modes(VNNI | {"avx512_bf16"}) == ("bf16",)
    assert auto.fallback_modes(VNNI) == auto.fallback_modes(AVX2 | {"amx_bf16"}) == ()
    timed = {"t1_ms": 50.0, "t4_ms": 70.0}
    assert not auto._w8a8_misses({"bf16": {"agreement": 0.99}, "w8a8-token": {**timed, "agreement": 0.98}})
    assert auto._w8a8_misses({"bf16": {"agreement": 0.99}, "w8a8-token": {**timed, "agreement": 0.90}})
    assert auto._w8a8_misses({"w8a8-token": {"error": "no fbgemm"}})
    assert not auto._w8a8_misses({})  # not measured yet


def test_candidates_default_to_this_cpu_and_refuse_a_string():
    assert auto.candidate_modes() == auto.candidate_modes(auto.cpu_flags())
    with pytest.raises(ValueError, match="not the string 'avx2'"):
        auto.candidate_modes("avx2")


def test_probe_measures_the_candidates_once_with_progress_then_reads_the_cache(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(auto, "cpu_flags", lambda: frozenset(AVX2))
    import specviz.models.loading as loading

    loads = []
    real = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda src, mode, *a, **k: loads.append(
        (src if isinstance(src, str) else "in memory", mode)) or real(src, mode, *a, **k))
    said = []
    table = auto.probe_weight_modes(str(tiny_dir), cache=tmp_path, log=said.append, **PROBE)
    assert set(table.weight_mode) == {"fp32", "w8a8-token"}
    # the reference is loaded once (bf16, the bar, is a cast of it), each other mode by name
    assert loads == [(str(tiny_dir), "fp32"), (str(tiny_dir), "w8a8-token")]
    assert said[0].startswith(f"auto: probing {tiny_dir} on this machine in fp32, w8a8-token (fp32: the reference;")
    for line in ["auto: fp32 reference continuations (2 prompts decoded together): token 6/6: ",
                 "auto: fp32 (1/2): timing one forward of 1 and of 4 new tokens after 16 (1 repeats)",
                 "auto: fp32 (1/2): agreement 1 (the reference, not measured)", "auto: bf16 (the bar only, untimed)",
                 "auto: bf16 (the bar): agreement, prompt 2/2", "auto: w8a8-token (2/2): loading",
                 "auto: w8a8-token (2/2): agreement with fp32 on 2 prompts (4 tokens per forward)"]:
        assert any(s.startswith(line) for s in said), line
    assert all(s.endswith("s left") for s in said if (" prompt " in s and "/2:" in s) or " token " in s)
    assert not any("still running" in s for s in said)  # every step here is shorter than _BEAT_S
    _, entry = _entry(tmp_path)
    assert set(entry["bf16"]) == {"agreement"}  # measured for the bar, not timed
    assert entry["fp32"]["agreement"] == 1.0  # the reference, by definition
    assert (table.bar == entry["bf16"]["agreement"] - 0.02).all()
    fp32 = table.set_index("weight_mode").loc["fp32"]
    assert fp32.agreement == 1.0 and not fp32.lossy
    assert list(table.step_ms) == sorted(table.step_ms) and (table.t4_ms > 0).all()
    said.clear()
    again = auto.probe_weight_modes(str(tiny_dir), cache=tmp_path, log=said.append, **PROBE)
    assert said == [] and again.equals(table)
    assert set(auto.recorded_probes(tmp_path).weight_mode) >= {"fp32", "bf16", "w8a8-token"}


def test_explicit_modes_are_measured_whatever_the_cpu(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(auto, "cpu_flags", lambda: frozenset({"fpu", "sse4_2"}))  # no candidate but fp32
    said = []
    table = auto.probe_weight_modes(str(tiny_dir), ["w8a8-token", "float16"], cache=tmp_path, log=said.append,
                                    **PROBE)
    assert set(table.weight_mode) == {"fp32", "w8a8-token", "fp16"}
    assert said[0].endswith("in fp32, w8a8-token, fp16 (the modes asked for, and fp32, the reference)")
    assert len(_probing(said)) == 3
    _, entry = _entry(tmp_path)
    assert set(entry["bf16"]) == {"agreement"}
    files = list((tmp_path / "auto").glob("*.json"))
    assert len(files) == 1 and auto.machine_key() in files[0].name
    # bf16 asked for is timed too, its earlier agreement-only record measured again
    said.clear()
    table = auto.probe_weight_modes(str(tiny_dir), ["bf16"], cache=tmp_path, log=said.append, **PROBE)
    assert set(table.weight_mode) == {"fp32", "bf16"} and _probing(said) == [
        "auto: probing bf16 (cost of 1 and 4 new tokens, agreement with fp32)"]
    assert table.bar.iloc[0] == pytest.approx(table.set_index("weight_mode").loc["bf16", "agreement"] - 0.02)
    # the default on this CPU: no candidate but fp32
    assert auto.choose_weight_mode(str(tiny_dir), cache=tmp_path, log=said.append, **PROBE) == "fp32"


@pytest.mark.parametrize("modes, message", [
    ("w8a8-token", r"modes must be a list of weight modes, e.g. \['w8a8-token'\], not the string"),
    (["int8"], r"modes: weight mode 'int8' was retired \(weight-only int8 was slower"),
    (["int3"], r"modes: unknown weight mode 'int3'"),
    (["auto"], r"modes: 'auto' is what the probe decides"),
])
def test_bad_modes_are_named(tiny_dir, tmp_path, modes, message):
    with pytest.raises(ValueError, match=message):
        auto.probe_weight_modes(str(tiny_dir), modes, cache=tmp_path, **PROBE)
    assert not (tmp_path / "auto").exists()  # refused before anything is measured


def test_bad_settings_are_named(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="tokens"):
        auto.probe_weight_modes(str(tiny_dir), cache=tmp_path, **{**PROBE, "tokens": 0})
    with pytest.raises(ValueError, match="prefix_len"):
        auto.probe_weight_modes(str(tiny_dir), cache=tmp_path, **{**PROBE, "prefix_len": -1})


def test_a_long_step_says_it_still_runs(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(auto, "_BEAT_S", 0.002)
    said = []
    auto.probe_weight_modes(str(tiny_dir), ["w8a8-token"], cache=tmp_path, log=said.append, **PROBE)
    beats = [s for s in said if "still running after" in s]
    assert any(s.startswith("auto: w8a8-token (2/2): loading: still running after ") for s in beats), beats
    assert any(s.startswith("auto: fp32 reference continuations (2 prompts decoded together): still running after ")
               and "s left at the pace so far" in s for s in beats), beats
    count = len(said)
    time.sleep(0.05)
    assert len(said) == count  # the beats stop with their step


def test_a_partial_probe_resumes_with_the_missing_mode_only(tiny_dir, tmp_path):
    auto.probe_weight_modes(str(tiny_dir), ["w8a8-token"], cache=tmp_path, log=lambda s: None, **PROBE)
    path = next((tmp_path / "auto").glob("*.json"))
    data = json.loads(path.read_text())
    (entry,) = data.values()
    del entry["w8a8-token"]
    path.write_text(json.dumps(data))
    said = []
    table = auto.probe_weight_modes(str(tiny_dir), ["w8a8-token"], cache=tmp_path, log=said.append, **PROBE)
    assert _probing(said) == ["auto: probing w8a8-token (cost of 1 and 4 new tokens, agreement with fp32)"]
    assert "w8a8-token" in set(table.weight_mode)


def test_a_probe_of_w8a8_token_with_other_code_is_measured_again(tiny_dir, tmp_path, monkeypatch):
    from specviz.quant import extension

    auto.probe_weight_modes(str(tiny_dir), ["w8a8-token"], cache=tmp_path, log=lambda s: None, **PROBE)
    _, entry = _entry(tmp_path)
    first = entry["w8a8-token"]["kernel"]
    assert first == ("compiled operator" if extension.fused_op_status() == "compiled operator" else "PyTorch code")
    assert "kernel" not in entry["fp32"]
    said = []
    auto.probe_weight_modes(str(tiny_dir), ["w8a8-token"], cache=tmp_path, log=said.append, **PROBE)
    assert said == []  # same code: read from the cache
    other = "PyTorch code" if first == "compiled operator" else "compiled operator"
    monkeypatch.setattr(auto, "_kernel", lambda mode: other if mode == "w8a8-token" else "")
    auto.probe_weight_modes(str(tiny_dir), ["w8a8-token"], cache=tmp_path, log=said.append, **PROBE)
    assert _probing(said) == [
        f"auto: w8a8-token was probed with {first}, it now runs {other}: probing it again",
        "auto: probing w8a8-token (cost of 1 and 4 new tokens, agreement with fp32)"]
    _, entry = _entry(tmp_path)
    assert entry["w8a8-token"]["kernel"] == other


def test_choice_is_the_fastest_mode_that_is_not_lossy(tiny_dir, tmp_path, monkeypatch):
    table = auto.probe_weight_modes(str(tiny_dir), ["w8a8-token", "fp16"], cache=tmp_path, log=lambda s: None, **PROBE)
    want = table[~table.lossy].sort_values("step_ms").weight_mode.iloc[0]
    assert auto.choose_weight_mode(str(tiny_dir), cache=tmp_path, log=lambda s: None, modes=["w8a8-token", "fp16"],
                                   **PROBE) == want
    # a mode marked lossy is never chosen, however fast
    lossy = table.assign(lossy=table.weight_mode != "fp32", step_ms=[9.0, 1.0, 2.0][:len(table)])
    monkeypatch.setattr(auto, "probe_weight_modes", lambda *a, **k: lossy)
    assert auto.choose_weight_mode("x", log=lambda s: None) == "fp32"


def test_resolve_auto_on_the_cpu_and_elsewhere(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(auto, "choose_weight_mode", lambda name, cache=None, log=print: "w8a8-token")
    mode = auto.resolve_auto(str(tiny_dir), "cpu", cache=tmp_path)
    assert mode == "w8a8-token" and load_model(str(tiny_dir), mode, cache=tmp_path).weight_mode == "w8a8-token"
    with pytest.raises(ValueError, match="resolve it into a mode first"):
        load_model(str(tiny_dir), "auto", cache=tmp_path)
    with pytest.raises(ValueError, match="dtype='auto' needs a model name or path"):
        auto.resolve_auto(tiny_model(), "cpu")
    monkeypatch.setattr("specviz.models.device.resolve_device", lambda device, mode=None: __import__("torch").device("cuda"))
    assert auto.resolve_auto("anything", "cuda") == "bf16"
