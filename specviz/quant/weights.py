"""Weight modes: how a model's linear layers store their weights and compute their product.

Each mode has one name:

* ``fp32`` - plain ``nn.Linear`` in float32: the exactness reference (the only lossless mode);
* ``bf16`` - plain ``nn.Linear`` in bfloat16 (``fp16`` likewise in float16, the usual float
  on MPS and CUDA): the accelerators' mode, and the CPU's where it has bf16 arithmetic;
* ``w8a8-token`` - int8 weights (one scale per output channel) times int8 activations
  quantized per token, with a second int8 pass over each token's rounding residual, after
  SmoothQuant smoothing calibrated on a fixed text (:class:`W8A8TokenLinear`; x86 CPUs).
  It is batch-invariant (a token's projections do not depend on the other tokens of its
  forward), so verifying a draft computes what decoding its tokens one by one would;
  prefills run through the same kernel, the prompt's positions without the residual pass
  (:mod:`specviz.quant.passes`). Layers that read one input (query/key/value, gate/up)
  are computed as one product (:class:`SharedInputGroup`): 4 integer products per decoder
  layer instead of 7. Each product runs as one compiled operator where a C++ compiler is
  at hand (:mod:`specviz.quant.extension`, bit for bit what the layer's PyTorch code
  computes, with a fraction of its per-layer overhead).
* ``w4a8-token`` - 4-bit weights with a float16 scale and minimum per 64 inputs times
  ``w8a8-token``'s activations, in the compiled operator's own kernel for every row count
  (:class:`~specviz.quant.w4a8.W4A8TokenLinear`): 4.5 bits per weight against 8, and
  on the 1.5B target a teacher-forced agreement with fp32 of 0.938 against ``w8a8-token``'s
  0.979 (lossy); meant for draft models, whose accuracy costs acceptance, not exactness.

Retired modes (``int8``, ``int4``, ``w8a8``, ``fp32-wx``: :data:`RETIRED_MODES`) are
refused by name with the reason: a mode stays only where a committed result shows it
winning, it is the exactness reference, or a notebook teaches with it.

Every entry point names the mode ``dtype`` (``--dtype`` on the command lines; the draft's own
``draft_dtype`` / ``--draft-dtype``) and parses it with :func:`parse_weight_mode`. ``auto``,
the fastest mode that passes the accuracy bar on the machine, is resolved by
:func:`specviz.bench.auto.resolve_auto` (the study's quick preset and ``--dtype auto``). The
library and every command (the benchmark, the study's notebooks, the checks, trained heads,
draft vocabularies, the explorer) default to ``fp32``, the reference; a faster mode is
always asked for by name or as ``auto``.

:func:`quantize_model` replaces every ``nn.Linear`` of a transformers model (attention and
MLP projections and the LM head) in place. A tied LM head gets its own converted copy; the
embedding table stays a float32 parameter, so ``model.dtype`` is the activation dtype.

Dimension legend: M = rows fed (tokens), K = in_features, N = out_features.
"""

from __future__ import annotations

import functools
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from specviz.quant.extension import vnni_kernel, w8a8_token_op
from specviz.quant.passes import by_position
from specviz.quant.w4a8 import W4A8TokenLinear, smoothing

__all__ = [
    "WeightMode",
    "is_auto",
    "float_dtype",
    "WEIGHT_MODES",
    "RETIRED_MODES",
    "W8A8TokenLinear",
    "W4A8TokenLinear",
    "SharedInputGroup",
    "SharedInputSlice",
    "input_absmax",
    "parse_weight_mode",
    "quantize_model",
    "weight_mode_of",
    "CACHEABLE_MODES",
    "converted_layers",
    "restore_converted",
]

# w8a8-token's weights use 7 bits: fbgemm's AVX2 kernel adds pairs of uint8 x int8 products in
# int16, which 2 x 255 x 63 never overflows (2 x 255 x 127 does).
_W8A8_WEIGHT_LEVELS = 63.0
_W8A8_TOKEN_CODES = 127.0  # W8A8TokenLinear's activation codes: [-127, 127] around fbgemm's zero point 128


