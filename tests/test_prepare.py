"""First-time preparation of the built-in models: progress on stderr only when work is done,
and the study prepares the models its notebooks need before the first notebook runs.
The slow stages (transformers' dequantization, papermill) are replaced by stand-ins."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest

import specviz.models.builtin as models
import specviz.models.loading as loading
import specviz.study.runner as runner
from specviz.locations import NOTEBOOKS_DIR
from specviz.models.builtin import BuiltinModel, builtin_cached, prepare_builtin, set_progress
from specviz.models.loading import load_model
from specviz.models.tiny import tiny_model
from specviz.study.presets import NotebookRun, Preset, get_preset


def _fake_builtin(tmp_path: Path, monkeypatch, payload: bytes, name: str = "fake-model") -> BuiltinModel:
    """Fake data packages ``fakeprogpkg_partN`` holding ``payload`` in two parts, registered
    as built-in model ``name``."""
    site = tmp_path / "site"
    half = len(payload) // 2
    for i, part in enumerate((payload[:half], payload[half:]), 1):
        pkg = site / f"fakeprogpkg_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(part)
    monkeypatch.syspath_prepend(str(site))
    spec = BuiltinModel(name=name, role="draft", package_prefix="fakeprogpkg-part", n_parts=2, version="0.0.1",
                        size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    monkeypatch.setitem(models.BUILTIN_MODELS, name, spec)
    return spec


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A fake built-in model whose dequantization is a tiny random model (counted)."""
    spec = _fake_builtin(tmp_path, monkeypatch, os.urandom(3_000_000))
    calls = []

    def dequantize(work: Path, gguf: Path):
        assert gguf.read_bytes()[:16] and gguf.stat().st_size == spec.size  # assembled in full
        calls.append(gguf.name)
        tiny = tiny_model(seed=3)
        return tiny.model, tiny.tokenizer

    monkeypatch.setattr(models, "_dequantize_gguf", dequantize)
    monkeypatch.setitem(models._DEQUANTIZE_S, spec.name, 42)
    before = set_progress(True)
    yield spec, calls
    set_progress(before)


def _progress_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("[specviz]")]


