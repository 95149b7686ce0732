"""Model layer: registry errors, cache hygiene, local loading, tokenizer checks, tiny models."""

import hashlib
import os
from pathlib import Path

import pytest
import torch

import specviz.models.builtin as models
from specviz.quant.weights import float_dtype
from specviz.models.builtin import BuiltinModel
from specviz.models.loading import check_same_tokenizer, load_model, load_pair
from specviz.models.tiny import tiny_model, tiny_pair, tiny_tokenizer
from specviz.models.types import TokenizerMismatchError


def _fake_builtin(tmp_path: Path, monkeypatch, payload: bytes, n_parts: int = 2, size=None, sha=None,
                  name: str = "fake-model") -> BuiltinModel:
    """Install fake data packages ``fakedatapkg_partN`` holding ``payload`` split in parts."""
    site = tmp_path / "site"
    chunk = -(-len(payload) // n_parts)
    for i in range(1, n_parts + 1):
        pkg = site / f"fakedatapkg_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(payload[(i - 1) * chunk:i * chunk])
    monkeypatch.syspath_prepend(str(site))
    spec = BuiltinModel(name=name, role="draft", package_prefix="fakedatapkg-part", n_parts=n_parts,
                        version="0.0.1", size=len(payload) if size is None else size,
                        sha256=hashlib.sha256(payload).hexdigest() if sha is None else sha)
    monkeypatch.setitem(models.BUILTIN_MODELS, name, spec)
    return spec


def _no_entries_left(cache: Path) -> bool:
    root = cache / "models"
    return not root.exists() or not any(root.iterdir())


def test_assemble_checks_hash_and_concatenates(tmp_path, monkeypatch):
    payload = os.urandom(10_001)
    spec = _fake_builtin(tmp_path, monkeypatch, payload, n_parts=3)
    out = tmp_path / "x.gguf"
    models._assemble_gguf(spec, out)
    assert out.read_bytes() == payload


def test_corrupted_part_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    payload = os.urandom(4096)
    _fake_builtin(tmp_path, monkeypatch, payload, sha="0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="sha256 .* does not match"):
        load_model("fake-model", cache=cache)
    assert _no_entries_left(cache)


def test_truncated_part_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    payload = os.urandom(4096)
    _fake_builtin(tmp_path, monkeypatch, payload, size=len(payload) + 100)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="truncated or corrupted"):
        load_model("fake-model", cache=cache)
    assert _no_entries_left(cache)


def test_missing_data_package_names_pip_command(tmp_path, monkeypatch):
    spec = BuiltinModel(name="absent-model", role="draft", package_prefix="specviz-no-such-package-part",
                        n_parts=2, version="1.2.3", size=1, sha256="0" * 64)
    monkeypatch.setitem(models.BUILTIN_MODELS, spec.name, spec)
    with pytest.raises(FileNotFoundError) as info:
        load_model("absent-model", cache=tmp_path)
    msg = str(info.value)
    assert "pip install specviz-no-such-package-part1==1.2.3 specviz-no-such-package-part2==1.2.3" in msg


def test_stale_temporary_entries_are_removed(tmp_path, monkeypatch):
    payload = os.urandom(512)
    _fake_builtin(tmp_path, monkeypatch, payload, sha="f" * 64)
    stale = tmp_path / "cache" / "models" / ".tmp-killed-run"
    stale.mkdir(parents=True)
    (stale / "half.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError):
        load_model("fake-model", cache=tmp_path / "cache")
    assert not stale.exists()


def test_unwritable_cache_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(PermissionError, match="not writable.*SPECVIZ_CACHE"):
        models.cache_dir(blocker / "cache")


def test_cache_dir_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "moved"))
    assert models.cache_dir() == tmp_path / "moved"
    assert (tmp_path / "moved").is_dir()


@pytest.mark.parametrize("bad", ["", "   ", None, 3])
def test_bad_model_argument(bad):
    with pytest.raises(ValueError, match="built-in name"):
        load_model(bad)


def test_unknown_name_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="not a built-in"):
        load_model("no-such-model-anywhere-xyz")