def _flat(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """(..., K) -> (M, K), checking K."""
    if x.shape[-1] != in_features:
        raise ValueError(f"expected input (..., {in_features}), got {tuple(x.shape)}")
    return x.reshape(-1, in_features)


def _bf16_at_least(value: torch.Tensor) -> torch.Tensor:
    """``value`` (float32) rounded to bfloat16, upwards, so a range it must cover stays covered."""
    rounded = value.to(torch.bfloat16)
    up = torch.nextafter(rounded, torch.full_like(rounded, float("inf")))
    return torch.where(rounded.float() < value, up, rounded)


def _fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def vnni_layout(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int8 weight in the layout of the compiled operator's AVX-512 VNNI kernel.

    Returns ``(weight, offsets, scales)``: ``weight`` int8 ``(NG, KG, 64, 4)`` with
    ``weight[c, g, j, i] = qweight[64 c + j, 4 g + i]`` (zero past N or K), so that each
    group of 64 output channels is one contiguous stream and each 64-byte vector is what
    one ``vpdpbusd`` multiplies by four activation bytes; ``offsets`` int32 ``(N,)`` = 128
    x each row's sum (the kernel's activations are codes + 128, fbgemm's zero point);
    ``scales`` float32 ``(N,)``.
    """
    n, k = qweight.shape
    ng, kg = -(-n // 64), -(-k // 4)
    if (n, k) == (ng * 64, kg * 4):
        padded = qweight.contiguous()
    else:
        padded = qweight.new_zeros(ng * 64, kg * 4)
        padded[:n, :k] = qweight
    # each 4 inputs of a channel as one int32: a transpose of (NG, 64, KG) words, which
    # moves a quarter as many elements as permuting the bytes would
    words = padded.view(torch.int32).view(ng, 64, kg).transpose(1, 2).contiguous()  # (NG, KG, 64)
    weight = words.view(torch.int8).view(ng, kg, 64, 4)
    return weight, (_row_sums(qweight) * 128).contiguous(), scales.float().contiguous()


def _row_sums(qweight: torch.Tensor) -> torch.Tensor:
    """``qweight.sum(dim=1)`` as int32, exactly: an int8 product with a column of ones where
    torch has one for the CPU (about 6x faster than the reduction)."""
    try:
        ones = torch.ones(qweight.shape[1], 8, dtype=torch.int8)
        return torch._int_mm(qweight.contiguous(), ones)[:, 0].contiguous()  # (N,)
    except (RuntimeError, AttributeError):
        return qweight.sum(dim=1, dtype=torch.int32)



class W8A8TokenLinear(nn.Module):
    """int8 weights x int8 activations, one activation scale per token (row), and by
    default a second int8 pass over each token's rounding residual.

    SmoothQuant (Xiao et al., 2023): a few input channels of a transformer's linear layers
    carry activations far larger than the rest. Dividing channel ``j`` of the input by
    ``s[j] = max|x_j| ** alpha / max|W[:, j]| ** (1 - alpha)`` and multiplying the weight's
    column ``j`` by it moves that range into the weights, which are quantized per output
    channel. ``max|x_j|`` comes from a calibration forward (:func:`input_absmax`). The
    integer product is fbgemm's ``quantized.linear_dynamic``, used for forwards of every
    length, prefills included. Activations are quantized:

    * **per token**: each smoothed row is scaled so that its largest magnitude ``a`` becomes
      127 and rounded to integer codes here, before fbgemm sees it. Two constant input
      columns (+-127.5, with zero weights) are appended, so the range fbgemm measures is the
      same in every forward and its activation scale is exactly 1: the codes reach the
      integer product unchanged, and one scale per forward becomes one per token.
    * **residual pass** (``residual=True``): the rounding error ``e`` of each row (in codes)
      is scaled so that its largest magnitude ``b`` becomes 127 and rounded as a second row
      of the same product, so the weights stream once for both rows:
      ``y = a/127 * (Q(u) @ Wq.T + b/127 * Q(e * 127/b) @ Wq.T) + bias``. The activations
      then carry about 15 bits instead of 8; a one-token forward feeds fbgemm two rows,
      which costs about what one row costs, a verification of n tokens 2n rows. The rows of
      a prompt's positions skip it (:mod:`specviz.quant.passes`): a prefill is
      compute-bound, and the second pass doubles its rows.

    The integer products are exact and the rescaling is elementwise, so a row's output does
    not depend on which other rows share its forward: verifying several tokens computes
    each token's projections bit for bit as a one-token decoding step does.

    The weights use 7 bits ([-63, 63]): fbgemm's AVX2 kernel adds pairs of uint8 x int8
    products in int16, which 8-bit codes and 7-bit weights never overflow (full 8-bit
    weights and activations do: 10-25% error measured on random layers). (8-bit weights
    with 7-bit codes around a zero point of 64 fit too, but fbgemm's product then measured a
    relative error of 1e-3 against the exact integer product, so rows were no longer
    independent of their batch.) On the 1.5B target, teacher-forced greedy agreement with
    fp32 (7 prompts x 64 tokens, 4 tokens per forward) was 0.979 with the residual pass
    (query/key/value and gate/up fused, :class:`SharedInputGroup`) and 0.965 without it. The
    residual pass also keeps a verification on plain decoding's path: the only rounding
    that differs between them, attention's, can move an activation across a rounding
    boundary of its code, and the second pass absorbs most of that jump.

    ``qweight`` (N, K) int8 in [-63, 63], ``scales`` (N,) bf16 (one per output channel,
    covering the smoothed weight's range), ``inv_smooth`` (K,) float32 = ``1 / s``,
    ``bias`` (N,) float32 or None; the packed weight has ``K + 2`` input columns.

    :meth:`forward` calls ``torch.ops.specviz.w8a8_token_linear``
    (:mod:`specviz.quant.extension`), which does this arithmetic in a few passes over each
    row around the same fbgemm call, where it could be compiled; :meth:`forward_pytorch`
    is the same computation in PyTorch operators, with bit-identical results. On CPUs with
    AVX-512 VNNI the operator computes the integer products of forwards of at most
    :attr:`vnni_max_rows` fed rows (by default all) with its own kernel, from a second copy of the weight in
    that kernel's layout (:func:`vnni_layout`), again bit for bit.

    Raises:
        ValueError: PyTorch here has no fbgemm quantized engine (it is x86-only), or
            ``input_absmax`` does not have ``in_features`` entries.
    """

    #: the (max, min) of the two constant input columns: the range fbgemm measures in every
    #: forward, 255 wide, so its activation scale is 1 and integer codes pass unchanged
    range_columns: tuple[float, float] = (_W8A8_TOKEN_CODES + 0.5, -_W8A8_TOKEN_CODES - 0.5)
    _range = torch.tensor([range_columns])  # (1, 2)

    #: forwards of at most this many fed rows (2 per token with the residual pass) take
    #: the integer product from the VNNI kernel where it runs (:func:`vnni_layout`), by
    #: default every forward: on a 2-core AMD EPYC (AVX512-BF16 and AVX-512 VNNI) it was
    #: faster than fbgemm's at every size measured, the 1.5B target's forward of 8 tokens
    #: 101-103 against 124-128 ms, of 64 tokens 605-615 against 771-1003 ms, its prefill of
    #: 227 tokens 907-951 against 1148-1175 ms
    vnni_max_rows: int = 1 << 30

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, input_absmax: torch.Tensor | None = None,
                 alpha: float = 0.5, residual: bool = True) -> None:
        super().__init__()
        if not _fbgemm_available():
            raise ValueError("weight mode w8a8-token needs PyTorch's fbgemm quantized engine (x86 CPUs); this build "
                             f"has {torch.backends.quantized.supported_engines}; use fp32 or bf16 instead")
        w = weight.detach().float()  # (N, K)
        self.out_features, self.in_features = w.shape
        smooth = smoothing(w, input_absmax, alpha)  # (K,)
        w = w * smooth[None, :]
        levels = _W8A8_WEIGHT_LEVELS
        scales = _bf16_at_least(w.abs().amax(dim=1).clamp(min=1e-12) / levels)  # (N,)
        q = torch.round(w / scales.float()[:, None]).clamp(-levels, levels).to(torch.int8)  # (N, K)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self.register_buffer("inv_smooth", (1.0 / smooth).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.alpha, self.residual = alpha, bool(residual)
        self._packed = self._pack()

    def _pack(self):
        """fbgemm's packing of the weight with zero columns for the two range inputs,
        (N, K + 2), and the VNNI kernel's layout where that kernel runs."""
        self._vnni = vnni_layout(self.qweight, self.scales) if vnni_kernel() else None
        source = torch.cat([self.qweight, self.qweight.new_zeros(self.out_features, 2)], dim=1)
        with warnings.catch_warnings():  # quantized tensors are deprecated as a user API, not fbgemm's kernels
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(source, self.scales.double(),
                                                          torch.zeros(self.out_features, dtype=torch.long), 0)
            return torch.ops.quantized.linear_prepack(qw, None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_absmax: torch.Tensor | None = None,
                    residual: bool = True) -> "W8A8TokenLinear":
        return cls(linear.weight, linear.bias, input_absmax, residual=residual)

    def dequantized_weight(self) -> torch.Tensor:
        """The smoothed weight divided back by the smoothing, (N, K) float32: what the
        layer multiplies an unsmoothed input by, up to activation rounding."""
        return self.qweight.float() * self.scales.float()[:, None] * self.inv_smooth[None, :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return by_position(self, x, self._forward)

    def _forward(self, x: torch.Tensor, residual: bool) -> torch.Tensor:
        op = w8a8_token_op()
        if op is not None:  # the same arithmetic as below, in one compiled operator
            if self._vnni is not None:
                return op(x, self.inv_smooth, self._packed, self.bias, residual, *self._vnni, self.vnni_max_rows)
            return op(x, self.inv_smooth, self._packed, self.bias, residual)
        return self.forward_pytorch(x, residual)

    def forward_pytorch(self, x: torch.Tensor, residual: bool | None = None) -> torch.Tensor:
        """:meth:`forward` in PyTorch operators (what runs without the compiled operator of
        :mod:`specviz.quant.extension`), every row in ``residual``'s passes (None: the
        layer's own)."""
        residual = self.residual if residual is None else residual
        k = self.in_features
        xs = _flat(x, k).float() * self.inv_smooth  # (M, K) smoothed
        rows = xs.shape[0]
        codes_max = _W8A8_TOKEN_CODES
        passes = 2 if residual else 1
        fed = xs.new_empty(passes * rows, k + 2)  # (P*M, K + 2): integer codes, then the two range inputs
        # One scale per token: the row's largest magnitude maps to the largest code.
        amax = torch.linalg.vector_norm(xs, float("inf"), dim=1, keepdim=True).clamp_(min=1e-30)  # (M, 1)
        t = xs.mul_(codes_max / amax)  # (M, K) in [-127, 127]
        torch.round(t, out=fed[:rows, :k])
        step = amax / codes_max  # (M, 1) the value of one code
        if residual:
            err = t.sub_(fed[:rows, :k])  # (M, K) rounding error in codes, |err| <= 1/2
            emax = torch.linalg.vector_norm(err, float("inf"), dim=1, keepdim=True).clamp_(min=1e-30)  # (M, 1)
            torch.round(err.mul_(codes_max / emax), out=fed[rows:, :k])
        fed[:, k:] = self._range  # fbgemm measures [-127.5, 127.5]: scale 1, so the codes pass exactly
        y = torch.ops.quantized.linear_dynamic(fed, self._packed, False)  # (P*M, N) exact integer products x w_scale
        if residual:  # separate operators: each product and the sum rounded on its own
            y = y[:rows].mul_(step).add_(y[rows:].mul_(step * (emax / codes_max)))
        else:
            y = y.mul_(step)  # (M, N)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)  # (..., N)

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        nn.Module.__init__(new)
        for name, buf in self._buffers.items():
            new.register_buffer(name, None if buf is None else buf.clone())
        new.out_features, new.in_features = self.out_features, self.in_features
        new.alpha, new.residual = self.alpha, self.residual
        new._packed = new._pack()
        return new

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, alpha={self.alpha}, "
                f"residual={self.residual}, bias={self.bias is not None}")


class SharedInputGroup(nn.Module):
    """Several linear layers that read the same input, computed as one product.

    A transformer layer's query, key and value projections read one input, and so do its
    MLP's gate and up projections. Concatenating their weights into one
    :class:`W8A8TokenLinear` quantizes the input once (one smoothing vector for the group,
    from its inputs' range and the concatenated weights' columns) and calls the integer
    kernel once: 4 products per decoder layer instead of 7. Each member layer is replaced by
    a :class:`SharedInputSlice` that returns its columns of the group's output.

    The output is kept from the first member's call until every member has taken its
    columns, for the same input tensor (the same object, unchanged): the model calls
    ``q_proj(h)``, ``k_proj(h)`` and ``v_proj(h)`` on one tensor ``h``. A member called on any
    other input recomputes the product, so results are right for any caller, only slower.

    Attributes:
        layer: the fused :class:`W8A8TokenLinear`, (K) -> (sum of the members' N).
        names: the members' names, in column order.
        bounds: member name -> (first column, end column) of its output.
    """

    def __init__(self, layer: W8A8TokenLinear, names: tuple[str, ...], sizes: tuple[int, ...]) -> None:
        super().__init__()
        if sum(sizes) != layer.out_features or len(names) != len(sizes):
            raise ValueError(f"member sizes {sizes} do not add up to the fused layer's {layer.out_features} outputs")
        self.layer = layer
        self.names = tuple(names)
        ends = torch.tensor(sizes).cumsum(0).tolist()
        self.bounds = {n: (e - size, e) for n, size, e in zip(names, sizes, ends)}
        self._clear()

    def _clear(self) -> None:
        self._input, self._version, self._output, self._pending = None, None, None, set()

    @staticmethod
    def _version_of(x: torch.Tensor) -> int:
        try:
            return x._version
        except RuntimeError:  # inference tensors keep no version counter
            return -1

    def output_for(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Member ``name``'s output for input ``x``, (..., its N) (a view of the group's)."""
        if self._input is not x or self._version != self._version_of(x) or name not in self._pending:
            self._output = self.layer(x)
            self._input, self._version, self._pending = x, self._version_of(x), set(self.names)
        self._pending.discard(name)
        start, end = self.bounds[name]
        y = self._output[..., start:end]
        if not self._pending:  # every member served: let the tensors go
            self._clear()
        return y

    @classmethod
    def from_linears(cls, linears: dict[str, nn.Linear], input_absmax: torch.Tensor | None = None,
                     residual: bool = True, layer_class: type | None = None) -> "SharedInputGroup":
        """One group for ``linears`` (name -> layer, in column order), which must have the
        same ``in_features``; a member without bias gets zeros if another has one. The fused
        layer is a ``layer_class`` (default :class:`W8A8TokenLinear`;
        :class:`~specviz.quant.w4a8.W4A8TokenLinear` for ``w4a8-token``)."""
        layers = list(linears.values())
        widths = {lin.in_features for lin in layers}
        if len(widths) != 1:
            raise ValueError(f"layers {list(linears)} read inputs of different widths {sorted(widths)}")
        weight = torch.cat([lin.weight.detach().float() for lin in layers])  # (sum N, K)
        bias = None
        if any(lin.bias is not None for lin in layers):
            bias = torch.cat([lin.bias.detach().float() if lin.bias is not None
                              else torch.zeros(lin.out_features) for lin in layers])
        layer = (layer_class or W8A8TokenLinear)(weight, bias, input_absmax, residual=residual)
        return cls(layer, tuple(linears), tuple(lin.out_features for lin in layers))

    def extra_repr(self) -> str:
        return f"members={self.names}"


class SharedInputSlice(nn.Module):
    """A member of a :class:`SharedInputGroup`: its columns of the group's product.

    The group is held as a plain attribute (it is registered once, on the members' parent
    module), so the weights appear once in ``modules()`` and ``state_dict()``.
    """

    def __init__(self, group: SharedInputGroup, name: str) -> None:
        super().__init__()
        object.__setattr__(self, "group", group)
        self.name = name
        self.in_features = group.layer.in_features
        start, end = group.bounds[name]
        self.out_features = end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output_for(self.name, x)

    def extra_repr(self) -> str:
        start, end = self.group.bounds[self.name]
        return f"in_features={self.in_features}, out_features={self.out_features}, columns={start}:{end} of the group"


@torch.no_grad()
def input_absmax(model: nn.Module, token_ids: torch.Tensor | None = None,
                 run: Callable[[], object] | None = None) -> dict[str, torch.Tensor]:
    """Per input channel, the largest ``|x|`` each ``nn.Linear`` of ``model`` sees while
    ``model`` reads ``token_ids`` ((B, L) ids; one plain forward), or while ``run()``
    runs (any use of ``model``, e.g. a draft head over calibration features):
    ``{layer name: (K,)}``."""
    if (token_ids is None) == (run is None):
        raise ValueError("give input_absmax either token_ids or run")
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            def hook(mod, inputs, output, name=name):
                a = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).abs().amax(dim=0).float()  # (K,)
                seen[name] = torch.maximum(seen[name], a) if name in seen else a
            hooks.append(module.register_forward_hook(hook))
    try:
        if run is not None:
            run()
        else:
            model(input_ids=token_ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


@dataclass(frozen=True)
class WeightMode:
    """One way to store and multiply a model's linear weights.

    Attributes:
        name: the mode's name, as :func:`load_model` takes it.
        description: one line for tables and error messages.
        lossless: True only for ``fp32``, the reference every other mode is compared with.
        activation_dtype: dtype of activations, of the model's remaining parameters
            (embeddings, norms) and of its logits; ``model.dtype`` after conversion.
        convert: builds the replacement of one ``nn.Linear``; None keeps ``nn.Linear``
            and only casts it.
        calibrated: ``convert`` also takes the layer's :func:`input_absmax` entry, so the
            conversion needs calibration tokens.
        devices: the device kinds whose kernels run this mode (the packed integer
            kernels are the CPU's).
        shared_inputs: groups of sibling layer names (children of one module, reading one
            input) that ``convert_group`` turns into one product; a group is formed only
            where all its members are ``nn.Linear`` layers of one input width.
        convert_group: builds a :class:`SharedInputGroup` from ``{name: nn.Linear}`` and the
            group's input range.
    """

    name: str
    description: str
    lossless: bool
    activation_dtype: torch.dtype
    convert: Callable[..., nn.Module] | None = None
    calibrated: bool = False
    devices: tuple[str, ...] = ("cpu", "cuda", "mps")
    shared_inputs: tuple[tuple[str, ...], ...] = ()
    convert_group: Callable[..., nn.Module] | None = None


_CPU_ONLY = ("cpu",)

WEIGHT_MODES: dict[str, WeightMode] = {
    m.name: m
    for m in (
        WeightMode("fp32", "float32 weights and activations (exactness reference)", True, torch.float32),
        WeightMode("bf16", "bfloat16 weights and activations", False, torch.bfloat16),
        WeightMode("fp16", "float16 weights and activations", False, torch.float16),
        WeightMode("w8a8-token", "int8 weights x int8 activations (SmoothQuant, one scale per token plus an "
                   "int8 pass over the rounding residual; batch-invariant); fp32 activations between layers", False,
                   torch.float32, W8A8TokenLinear.from_linear, calibrated=True, devices=_CPU_ONLY,
                   shared_inputs=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
                   convert_group=SharedInputGroup.from_linears),
        WeightMode("w4a8-token", "4-bit weights (a float16 scale and minimum per 64 inputs) x int8 activations "
                   "(per token, with w8a8-token's residual pass; batch-invariant); fp32 activations between layers",
                   False, torch.float32, W4A8TokenLinear.from_linear, calibrated=True, devices=_CPU_ONLY,
                   shared_inputs=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
                   convert_group=functools.partial(SharedInputGroup.from_linears, layer_class=W4A8TokenLinear)),
    )
}

_TORCH_DTYPE_MODES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_LONG_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_CONVERTED = (W8A8TokenLinear, W4A8TokenLinear, SharedInputGroup)

#: modes specviz no longer has, with the reason (a mode stays only where a
#: committed result shows it winning, it is the exactness reference, or a notebook teaches
#: with it); :func:`parse_weight_mode` names the reason and the modes that remain
RETIRED_MODES: dict[str, str] = {
    "int8": "weight-only int8 was slower than w8a8-token wherever both ran",
    "int4": "weight-only 4-bit was below the accuracy bar on every machine probed (0.93 against 0.975); "
            "w4a8-token is the 4-bit draft mode",
    "w8a8": "one activation scale per forward was below the accuracy bar (0.97 against 0.975) and not "
            "batch-invariant; w8a8-token replaces it",
    "fp32-wx": "fp32 with transposed products lost to w8a8-token wherever it ran; fp32 is the reference",
}


def is_auto(mode) -> bool:
    """Whether ``mode`` asks for the machine's own choice (the string ``"auto"``), which
    :func:`specviz.bench.auto.resolve_auto` turns into a mode."""
    return isinstance(mode, str) and mode.strip().lower() == "auto"


def parse_weight_mode(mode: WeightMode | torch.dtype | str) -> WeightMode:
    """The :class:`WeightMode` named by ``mode``: a name of :data:`WEIGHT_MODES`, a long
    dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``) or a torch float dtype.

    Raises:
        ValueError: a retired mode (:data:`RETIRED_MODES`: the message says why) or any
            other value (the message lists the modes).
    """
    if isinstance(mode, WeightMode):
        return mode
    if isinstance(mode, torch.dtype) and mode in _TORCH_DTYPE_MODES:
        return WEIGHT_MODES[_TORCH_DTYPE_MODES[mode]]
    if isinstance(mode, str):
        key = _LONG_NAMES.get(mode.lower(), mode.lower())
        if key in WEIGHT_MODES:
            return WEIGHT_MODES[key]
        if key in RETIRED_MODES:
            raise ValueError(f"weight mode {mode!r} was retired ({RETIRED_MODES[key]}); use one of "
                             f"{', '.join(WEIGHT_MODES)}")
        if is_auto(mode):
            raise ValueError("weight mode 'auto' depends on a probe of this machine; resolve it into a mode first "
                             "with specviz.bench.auto.resolve_auto(name, device) (the command lines do this)")
    raise ValueError(f"unknown weight mode {mode!r}; use one of {', '.join(WEIGHT_MODES)} "
                     "(or torch.float32, torch.bfloat16, torch.float16)")


def float_dtype(mode: WeightMode | torch.dtype | str) -> torch.dtype:
    """The torch dtype of a float weight mode (``"fp32"``, ``"bf16"``, ``"fp16"``, their long
    names or a torch float dtype), for code that computes in a plain dtype.

    Raises:
        ValueError: an unknown mode, or one that quantizes its weights (names it).
    """
    parsed = parse_weight_mode(mode)
    if parsed.convert is not None:
        raise ValueError(f"{mode!r} quantizes its weights; this needs a float dtype: fp32, bf16 or fp16")
    return parsed.activation_dtype


def weight_mode_of(model: nn.Module) -> str:
    """The name of the mode ``model`` is in, read from its layers and parameter dtype."""
    for module in model.modules():
        if isinstance(module, W8A8TokenLinear):
            return "w8a8-token"
        if isinstance(module, W4A8TokenLinear):
            return "w4a8-token"
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return _TORCH_DTYPE_MODES[dtype]


def _child(parent: str, name: str) -> str:
    """The full module name of child ``name`` of module ``parent`` ("" is the root)."""
    return f"{parent}.{name}" if parent else name


def _shared_input_groups(linears: dict[str, nn.Linear], specs: tuple[tuple[str, ...], ...]):
    """(parent name, member names, their full names) of every complete group of ``specs``
    among ``linears`` (full name -> layer) whose members read inputs of one width."""
    found = []
    parents = {name.rpartition(".")[0] for name in linears}
    for parent in sorted(parents):
        for members in specs:
            names = [_child(parent, m) for m in members]
            if all(n in linears for n in names) and len({linears[n].in_features for n in names}) == 1:
                found.append((parent, members, names))
    return found


def _refuse_converted(model: nn.Module, wm: WeightMode) -> None:
    """ValueError if ``model`` already holds converted layers (they cannot be converted again)."""
    done = next((type(m).__name__ for m in model.modules() if isinstance(m, _CONVERTED)), None)
    if done is not None:
        raise ValueError(f"model already holds {done} layers ({weight_mode_of(model)}); "
                         f"load it again to convert it to {wm.name}")


def quantize_model(model: nn.Module, mode: WeightMode | torch.dtype | str,
                   calibration_ids: torch.Tensor | None = None,
                   input_ranges: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Put ``model`` in weight mode ``mode``, in place, and return it.

    Every ``nn.Linear`` is replaced by the mode's layer (quantized from the weights as they
    are, before any cast), then the remaining parameters are cast to the mode's activation
    dtype (buffers are left as they are). Sibling layers named in the mode's
    ``shared_inputs`` become :class:`SharedInputSlice` members of one
    :class:`SharedInputGroup`, registered on their parent module. A tied LM head is
    converted as its own copy; the embedding table is kept. A calibrated mode
    (``w8a8-token``, ``w4a8-token``) first runs ``model`` once on ``calibration_ids``
    ((1, L) token ids) to measure each layer's input range, or takes the ranges measured
    otherwise as ``input_ranges``
    (``{layer name: (K,)}``, :func:`input_absmax` with ``run``: a module that does not
    read token ids, such as a draft head).

    Raises:
        ValueError: unknown mode; a model already converted to a non-plain mode (load it
            again instead); a layer the mode cannot pack (the message names the layer); a
            calibrated mode without ``calibration_ids`` or ``input_ranges``, or ranges that
            miss a layer.
    """
    wm = parse_weight_mode(mode)
    _refuse_converted(model, wm)
    absmax: dict[str, torch.Tensor] = {}
    if wm.calibrated:
        if input_ranges is not None:
            absmax = dict(input_ranges)
            missing = sorted(name for name, m in model.named_modules() if isinstance(m, nn.Linear)
                             and name not in absmax)
            if missing:
                raise ValueError(f"input_ranges has no range for layer(s) {missing}")
        elif calibration_ids is None:
            raise ValueError(f"weight mode {wm.name} is calibrated: pass calibration_ids (token ids of a text)")
        else:
            absmax = input_absmax(model, calibration_ids)
    if wm.convert is not None:
        # Build every replacement before swapping any, so a layer that cannot be packed
        # leaves the model untouched.
        linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        replacements, groups = {}, {}
        for parent_name, members, names in _shared_input_groups(linears, wm.shared_inputs):
            group_absmax = torch.stack([absmax[n] for n in names]).amax(0) if wm.calibrated else None
            try:
                group = wm.convert_group({m: linears[n] for m, n in zip(members, names)}, group_absmax)
            except ValueError as exc:
                raise ValueError(f"cannot convert layers {names} to {wm.name}: {exc}") from exc
            groups[_child(parent_name, "_".join(members))] = group
            for m, n in zip(members, names):
                replacements[n] = SharedInputSlice(group, m)
        for name, module in linears.items():
            if name in replacements:
                continue
            try:
                replacements[name] = wm.convert(module, absmax[name]) if wm.calibrated else wm.convert(module)
            except ValueError as exc:
                raise ValueError(f"cannot convert layer {name!r} to {wm.name}: {exc}") from exc
        _install(model, groups, replacements)
    _cast_parameters(model, wm)
    return model


def _install(model: nn.Module, groups: dict[str, nn.Module], replacements: dict[str, nn.Module]) -> None:
    """Register the shared-input groups on their parents, then swap each replaced layer in
    (the same order for a conversion and a restore, so both give the same module tree)."""
    for name, new in {**groups, **replacements}.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)


def _cast_parameters(model: nn.Module, wm: WeightMode) -> None:
    # Parameters only: buffers such as the rotary inv_freq stay float32, as from_pretrained
    # leaves them (model.to would round them to bf16 and shift every position's angle).
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != wm.activation_dtype:
            param.data = param.data.to(wm.activation_dtype)


#: Modes whose converted layers :func:`converted_layers` can save and
#: :func:`restore_converted` rebuild without converting again (their buffers do not depend
#: on the CPU; fbgemm's packing is redone on restore): every converted mode.
CACHEABLE_MODES: tuple[str, ...] = ("w8a8-token", "w4a8-token")
_RESTORABLE = {cls.__name__: cls for cls in (W8A8TokenLinear, W4A8TokenLinear)}


def _layer_entry(module: nn.Module, name: str, tensors: dict[str, torch.Tensor]) -> dict:
    attrs = {k: v for k, v in vars(module).items()
             if not k.startswith("_") and k != "training" and isinstance(v, (bool, int, float, str))}
    for buf, value in module._buffers.items():
        if value is not None:
            tensors[f"{name}.{buf}"] = value.detach().contiguous()
    return {"name": name, "class": type(module).__name__, "attrs": attrs,
            "buffers": [b for b, v in module._buffers.items() if v is not None],
            "empty_buffers": [b for b, v in module._buffers.items() if v is None]}


def converted_layers(model: nn.Module) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The converted layers of ``model`` (in a mode of :data:`CACHEABLE_MODES`), to save and
    rebuild later with :func:`restore_converted`: a JSON-able manifest (each layer's name,
    class, settings and buffer names; each :class:`SharedInputGroup` with its members) and
    the layers' buffers by ``"<layer>.<buffer>"``.
    """
    manifest: list[dict] = []
    tensors: dict[str, torch.Tensor] = {}
    inside: list[str] = []  # groups' prefixes: their layer is saved with the group
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in inside) or isinstance(module, SharedInputSlice):
            continue
        if isinstance(module, SharedInputGroup):
            sizes = [module.bounds[m][1] - module.bounds[m][0] for m in module.names]
            manifest.append({"name": name, "class": "SharedInputGroup", "members": list(module.names),
                             "sizes": sizes, "layer": _layer_entry(module.layer, f"{name}.layer", tensors)})
            inside.append(name + ".")
        elif type(module).__name__ in _RESTORABLE:
            manifest.append(_layer_entry(module, name, tensors))
    return manifest, tensors


def _rebuild(entry: dict, tensors: dict[str, torch.Tensor]) -> nn.Module:
    cls = _RESTORABLE.get(entry["class"])
    if cls is None:
        raise ValueError(f"saved layer {entry['name']!r} has unknown class {entry['class']!r}")
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    for buf in entry["buffers"]:
        layer.register_buffer(buf, tensors[f"{entry['name']}.{buf}"])  # KeyError: restore_converted says which
    for buf in entry["empty_buffers"]:
        layer.register_buffer(buf, None)
    for key, value in entry["attrs"].items():
        setattr(layer, key, value)
    qweight = layer._buffers.get("qweight")
    if qweight is not None and tuple(qweight.shape) != (layer.out_features, layer.in_features):
        raise ValueError(f"saved layer {entry['name']!r} has a weight of shape {tuple(qweight.shape)}, not "
                         f"{(layer.out_features, layer.in_features)}")
    if isinstance(layer, W8A8TokenLinear):
        layer._packed = layer._pack()
    return layer


def _usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def restore_converted(model: nn.Module, mode: WeightMode | str, manifest: Sequence[dict],
                      tensors: dict[str, torch.Tensor]) -> nn.Module:
    """Put ``model`` (unconverted, the same architecture and weights the layers were
    converted from) in weight mode ``mode`` from :func:`converted_layers`' output of an
    earlier conversion, in place: the layers are rebuilt from their saved buffers (packed
    for their kernel again), without calibration or quantization, and the remaining
    parameters cast as :func:`quantize_model` casts them. The result computes bit for bit
    what the converted model did.

    Raises:
        ValueError: ``mode`` is not in :data:`CACHEABLE_MODES`; ``model`` is already
            converted; the saved layers do not match ``model``'s linear layers (names or
            shapes) or lack a buffer. ``model`` is left untouched then.
    """
    wm = parse_weight_mode(mode)
    if wm.name not in CACHEABLE_MODES:
        raise ValueError(f"weight mode {wm.name} cannot be restored from saved layers; saved modes: "
                         f"{', '.join(CACHEABLE_MODES)}")
    _refuse_converted(model, wm)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if any(entry.get("layer", entry).get("class") in (W8A8TokenLinear.__name__, W4A8TokenLinear.__name__)
           for entry in manifest):
        vnni_kernel()  # the compiled operator built or loaded once here, not by the workers below
    # Packing for fbgemm is single-threaded per layer, so the layers are packed side by side,
    # on every core this process may use whatever torch's thread setting (a load times nothing).
    with ThreadPoolExecutor(max_workers=_usable_cores()) as pool:
        layers = {entry["name"]: pool.submit(_rebuild, entry.get("layer", entry), tensors) for entry in manifest}
    groups: dict[str, nn.Module] = {}
    replacements: dict[str, nn.Module] = {}
    try:
        for entry in manifest:
            layer = layers[entry["name"]].result()
            if entry["class"] == "SharedInputGroup":
                group = SharedInputGroup(layer, tuple(entry["members"]), tuple(entry["sizes"]))
                groups[entry["name"]] = group
                parent = entry["name"].rpartition(".")[0]
                for member in entry["members"]:
                    replacements[_child(parent, member)] = SharedInputSlice(group, member)
            else:
                replacements[entry["name"]] = layer
    except KeyError as exc:
        raise ValueError(f"saved layers lack {exc}") from exc
    if set(replacements) != set(linears):
        odd = sorted(set(replacements) ^ set(linears))[:3]
        raise ValueError(f"saved layers do not match the model's linear layers (for example {odd})")
    for name, new in replacements.items():
        old = linears[name]
        if (new.in_features, new.out_features) != (old.in_features, old.out_features):
            raise ValueError(f"saved layer {name!r} is {new.in_features} -> {new.out_features}, the model's "
                             f"{old.in_features} -> {old.out_features}")
    _install(model, groups, replacements)
    _cast_parameters(model, wm)
    return model