def test_dequantizing_parses_each_gguf_file_once_and_restores_the_reader(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("specviz.test", 7)
    writer.add_tensor("weight", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    original = gguf.GGUFReader
    with models._one_gguf_parse():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # the config, tokenizer and weight loads share one parse
        assert first.fields["specviz.test"].contents() == 7
        assert np.array_equal(first.tensors[0].data, np.arange(8, dtype=np.float32))
    assert gguf.GGUFReader is original
    assert gguf.GGUFReader(path) is not first


def test_first_load_reports_each_stage_once_and_a_cached_load_is_silent(fake_model, tmp_path, capsys):
    spec, calls = fake_model
    cache = tmp_path / "cache"
    assert not builtin_cached(spec.name, "fp32", cache=cache)
    first = load_model(spec.name, "fp32", cache=cache)
    err = capsys.readouterr().err
    lines = _progress_lines(err)
    assert calls == [f"{spec.name}.gguf"]
    assert first.name == spec.name and first.weight_mode == "fp32"
    for expected in ("first use, preparing the fp32 weights",
                     "assembling the GGUF file (0.00 GB) from 2 data packages and checking its sha256",
                     "dequantizing the GGUF weights to fp32 through transformers (about 42 s on a 2-core CPU)",
                     "dequantized in", "saving the fp32 weights and the tokenizer to the cache", "saved in",
                     "fp32 weights ready after"):
        assert sum(expected in line for line in lines) == 1, (expected, lines)
    assert "assemble + sha256" in err and "3.00M/3.00M" in err  # the byte bar reached the file's size
    assert builtin_cached(spec.name, "fp32", cache=cache)

    load_model(spec.name, "fp32", cache=cache)  # cached: silent (transformers' own bar aside), no work
    err = capsys.readouterr().err
    assert _progress_lines(err) == [] and "assemble" not in err and len(calls) == 1

    load_model(spec.name, "bf16", cache=cache)  # a new dtype entry: only its own stage
    lines = _progress_lines(capsys.readouterr().err)
    assert len(lines) == 2 and "converting the cached fp32 weights to bf16" in lines[0]
    assert "bf16 weights ready in" in lines[1] and len(calls) == 1
    load_model(spec.name, "bf16", cache=cache)
    assert _progress_lines(capsys.readouterr().err) == []


def test_progress_can_be_silenced_and_prepare_loads_nothing(fake_model, tmp_path, capsys, monkeypatch):
    spec, calls = fake_model
    cache = tmp_path / "cache"
    loaded = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda *a, **k: loaded.append(a) or pytest.fail("prepare_builtin must not load fp32"))
    set_progress(False)
    entry = prepare_builtin(spec.name, "w8a8-token", cache=cache)  # converted modes start from the fp32 entry
    assert entry == cache / "models" / f"{spec.name}-fp32" and (entry / "specviz.json").exists()
    assert capsys.readouterr().err == "" and calls and not loaded
    assert builtin_cached(spec.name, "w8a8-token", cache=cache) and not builtin_cached(spec.name, "bf16", cache=cache)
    with pytest.raises(ValueError, match="not a built-in model"):
        prepare_builtin("no-such-model", cache=cache)
    with pytest.raises(ValueError, match="auto"):
        builtin_cached(spec.name, "auto", cache=cache)
    with pytest.raises(TypeError, match="True or False"):
        set_progress("no")


def test_a_converted_mode_is_cached_once_per_machine_and_restored_bit_for_bit(fake_model, tmp_path, capsys,
                                                                              monkeypatch):
    import torch

    spec, _ = fake_model
    cache = tmp_path / "cache"
    converts = []
    real = models.convert_model

    def convert(model, mode, tokenizer):
        if mode.convert is not None:  # a float mode casts through it too
            converts.append(mode.name)
        return real(model, mode, tokenizer)

    monkeypatch.setattr(models, "convert_model", convert)  # the built-in cache converts through it
    monkeypatch.setattr(loading, "convert_model", convert)
    first = load_model(spec.name, "w8a8-token", cache=cache)
    lines = _progress_lines(capsys.readouterr().err)
    assert converts == ["w8a8-token"]
    assert any("first use in w8a8-token on this machine: converting" in line for line in lines), lines
    entry = cache / "models" / f"{spec.name}-w8a8-token"
    assert (entry / "layers.safetensors").exists() and not list(entry.parent.glob(".tmp-*"))

    second = load_model(spec.name, "w8a8-token", cache=cache)  # from the cached layers: silent, no conversion
    assert _progress_lines(capsys.readouterr().err) == [] and converts == ["w8a8-token"]
    ids = torch.randint(0, 200, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)

    meta = json.loads((entry / "layers.json").read_text())
    meta["key"]["code_sha256"] = "0" * 64  # made by other conversion code: converted again, replaced
    (entry / "layers.json").write_text(json.dumps(meta))
    load_model(spec.name, "w8a8-token", cache=cache)
    assert converts == ["w8a8-token"] * 2
    assert json.loads((entry / "layers.json").read_text())["key"]["code_sha256"] != "0" * 64
    capsys.readouterr()

    (entry / "layers.safetensors").write_bytes(b"damaged")  # a damaged entry is said and replaced
    third = load_model(spec.name, "w8a8-token", cache=cache)
    assert converts == ["w8a8-token"] * 3
    assert sum("cannot be used" in line for line in _progress_lines(capsys.readouterr().err)) == 1
    with torch.no_grad():
        assert torch.equal(first.model(ids).logits, third.model(ids).logits)
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)  # a cache that cannot be written: said, loads
    (entry / "layers.json").unlink()
    fourth = load_model(spec.name, "w8a8-token", cache=cache)
    assert any("could not cache the w8a8-token layers" in line for line in _progress_lines(capsys.readouterr().err))
    assert fourth.weight_mode == "w8a8-token" and not list(entry.parent.glob(".tmp-*"))


# -- the study prepares before the first notebook ---------------------------------------------

