"""dtype="auto" (specviz.models.auto) on a tiny model saved as a local directory: the probe's
table and its cache, resuming a partial probe, the choice, and auto through load_model."""

import json

import pytest

from specviz.models import auto
from specviz.models.loading import load_model, tiny_model

PROBE = dict(prompts=2, tokens=6, prefix_len=16, repeats=1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    m = tiny_model()
    m.model.save_pretrained(path)
    m.tokenizer.save_pretrained(path)
    return path


def test_probe_measures_every_mode_once_then_reads_the_cache(tiny_dir, tmp_path):
    said = []
    table = auto.probe_weight_modes(str(tiny_dir), ["int8", "w8a8"], cache=tmp_path, log=said.append, **PROBE)
    assert set(table.weight_mode) == {"fp32", "bf16", "int8", "w8a8"}
    assert (table.t1_ms > 0).all() and (table.t4_ms > 0).all()
    assert list(table.step_ms) == sorted(table.step_ms)
    fp32 = table.set_index("weight_mode").loc["fp32"]
    assert fp32.agreement == 1.0 and not fp32.lossy
    assert table.bar.iloc[0] == pytest.approx(table.set_index("weight_mode").loc["bf16", "agreement"] - 0.02)
    assert sum("probing" in s for s in said) == 4
    files = list((tmp_path / "auto").glob("*.json"))
    assert len(files) == 1 and auto.machine_key() in files[0].name
    said.clear()
    again = auto.probe_weight_modes(str(tiny_dir), ["int8", "w8a8"], cache=tmp_path, log=said.append, **PROBE)
    assert said == [] and again.equals(table)


def test_a_partial_probe_resumes_with_the_missing_mode_only(tiny_dir, tmp_path):
    auto.probe_weight_modes(str(tiny_dir), ["int8"], cache=tmp_path, log=lambda s: None, **PROBE)
    path = next((tmp_path / "auto").glob("*.json"))
    data = json.loads(path.read_text())
    (entry,) = data.values()
    del entry["int8"]
    path.write_text(json.dumps(data))
    said = []
    table = auto.probe_weight_modes(str(tiny_dir), ["int8"], cache=tmp_path, log=said.append, **PROBE)
    assert [s for s in said if "probing" in s] == ["auto: probing int8 (cost of 1 and 4 new tokens, agreement with fp32)"]
    assert "int8" in set(table.weight_mode)


def test_a_probe_of_w8a8_token_with_other_code_is_measured_again(tiny_dir, tmp_path, monkeypatch):
    from specviz.models import extension

    auto.probe_weight_modes(str(tiny_dir), ["w8a8-token"], cache=tmp_path, log=lambda s: None, **PROBE)
    path = next((tmp_path / "auto").glob("*.json"))
    (entry,) = json.loads(path.read_text()).values()
    first = entry["w8a8-token"]["kernel"]
    assert first == ("compiled operator" if extension.fused_op_status() == "compiled operator" else "PyTorch code")
    assert "kernel" not in entry["fp32"]
    said = []
    auto.probe_weight_modes(str(tiny_dir), ["w8a8-token"], cache=tmp_path, log=said.append, **PROBE)
    assert said == []  # same code: read from the cache
    other = "PyTorch code" if first == "compiled operator" else "compiled operator"
    monkeypatch.setattr(auto, "_kernel", lambda mode: other if mode == "w8a8-token" else "")
    auto.probe_weight_modes(str(tiny_dir), ["w8a8-token"], cache=tmp_path, log=said.append, **PROBE)
    assert [s for s in said if "probing" in s] == [
        f"auto: w8a8-token was probed with {first}, it now runs {other}: probing it again",
        "auto: probing w8a8-token (cost of 1 and 4 new tokens, agreement with fp32)"]
    (entry,) = json.loads(path.read_text()).values()
    assert entry["w8a8-token"]["kernel"] == other


def test_choice_is_the_fastest_mode_that_is_not_lossy(tiny_dir, tmp_path, monkeypatch):
    table = auto.probe_weight_modes(str(tiny_dir), ["int8", "int4"], cache=tmp_path, log=lambda s: None, **PROBE)
    want = table[~table.lossy].sort_values("step_ms").weight_mode.iloc[0]
    assert auto.choose_weight_mode(str(tiny_dir), cache=tmp_path, log=lambda s: None, modes=["int8", "int4"],
                                   **PROBE) == want
    # a mode marked lossy is never chosen, however fast
    lossy = table.assign(lossy=table.weight_mode != "fp32", step_ms=[9.0, 1.0, 2.0, 3.0][:len(table)])
    monkeypatch.setattr(auto, "probe_weight_modes", lambda *a, **k: lossy)
    assert auto.choose_weight_mode("x", log=lambda s: None) == "fp32"


def test_auto_through_load_model(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(auto, "choose_weight_mode", lambda name, cache=None, log=print: "int8")
    m = load_model(str(tiny_dir), "auto", cache=tmp_path)
    assert m.weight_mode == "int8"
    with pytest.raises(ValueError, match="dtype='auto' needs a model name or path"):
        load_model(m, "auto")
    monkeypatch.setattr("specviz.models.device.resolve_device", lambda device, mode=None: __import__("torch").device("cuda"))
    assert auto.resolve_auto("anything", "cuda") == "bf16"
