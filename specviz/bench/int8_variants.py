"""The per-product variants of :mod:`specviz.bench.int8_paths`: how each int8 path (and the
fp32 reference) is built for one product from its fp32 weight, bias and ``w8a8-token`` layer.

* specviz's layer (:func:`_specviz`): the compiled operator with the VNNI kernel or fbgemm's
  product, its PyTorch code, or one activation pass;
* PyTorch's ``quantize_dynamic`` with fbgemm or oneDNN prepacking (:func:`_dynamic_quantized`);
* PT2E (:func:`_pt2e`): ``torch.export``, ``X86InductorQuantizer`` with dynamic activations,
  ``convert_pt2e``, then ``torch.compile``;
* torchao's ``Int8DynamicActivationInt8WeightConfig``, eager or compiled (:func:`_torchao`).

A path that cannot run on this machine raises :class:`Unavailable` with the reason;
:func:`linear_variants` lists them all, the reference (:data:`REFERENCE`) second.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specviz.quant.extension import NO_VNNI_ENV, fused_op_status, vnni_kernel
from specviz.quant.passes import prompt_positions

__all__ = ["REFERENCE", "Unavailable", "Builder", "Variant", "linear_variants"]

#: the variant every row's ``ratio_vs_specviz`` is taken against
REFERENCE = "specviz w8a8-token (compiled op)"


class Unavailable(Exception):
    """A path that cannot run on this machine; the message says why."""


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None) if old is None else os.environ.__setitem__(name, old)


#: (fp32 weight (N, K), bias or None, the w8a8-token layer, the row counts it will see) ->
#: a function of (M, K) float32 inputs returning (M, N) float32
Builder = Callable[..., Callable[[torch.Tensor], torch.Tensor]]


def _fp32(w, b, layer, ms):
    return lambda x: F.linear(x, w, b)


def _specviz(vnni: bool, one_pass: bool = False, pytorch: bool = False) -> Builder:
    """specviz's layer as ``w8a8-token`` runs it in decoding (residual pass on), with the
    VNNI kernel or fbgemm's product, or in its PyTorch code, or in one activation pass
    (what the rows of a prompt run; the library paths' accuracy class)."""
    def build(w, b, layer, ms):
        if vnni and not vnni_kernel():
            why = "the CPU has no AVX-512 VNNI" if "compiled" in fused_op_status() else fused_op_status()
            raise Unavailable(f"the VNNI kernel does not run here: {why}")
        if not vnni and getattr(layer, "_vnni", None) is not None:
            with _env(NO_VNNI_ENV, "1"):
                layer = copy.deepcopy(layer)  # packs again, without the VNNI layout
        if pytorch:
            return lambda x: layer.forward_pytorch(x)
        if "compiled" not in fused_op_status():
            raise Unavailable(fused_op_status())
        if one_pass:
            def run(x):
                with prompt_positions(x.shape[0], 0, x.shape[0]):
                    return layer(x)
            return run
        return layer
    return build


def _dynamic_quantized(engine: str) -> Builder:
    """PyTorch's dynamic quantization (``torch.ao.quantization.quantize_dynamic``: int8
    weights per tensor, activations quantized per forward with 7-bit range), its weight
    prepacked by ``engine``."""
    def build(w, b, layer, ms):
        if engine not in torch.backends.quantized.supported_engines:
            raise Unavailable(f"no {engine} quantized engine in this PyTorch")
        lin, old = _plain_linear(w, b), torch.backends.quantized.engine
        torch.backends.quantized.engine = engine
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return torch.ao.quantization.quantize_dynamic(nn.Sequential(lin), {nn.Linear}, dtype=torch.qint8)
        finally:
            torch.backends.quantized.engine = old
    return build


def _plain_linear(w, b) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    lin.weight.data.copy_(w)
    lin.bias.data.copy_(b) if b is not None else None
    return lin.eval()


def _compiled(module: nn.Module, k: int, ms: tuple[int, ...]):
    """``torch.compile(module)`` (dynamic rows, frozen weights), called once per row count so
    every specialisation compiles before timing. Every compiled module shares one frame, so
    the recompile limit is raised: at the default 8 the fifth product ran eagerly."""
    torch._inductor.config.freezing = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    fn = torch.compile(module, dynamic=True)
    with torch.no_grad():
        for m in sorted(ms, key=lambda m: (m == 1, m)):  # M = 1 last: it specialises
            fn(torch.randn(m, k))
    return fn


def _pt2e(w, b, layer, ms):
    """PT2E: ``torch.export`` with a dynamic row count, ``X86InductorQuantizer`` (dynamic
    per-tensor uint8 activations, per-channel int8 weights), ``convert_pt2e``, then
    ``torch.compile`` with freezing, which lowers the product to oneDNN's
    ``qlinear_pointwise``."""
    try:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    except Exception as exc:  # not installed, or built for another torch
        raise Unavailable(f"torchao's PT2E does not import ({type(exc).__name__}: {exc})"[:300]) from exc
    lin, x = _plain_linear(w, b), torch.randn(max(2, max(ms)), w.shape[1])
    rows = torch.export.Dim("rows", min=1, max=1024)
    with torch.no_grad():
        exported = torch.export.export(lin, (x,), dynamic_shapes=({0: rows},)).module()
        quantizer = xiq.X86InductorQuantizer().set_global(
            xiq.get_default_x86_inductor_quantization_config(is_dynamic=True))
        prepared = prepare_pt2e(exported, quantizer)
        prepared(x)
        converted = convert_pt2e(prepared)
    return _compiled(converted, w.shape[1], ms)


def _torchao(compiled: bool) -> Builder:
    """torchao's ``Int8DynamicActivationInt8WeightConfig`` (int8 per-token symmetric
    activations, int8 per-channel weights) through ``quantize_``, eager or compiled."""
    def build(w, b, layer, ms):
        try:
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
        except Exception as exc:
            raise Unavailable(f"torchao does not import ({type(exc).__name__}: {exc})"[:300]) from exc
        lin = _plain_linear(w, b)
        quantize_(lin, Int8DynamicActivationInt8WeightConfig())
        if not compiled:
            return lin
        return _compiled(lin, w.shape[1], ms)
    return build


@dataclass(frozen=True)
class Variant:
    name: str
    family: str  # "reference", "specviz" or "library"
    build: Builder


def linear_variants() -> list[Variant]:
    """Every per-product variant, the reference (:data:`REFERENCE`) second."""
    return [
        Variant("fp32 nn.Linear", "reference", _fp32),
        Variant(REFERENCE, "specviz", _specviz(vnni=vnni_kernel())),
        # the reference is the VNNI kernel where it runs: then the other kernel is fbgemm's
        # product; elsewhere the VNNI kernel is a row saying why it does not run
        (Variant("specviz w8a8-token (fbgemm product, SPECVIZ_NO_VNNI=1)", "specviz", _specviz(vnni=False))
         if vnni_kernel() else Variant("specviz w8a8-token (VNNI kernel)", "specviz", _specviz(vnni=True))),
        Variant("specviz w8a8-token (PyTorch code)", "specviz", _specviz(vnni=False, pytorch=True)),
        Variant("specviz w8a8-token (one pass, compiled op)", "specviz", _specviz(vnni=vnni_kernel(), one_pass=True)),
        Variant("torch quantize_dynamic (fbgemm)", "library", _dynamic_quantized("fbgemm")),
        Variant("torch quantize_dynamic (onednn)", "library", _dynamic_quantized("onednn")),
        Variant("PT2E X86InductorQuantizer + torch.compile (onednn qlinear)", "library", _pt2e),
        Variant("torchao Int8DynamicActivationInt8WeightConfig (eager)", "library", _torchao(False)),
        Variant("torchao Int8DynamicActivationInt8WeightConfig + torch.compile", "library", _torchao(True)),
    ]