def _plans(preset: Preset, out: Path) -> list:
    plans = []
    for run in preset.runs:
        src = NOTEBOOKS_DIR / run.notebook
        declared = runner.declared_parameters(src)
        plans.append(runner._Plan(run, src, runner.notebook_parameters(run, declared, out), "", declared))
    return plans


def test_models_needed_follow_the_notebooks_parameters(tmp_path):
    target, draft = models.DEFAULT_TARGET, models.DEFAULT_DRAFT
    quick = runner._builtin_models_needed(_plans(get_preset("quick"), tmp_path))
    assert quick == [(target, "fp32"), (draft, "fp32")]  # quick's 06 probes no other mode
    full = runner._builtin_models_needed(_plans(get_preset("full"), tmp_path))
    assert full == [(target, "fp32"), (draft, "fp32"), (target, "bf16")]  # full's 06 probes the target in bf16
    only_toys = Preset("t", "", (NotebookRun("02_trees_masks_attention.ipynb"),
                                 NotebookRun("03_chain_tree_dynamic.ipynb", {"models": "tiny"}),
                                 NotebookRun("04_verification_rules.ipynb", {"real_models": False})))
    assert runner._builtin_models_needed(_plans(only_toys, tmp_path)) == []
    assert runner._builtin_models_needed(_plans(get_preset("tiny"), tmp_path)) == []  # all on the random pair
    assert runner._builtin_models_needed(_plans(get_preset("smoke"), tmp_path)) == [(target, "fp32"), (draft, "fp32")]
    serving = Preset("s", "", (NotebookRun("11_serving.ipynb", {"dtype": "bf16"}),))
    assert runner._builtin_models_needed(_plans(serving, tmp_path)) == [(target, "bf16"), (draft, "bf16")]
    bf16 = Preset("b", "", (NotebookRun("01_quickstart.ipynb", {"dtype": "bf16"}),
                            NotebookRun("09_lookahead.ipynb", {"dtype": "auto"})))  # auto: the notebook's own
    assert runner._builtin_models_needed(_plans(bf16, tmp_path)) == [(target, "bf16"), (draft, "bf16")]
    four_bit = Preset("w", "", (NotebookRun("06_end_to_end_speed.ipynb", {"dtype": "w8a8-token",
                                                                          "draft_dtype": "w4a8-token"}),))
    assert runner._builtin_models_needed(_plans(four_bit, tmp_path)) == [(target, "w8a8-token"),
                                                                          (draft, "w4a8-token")]
    probing = Preset("p", "", (NotebookRun("06_end_to_end_speed.ipynb", {"probe_dtypes": ["bf16"]}),))
    assert runner._builtin_models_needed(_plans(probing, tmp_path)) == [(target, "fp32"), (draft, "fp32"),
                                                                         (target, "bf16")]
    # on a remote Dask cluster, 03, 04 and 06 load the pair on the workers; 01 and 09 still here
    remote = runner._builtin_models_needed(_plans(get_preset("quick"), tmp_path), remote=True)
    assert remote == [(target, "fp32"), (draft, "fp32")]
    assert runner._builtin_models_needed(_plans(get_preset("quick"), tmp_path)[2:6], remote=True) == []