def test_file_instead_of_directory(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"123")
    with pytest.raises(ValueError, match="is a file, not a model directory"):
        load_model(str(f))


def test_float_dtype_parsing():
    assert float_dtype("bf16") is torch.bfloat16
    assert float_dtype("float32") is torch.float32
    assert float_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="'w8a8-token' quantizes its weights"):
        float_dtype("w8a8-token")
    with pytest.raises(ValueError, match="unknown weight mode"):
        float_dtype(torch.int64)
    with pytest.raises(ValueError, match="resolve it into a mode first"):
        float_dtype("auto")


def test_local_directory_round_trip(tmp_path):
    tiny = tiny_model(seed=3)
    tiny.model.save_pretrained(tmp_path / "m")
    tiny.tokenizer.save_pretrained(tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"), dtype="fp32")
    assert loaded.dtype == torch.float32
    assert next(loaded.model.parameters()).dtype == torch.float32
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(loaded.model(ids).logits, tiny.model(ids).logits, rtol=0, atol=0)
    bf16 = load_model(str(tmp_path / "m"), dtype="bf16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    assert loaded.tokenizer.get_vocab() == tiny.tokenizer.get_vocab()


def test_loaded_model_passthrough_and_cast():
    tiny = tiny_model()
    assert load_model(tiny, dtype="fp32") is tiny
    cast = load_model(tiny, dtype="bf16")
    assert cast.dtype == torch.bfloat16 and tiny.dtype == torch.float32
    assert next(tiny.model.parameters()).dtype == torch.float32  # original untouched


def test_tiny_models_are_deterministic_and_usable():
    a, b = tiny_model(seed=1), tiny_model(seed=1)
    ids = a.tokenizer("def f(x): return x", return_tensors="pt")["input_ids"]
    torch.testing.assert_close(a.model(ids).logits, b.model(ids).logits, rtol=0, atol=0)
    assert a.vocab_size == len(a.tokenizer)
    chat = a.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n")
    assert a.tokenizer.decode(a.tokenizer("héllo wörld")["input_ids"]) == "héllo wörld"


def test_tiny_pair_draft_differs_but_agrees_often():
    pair = tiny_pair(seed=0)
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    t = pair.target.model(ids).logits.argmax(-1)
    d = pair.draft.model(ids).logits.argmax(-1)
    agree = (t == d).float().mean().item()
    assert 0.4 < agree < 0.95


def test_pair_with_different_vocabulary_is_refused():
    target = tiny_model(seed=0)
    other_tok = tiny_tokenizer()
    other_tok.add_tokens(["<extra_token>"])
    draft = tiny_model(seed=1, tokenizer=other_tok)
    with pytest.raises(TokenizerMismatchError, match=r"vocabulary differs.*only in draft: \['<extra_token>'\]"):
        load_pair(target, draft, dtype="fp32")


def test_pair_with_different_special_tokens_is_refused():
    target_tok, draft_tok = tiny_tokenizer(), tiny_tokenizer()
    draft_tok.eos_token = "<|endoftext|>"
    with pytest.raises(TokenizerMismatchError, match="eos_token_id differs: target 256, draft 257"):
        check_same_tokenizer(target_tok, draft_tok)


def test_a_pair_found_equal_is_checked_again_after_a_change():
    target_tok, draft_tok = tiny_tokenizer(), tiny_tokenizer()
    check_same_tokenizer(target_tok, draft_tok)
    check_same_tokenizer(target_tok, draft_tok)  # remembered
    draft_tok.eos_token = "<|endoftext|>"
    with pytest.raises(TokenizerMismatchError, match="eos_token_id differs"):
        check_same_tokenizer(target_tok, draft_tok)
    other = tiny_tokenizer()
    check_same_tokenizer(target_tok, other)
    other.add_tokens(["<extra_token>"])
    with pytest.raises(TokenizerMismatchError, match="only in draft"):
        check_same_tokenizer(target_tok, other)


def test_pair_of_tiny_models_loads():
    pair = load_pair(tiny_model(seed=0), tiny_model(seed=1), dtype="fp32")
    assert pair.target.name != pair.draft.name
