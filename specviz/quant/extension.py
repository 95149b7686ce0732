"""specviz's compiled operators: :class:`~specviz.quant.weights.W8A8TokenLinear`'s forward
in one call, and :class:`~specviz.quant.w4a8.W4A8TokenLinear`'s (:func:`w4a8_token_op`).

A one-token forward of the 1.5B target in ``w8a8-token`` spends about as long in the
small operators that quantize each layer's input per token and rescale fbgemm's output
as in the integer products themselves (113 layers x some 25 operators). The C++ source
``csrc/w8a8_token.cpp`` does that arithmetic in a few passes over each row around the
same fbgemm product and registers it as ``torch.ops.specviz.w8a8_token_linear``.

On CPUs with AVX-512 VNNI, forwards of at most
:attr:`~specviz.quant.weights.W8A8TokenLinear.vnni_max_rows` fed rows (by default every
forward: decoding, verification and prefills) take their integer products from the
operator's own kernel instead of fbgemm's: each block of 64 output channels streams from
memory once and ``vpdpbusd`` multiplies it by every row, six rows at a time, with the
accumulators in registers. On a 2-core AMD EPYC (AVX512-BF16) the 1.5B target's forward
of 3 tokens after 200 took 50-67 ms against 69-74 ms with fbgemm's product (one token:
47-60 either way), 8 tokens 101-103 against 124-128 ms. Its products are the same exact
integers, rescaled with the same single rounding, so both kernels give bit-identical
outputs (:func:`vnni_kernel` says whether it runs; ``SPECVIZ_NO_VNNI=1`` keeps fbgemm).
The layer keeps its weights in both layouts (fbgemm's for CPUs without VNNI and for the
PyTorch code), twice the int8 bytes in memory.

The same library holds ``torch.ops.specviz.w4a8_decoder_layer``, a whole decoder layer of
a ``w4a8-token`` draft in one call (:mod:`specviz.models.fused`).
It is compiled on first use with PyTorch's ``cpp_extension`` (a C++ compiler and the
Python headers are needed; about half a minute on 2 cores) into PyTorch's extension directory
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), under a name that
changes with the source, the PyTorch version and the compiler flags, and loaded from
there afterwards. Where it cannot be built the layers run their PyTorch code, which
computes the same products (:func:`fused_op_status` says which path runs and why);
``SPECVIZ_NO_EXTENSION=1`` selects the PyTorch code.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import warnings
from pathlib import Path

import torch

__all__ = ["w8a8_token_op", "w4a8_token_op", "fused_op_status", "vnni_kernel", "EXTENSION_SOURCE", "NO_VNNI_ENV"]

#: ``SPECVIZ_NO_VNNI=1`` keeps fbgemm's product for every forward, even where the VNNI
#: kernel could run
NO_VNNI_ENV = "SPECVIZ_NO_VNNI"

#: the C++ source of the operator
EXTENSION_SOURCE = Path(__file__).resolve().parent / "csrc" / "w8a8_token.cpp"
# AVX2 + FMA are what fbgemm's x86 kernels need anyway (the VNNI kernel asks for AVX-512 on
# its own functions and runs only where the CPU has it); contraction off keeps a multiply
# followed by an add two roundings, as in the PyTorch code. OpenMP makes at::parallel_for
# share the work among PyTorch's threads (without it the loops run on one thread); the
# runtime is the libgomp.so.1 that PyTorch has already loaded.
_CFLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fno-math-errno", "-fopenmp")
_LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_state: dict = {"tried": False, "op": None, "why": "not built yet"}


def _disabled() -> bool:
    return os.environ.get("SPECVIZ_NO_EXTENSION", "").strip().lower() in ("1", "true", "yes")


def _cpu_supported() -> str | None:
    """Why this CPU cannot run the operator, or None."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "PyTorch has no fbgemm engine here (x86 CPUs only)"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU reports {capability}, the operator is built for AVX2"
    return None


def _build_name() -> str:
    digest = hashlib.sha256()
    digest.update(EXTENSION_SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    return f"specviz_w8a8_token_{digest.hexdigest()[:12]}"


def _remove_stale_lock(build_dir: Path, older_than_s: float = 600.0) -> None:
    """A build killed half-way leaves its lock file behind, and every later build would
    wait for it forever; a lock older than any build takes is removed."""
    lock = build_dir / "lock"
    try:
        if lock.exists() and time.time() - lock.stat().st_mtime > older_than_s:
            lock.unlink()
    except OSError:
        pass


def _untraced(fn):
    """``bool(fn())`` outside any trace being recorded (a tracer cannot record an operator
    that returns a bool, and the answer is a fact about the CPU, not a step to record)."""
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        return bool(fn())
    finally:
        torch._C._set_tracing_state(state)


def w8a8_token_op():
    """``torch.ops.specviz.w8a8_token_linear``, compiled and loaded on the first call, or
    None where it is disabled (``SPECVIZ_NO_EXTENSION=1``) or cannot be built (a warning
    says why, once per process)."""
    if _disabled():
        return None
    if _state["tried"]:
        return _state["op"]
    with _lock:
        if _state["tried"]:
            return _state["op"]
        why = _cpu_supported()
        if why is None:
            try:
                from torch.utils.cpp_extension import _get_build_directory, load

                name = _build_name()
                _remove_stale_lock(Path(_get_build_directory(name, False)))
                load(name=name, sources=[str(EXTENSION_SOURCE)], extra_cflags=list(_CFLAGS),
                     extra_ldflags=list(_LDFLAGS),
                     is_python_module=False, verbose=False)
                _state["op"] = torch.ops.specviz.w8a8_token_linear
                _state["vnni"] = _untraced(torch.ops.specviz.vnni_available)
                why = "compiled operator"
            except Exception as exc:  # no compiler, no headers, a build error: fall back, say so
                why = f"cannot build the compiled operator ({type(exc).__name__}: {str(exc).strip()[:300]})"
                warnings.warn(f"specviz: {why}; w8a8-token layers run their slower PyTorch code", RuntimeWarning,
                              stacklevel=2)
        _state["why"] = why
        _state["tried"] = True
    return _state["op"]


def w4a8_token_op():
    """``torch.ops.specviz.w4a8_token_linear`` (:class:`~specviz.quant.w4a8.W4A8TokenLinear`'s
    forward, from the same compiled library as :func:`w8a8_token_op`), or None where that
    library is disabled or cannot be built."""
    return None if w8a8_token_op() is None else torch.ops.specviz.w4a8_token_linear


def fused_op_status() -> str:
    """Which code ``w8a8-token`` layers run in this process, and why: ``"compiled
    operator"``, or the reason the PyTorch code runs instead."""
    if _disabled():
        return "PyTorch code (SPECVIZ_NO_EXTENSION is set)"
    w8a8_token_op()
    return _state["why"] if _state["op"] is not None else f"PyTorch code: {_state['why']}"


def vnni_kernel() -> bool:
    """Whether ``w8a8-token`` layers built now take their integer products (every forward's, by
    default: :attr:`~specviz.quant.w8a8.W8A8TokenLinear.vnni_max_rows`) from the
    compiled operator's own AVX-512 VNNI kernel: the operator is built, the CPU has AVX-512
    VNNI and ``SPECVIZ_NO_VNNI`` is not set. Elsewhere fbgemm computes them (the same values,
    bit for bit)."""
    if os.environ.get(NO_VNNI_ENV, "").strip().lower() in ("1", "true", "yes"):
        return False
    return w8a8_token_op() is not None and bool(_state.get("vnni", False))