@pytest.fixture
def fake_study(monkeypatch):
    """run_study with stand-ins for the notebooks and the model preparation; yields the
    ordered event log and the set of cached (model, mode) pairs."""
    events: list[str] = []
    cached: set[tuple[str, str]] = set()

    def execute(src, dest, params, progress):
        events.append(f"run {src.stem}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps({"cells": []}))

    def export(executed, html, **kw):
        html.parent.mkdir(parents=True, exist_ok=True)
        html.write_text("<html></html>")
        return html

    def prepare(name, dtype="fp32", cache=None):
        events.append(f"prepare {name} {dtype}")
        cached.add((name, dtype))

    monkeypatch.setattr(runner, "_execute", execute)
    monkeypatch.setattr(runner, "export_html", export)
    monkeypatch.setattr(runner, "_check_kernel", lambda: None)
    monkeypatch.setattr(models, "prepare_builtin", prepare)
    monkeypatch.setattr(models, "builtin_cached", lambda name, dtype="fp32", cache=None: (name, dtype) in cached)
    return events, cached


def test_study_prepares_models_before_the_first_notebook(fake_study, tmp_path):
    events, cached = fake_study
    preset = Preset("p", "", (NotebookRun("02_trees_masks_attention.ipynb"), NotebookRun("01_quickstart.ipynb")))
    lines: list[str] = []
    runner.run_study(preset, out_dir=tmp_path, progress=False, log=lines.append)
    assert events == [f"prepare {models.DEFAULT_TARGET} fp32", f"prepare {models.DEFAULT_DRAFT} fp32",
                      "run 02_trees_masks_attention", "run 01_quickstart"]
    assert sum("preparing the built-in models before the first notebook" in line for line in lines) == 1

    events.clear()
    lines.clear()
    runner.run_study(preset, out_dir=tmp_path, progress=False, log=lines.append, force=True)
    assert events == ["run 02_trees_masks_attention", "run 01_quickstart"]  # cached: no preparation
    assert not any("preparing" in line for line in lines)

    events.clear()
    cached.clear()  # a cleared cache, but every notebook finished earlier: nothing to prepare for
    runner.run_study(preset, out_dir=tmp_path, progress=False, log=lines.append)
    assert events == []

    # --draft-dtype: the draft is prepared in its own mode for the notebooks that take one
    # (a preset's draft mode follows the target's: here w4a8-token beside w8a8-token only)
    speed = Preset("s", "", (NotebookRun("06_end_to_end_speed.ipynb", {"probe_dtypes": []}),),
                   draft_dtypes={"w8a8-token": "w4a8-token"})
    runner.run_study(speed, out_dir=tmp_path / "s", progress=False, log=lines.append, dtype="w8a8-token")
    assert events == [f"prepare {models.DEFAULT_TARGET} w8a8-token", f"prepare {models.DEFAULT_DRAFT} w4a8-token",
                      "run 06_end_to_end_speed"]
    manifest = json.loads((tmp_path / "s" / "study.json").read_text())
    assert manifest["notebooks"][0]["parameters"]["draft_dtype"] == "w4a8-token"
    assert any("the draft runs in w4a8-token beside the w8a8-token target" in line for line in lines)
    events.clear()
    runner.run_study(speed, out_dir=tmp_path / "b", progress=False, log=lines.append, dtype="bf16")
    assert events == [f"prepare {models.DEFAULT_TARGET} bf16", f"prepare {models.DEFAULT_DRAFT} bf16",
                      "run 06_end_to_end_speed"]
    assert "draft_dtype" not in json.loads((tmp_path / "b" / "study.json").read_text())["notebooks"][0]["parameters"]
    bad = dataclasses.replace(speed, name="bad", draft_dtypes={"w8a8-token": "int3"})
    with pytest.raises(runner.StudyConfigError, match="preset 'bad''s draft_dtypes: unknown weight mode 'int3'"):
        runner.run_study(bad, out_dir=tmp_path / "x", progress=False, log=lines.append, dtype="w8a8-token")
    events.clear()  # the command's --draft-dtype wins over the preset's
    runner.run_study(speed, out_dir=tmp_path / "c", progress=False, log=lines.append, dtype="w8a8-token",
                     draft_dtype="w8a8-token")
    assert events == [f"prepare {models.DEFAULT_DRAFT} w8a8-token", "run 06_end_to_end_speed"]


def test_study_reports_models_that_cannot_be_prepared(fake_study, tmp_path, monkeypatch):
    def missing(name, dtype="fp32", cache=None):
        raise FileNotFoundError(f"built-in model {name!r} needs data packages that are not installed")

    monkeypatch.setattr(models, "prepare_builtin", missing)
    preset = Preset("p", "", (NotebookRun("01_quickstart.ipynb"),))
    with pytest.raises(runner.StudyConfigError, match="cannot prepare the built-in model .*not installed"):
        runner.run_study(preset, out_dir=tmp_path, progress=False, log=lambda _: None)
    assert fake_study[0] == []  # no notebook ran
