"""``w8a8-token``'s layers: :class:`W8A8TokenLinear` (int8 weights x int8 activations, one
scale per token, with a second int8 pass over each token's rounding residual), the layout of
its weight for the compiled operator's AVX-512 VNNI kernel (:func:`vnni_layout`), and the
shared-input groups (:class:`SharedInputGroup`, :class:`SharedInputSlice`) that compute
sibling layers reading one input as one product.

The modes, their table and the conversion of a model's layers are in
:mod:`specviz.quant.weights`, which re-exports these classes.

Dimension legend: M = rows fed (tokens), K = in_features, N = out_features.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from specviz.quant.extension import vnni_kernel, w8a8_token_op
from specviz.quant.passes import by_position
from specviz.quant.w4a8 import smoothing

__all__ = ["W8A8TokenLinear", "SharedInputGroup", "SharedInputSlice", "vnni_layout"]


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



#: :attr:`W8A8TokenLinear.vnni_max_rows` by default: more rows than any forward feeds
_ALL_ROWS = 1 << 30


def _fbgemm_packing(qweight: torch.Tensor, scales: torch.Tensor):
    """fbgemm's packing of an int8 ``(N, K)`` weight with one scale per output channel."""
    with warnings.catch_warnings():  # quantized tensors are deprecated as a user API, not fbgemm's kernels
        warnings.simplefilter("ignore", UserWarning)
        qw = torch._make_per_channel_quantized_tensor(qweight, scales.double(),
                                                      torch.zeros(qweight.shape[0], dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(qw, None)


@functools.lru_cache(maxsize=1)
def _unread_packing():
    """A one-channel fbgemm packing that the operator takes where its VNNI kernel computes
    the product and never reads (its schema asks for a packed weight)."""
    return _fbgemm_packing(torch.zeros(1, 1, dtype=torch.int8), torch.ones(1))


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
    :attr:`vnni_max_rows` fed rows (by default all) with its own kernel, from the weight in that
    kernel's layout (:func:`vnni_layout`), again bit for bit; fbgemm's packed copy is then made
    only for a forward that needs it.

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
    vnni_max_rows: int = _ALL_ROWS

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
        self._pack()

    def _pack(self) -> None:
        """Lay the weight out for its kernels: the VNNI kernel's layout where that kernel
        runs, now; fbgemm's packing (:attr:`_packed`) when a forward first needs it. With the
        VNNI kernel taking every forward (:attr:`vnni_max_rows` at its default), fbgemm's copy
        is never made: a load of the 1.5B target then skips about 6 s of packing and 1.8 GB
        of resident memory. (A layer whose ``vnni_max_rows`` is lowered packs at its first
        forward; lower it before a traced forward records the layer.)"""
        self._vnni = vnni_layout(self.qweight, self.scales) if vnni_kernel() else None
        self._fbgemm = None
        # what the operator's schema takes where the VNNI kernel computes every product (it
        # never reads it); an attribute of the layer, as a traced forward needs
        self._unread = _unread_packing() if self._vnni is not None else None

    @property
    def _packed(self):
        """fbgemm's packing of the weight with zero columns for the two range inputs,
        (N, K + 2), made on first use."""
        if self._fbgemm is None:
            source = torch.cat([self.qweight, self.qweight.new_zeros(self.out_features, 2)], dim=1)
            self._fbgemm = _fbgemm_packing(source, self.scales)
        return self._fbgemm

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
                # decided by the layer's settings, not the forward's size, so a trace holds for every size
                packed = self._unread if self.vnni_max_rows >= _ALL_ROWS else self._packed
                return op(x, self.inv_smooth, packed, self.bias, residual, *self._vnni, self.vnni_max_rows)
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
        new._pack()
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
