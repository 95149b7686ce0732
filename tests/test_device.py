"""Devices (specviz.models.device): name resolution and its errors everywhere, logits that come
back to the CPU, old benchmark files read as CPU rows; with a CUDA GPU, the tiny pair's greedy
identity, batches, sampling, trained heads and the benchmark on it (skipped without one)."""

import pandas as pd
import pytest
import torch

from specviz.bench.__main__ import main as bench_main
from specviz.bench.e2e import COLUMNS, load_results
from specviz.decode.engine import plain_generate, speculative_generate, speculative_generate_batch
from specviz.draft.registry import build_drafter
from specviz.heads import Corpus, HeadConfig, head_drafter, train_heads
from specviz.locations import REPO_ROOT
from specviz.models import device as devmod
from specviz.models.device import model_device, resolve_device, synchronize
from specviz.models.kvcache import forward_tokens, new_cache
from specviz.models.loading import load_model
from specviz.models.tiny import tiny_model, tiny_pair
from specviz.quant.weights import WEIGHT_MODES
from specviz.sampling import SamplingConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_auto_and_cpu_resolve_on_any_machine():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    assert resolve_device("auto").type == devmod.available_devices()[0]
    assert resolve_device(None) == resolve_device("auto")
    assert devmod.available_devices()[-1] == "cpu"


@pytest.mark.parametrize("bad", ["tpu", "gpu", "", "cuda:x"])
def test_unknown_device_names_the_choices(bad):
    with pytest.raises(ValueError, match="unknown device .*auto, cpu, cuda, mps"):
        resolve_device(bad)


def test_absent_device_is_named(monkeypatch):
    monkeypatch.setattr(devmod, "available_devices", lambda: ["cpu"])
    with pytest.raises(ValueError, match="device 'cuda' is not available on this machine .*available: cpu"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="'mps' is not available"):
        tiny_model(device="mps")


def test_auto_skips_devices_a_weight_mode_cannot_run_on(monkeypatch):
    monkeypatch.setattr(devmod, "available_devices", lambda: ["cuda", "cpu"])
    assert resolve_device("auto", WEIGHT_MODES["w8a8-token"]) == torch.device("cpu")
    assert resolve_device("auto", WEIGHT_MODES["w4a8-token"]) == torch.device("cpu")
    assert resolve_device("auto", WEIGHT_MODES["bf16"]) == torch.device("cuda")
    with pytest.raises(ValueError, match="weight mode 'w4a8-token' runs on cpu only, not on cuda"):
        resolve_device("cuda", WEIGHT_MODES["w4a8-token"])


def test_cli_device_errors(capsys):
    assert bench_main(["--models", "tiny", "--device", "tpu", "--limit", "1", "--out", "x.csv"]) == 2
    assert "--device: unknown device 'tpu'" in capsys.readouterr().err
    from specviz.checks.__main__ import main as checks_main

    with pytest.raises(SystemExit):
        checks_main(["--device", "quantum"])
    assert "--device: unknown device 'quantum'" in capsys.readouterr().err


def test_cpu_model_logits_stay_on_the_cpu(tiny_pair):
    assert tiny_pair.target.device == torch.device("cpu") == model_device(tiny_pair.target.model)
    assert load_model(tiny_pair.target, "fp32", device="cpu") is tiny_pair.target
    logits = forward_tokens(tiny_pair.target.model, new_cache(tiny_pair.target.model),
                            torch.tensor([[1, 2, 3]]), torch.arange(3)[None], None)
    assert logits.device.type == "cpu" and logits.dtype == torch.float32
    synchronize("cpu")  # a no-op, but callable everywhere


def test_old_benchmark_files_read_as_cpu_rows():
    rows = load_results(REPO_ROOT / "outputs" / "reference" / "bench-greedy.csv")
    assert list(rows.columns) == list(COLUMNS)
    assert set(rows["device"]) == {"cpu"}
    assert rows["bandwidth_gb_s"].isna().all() and rows["bound_tokens_per_s"].isna().all()  # not measured then


def test_copy_bandwidth_and_device_name():
    from specviz.data.machine import cpu_label

    assert devmod.device_name("cpu") == devmod.device_name() == cpu_label()
    assert devmod.copy_bandwidth("cpu", nbytes=1 << 22, repeats=3) > 0
    for kwargs, message in (({"nbytes": 2}, "nbytes must be"), ({"repeats": 0}, "repeats must be")):
        with pytest.raises(ValueError, match=message):
            devmod.copy_bandwidth("cpu", **kwargs)


def test_decode_bytes_leave_out_the_embedding_table_unless_the_head_shares_it():
    from specviz.bench.serving import decode_bytes, model_bytes

    untied, tied = tiny_model(seed=0), tiny_model(seed=0)
    untied_head = untied.model.get_output_embeddings()
    untied_head.weight = torch.nn.Parameter(untied_head.weight.detach().clone())
    embedding = tied.model.get_input_embeddings().weight
    tied.model.get_output_embeddings().weight = embedding
    table = embedding.numel() * embedding.element_size()
    assert model_bytes(untied) == model_bytes(tied) + table
    assert decode_bytes(untied) == decode_bytes(tied) == model_bytes(tied)  # the head's bytes, once
