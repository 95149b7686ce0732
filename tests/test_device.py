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


def test_a_file_missing_other_columns_is_still_refused(tmp_path):
    path = tmp_path / "x.csv"
    pd.DataFrame({"method": ["plain"], "device": ["cpu"]}).to_csv(path, index=False)
    with pytest.raises(ValueError, match="not a specviz benchmark CSV"):
        load_results(path)


# -- on a CUDA GPU ---------------------------------------------------------------------------------

STRATEGIES = ("chain-k3", "tree-2x2x2", "dynamic-w2-d3-b8", "ngram-n2-k4", "lookahead-w3-n3-g3", "adaptive-heuristic",
              "self-spec-L1-k3", "jacobi-k3")


@pytest.fixture(scope="module")
def cuda_pair():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return tiny_pair(device="cuda")


@needs_cuda
def test_cuda_pair_lives_on_the_gpu_and_returns_cpu_logits(cuda_pair):
    assert cuda_pair.target.device.type == "cuda" and cuda_pair.draft.device.type == "cuda"
    logits = forward_tokens(cuda_pair.target.model, new_cache(cuda_pair.target.model),
                            torch.tensor([[1, 2, 3]]), torch.arange(3)[None], torch.ones(1, 3, 3, dtype=torch.bool).tril())
    assert logits.device.type == "cpu"
    cpu = tiny_pair()
    ref = forward_tokens(cpu.target.model, new_cache(cpu.target.model), torch.tensor([[1, 2, 3]]),
                         torch.arange(3)[None], None)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


@needs_cuda
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_greedy_identity(cuda_pair, strategy):
    prompt = "def fizzbuzz(n):"
    plain = plain_generate(cuda_pair.target, prompt, max_new_tokens=40, stop_at_eos=False)
    drafter = build_drafter(strategy, cuda_pair)
    spec = speculative_generate(cuda_pair.target, drafter, prompt, max_new_tokens=40, stop_at_eos=False)
    assert spec.output_ids == plain.output_ids


@needs_cuda
def test_cuda_batch_and_sampling(cuda_pair):
    prompts = ["def add(a, b):", "What is 17 * 23?", "Translate: the cat sleeps."]
    drafter = build_drafter("chain-k3", cuda_pair)
    plain = [plain_generate(cuda_pair.target, p, max_new_tokens=24, stop_at_eos=False).output_ids for p in prompts]
    batch = speculative_generate_batch(cuda_pair.target, drafter, prompts, max_new_tokens=24, stop_at_eos=False)
    assert [r.output_ids for r in batch] == plain
    sampled = speculative_generate(cuda_pair.target, drafter, prompts[0], max_new_tokens=24, stop_at_eos=False,
                                   config=SamplingConfig(temperature=0.8), verifier="specinfer", seed=3)
    again = speculative_generate(cuda_pair.target, drafter, prompts[0], max_new_tokens=24, stop_at_eos=False,
                                 config=SamplingConfig(temperature=0.8), verifier="specinfer", seed=3)
    assert len(sampled.output_ids) == 24 and sampled.output_ids == again.output_ids


@needs_cuda
def test_cuda_benchmark_records_the_device(tmp_path):
    out = tmp_path / "cuda.csv"
    assert bench_main(["--models", "tiny", "--device", "cuda", "--dtype", "fp32", "--limit", "2",
                       "--max-new-tokens", "12", "--warmup-tokens", "4", "--out", str(out),
                       "--methods", "plain", "hf-assisted", "chain-k2", "ngram-n2-k3"]) == 0
    rows = load_results(out)
    assert set(rows["device"]) == {"cuda"}
    assert rows.loc[rows["method"] != "plain", "matches_plain"].notna().all()


def test_heads_train_and_draft_exactly_on_the_cpu(tiny_pair, tmp_path, monkeypatch):
    heads_train_and_draft_exactly(tiny_pair, tmp_path, monkeypatch)


def heads_train_and_draft_exactly(pair, cache_dir, monkeypatch):
    """Medusa heads and an EAGLE head trained on ``pair``'s device (features, training,
    drafting), each drafting greedy output equal to plain decoding's."""
    monkeypatch.setenv("SPECVIZ_CACHE", str(cache_dir))
    seqs, lens = [], []
    for prompt in ("def add(a, b):", "List three colours.", "What is 17 * 23?"):
        out = plain_generate(pair.target, prompt, max_new_tokens=24, stop_at_eos=False, chat=False)
        seqs.append(list(out.prompt_ids) + list(out.output_ids))
        lens.append(len(out.prompt_ids))
    corpus = Corpus.from_sequences(seqs, lens)
    prompt = "def fizzbuzz(n):"
    plain = plain_generate(pair.target, prompt, max_new_tokens=32, stop_at_eos=False)
    for kind in ("medusa", "eagle"):
        result = train_heads(kind, pair.target, corpus, steps=15, config=HeadConfig(window=24, batch_size=4),
                             progress=False)
        drafter = head_drafter(pair, result.path, topk=2, depth=3, budget=6)
        assert next(drafter.heads.parameters()).device == pair.target.device
        spec = speculative_generate(pair.target, drafter, prompt, max_new_tokens=32, stop_at_eos=False)
        assert spec.output_ids == plain.output_ids, kind
        assert 0 < spec.n_steps <= len(plain.output_ids)


@needs_cuda
def test_cuda_heads_train_and_draft_exactly(cuda_pair, tmp_path, monkeypatch):
    heads_train_and_draft_exactly(cuda_pair, tmp_path, monkeypatch)
