"""``w4a8-token``: 4-bit weights times the per-token int8 activations of ``w8a8-token``.

A one-token forward on a CPU streams every weight once from memory, so its time follows the
weights' bytes. :class:`W4A8TokenLinear` stores each output channel's weights in groups of
64 inputs, each group as 4-bit codes ``q`` (0..15) with a float16 scale ``s`` and minimum
``z`` (``w = s * q + z``): 4.5 bits per weight against ``w8a8-token``'s 8 (plus its second,
fbgemm-packed copy). Activations are quantized exactly as in
:class:`~specviz.quant.weights.W8A8TokenLinear`: SmoothQuant smoothing, one scale per
token and a second int8 pass over each token's rounding residual (which the rows of a
prompt's positions skip, :mod:`specviz.quant.passes`).

Each row's output is computed as

    acc = 0;  for every group g in order:  acc = (acc + dot_g * s_g) + z_g * xsum_g

where ``dot_g`` is the exact integer product of the group's weight codes with the row's
activation codes and ``xsum_g`` the sum of those codes, then rescaled per token as
``w8a8-token`` does (``(y_codes * step + y_residual * step2) + bias``). The compiled
operator (``torch.ops.specviz.w4a8_token_linear``, :mod:`specviz.quant.extension`) runs it
with AVX-512 VNNI (``vpdpbusd`` on the unsigned 4-bit codes and the signed activation
codes) for every row count, prefills included, and with AVX2 (``vpmaddubsw`` and
``vpmaddwd``, the same exact integers) on other x86 CPUs or with ``SPECVIZ_NO_VNNI=1``;
:meth:`W4A8TokenLinear.forward_pytorch` is the same arithmetic in PyTorch operators.
All three give the same bits, and a token's output never depends on the other rows of its
forward (batch-invariant, as ``w8a8-token``).

On a 2-core Xeon with AVX-512 VNNI, the built-in 0.5B draft's products took about half
as long as in ``w8a8-token`` and its whole one-token forward 15-25% less (the work around
the products stays); its teacher-forced greedy agreement with the ``w8a8-token`` target
was 0.790 against 0.824. The mode suits a draft model, whose accuracy costs acceptance but
never exactness (``load_pair(..., draft_dtype="w4a8-token")``,
``specviz.bench --draft-dtype w4a8-token``).
"""

from __future__ import annotations

import torch
from torch import nn

from specviz.quant.extension import vnni_kernel, w4a8_token_op
from specviz.quant.passes import by_position

__all__ = ["W4A8TokenLinear", "smoothing", "pack_w4", "layout_w4", "unpack_w4", "W4_GROUP"]

#: inputs per weight group (one scale and one minimum each)
W4_GROUP = 64
_BLOCK = 64  # output channels per block of the kernel's stream
_LEVELS = 15  # 4-bit codes 0..15
_CODES = 127.0  # activation codes [-127, 127], as w8a8-token's
_GROUP_BYTES = 8 * 256 + 4 * _BLOCK  # a group of a block: 8 lines of weight bytes, 64 fp16 scales, 64 fp16 minimums


def smoothing(w: torch.Tensor, input_absmax: torch.Tensor | None, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input factor ``s`` of weight ``w`` (N, K) (the input is divided by
    it, the weight's columns multiplied), for this module's and
    :class:`~specviz.quant.weights.W8A8TokenLinear`'s layers; ones without an input range.

    Raises:
        ValueError: ``input_absmax`` does not have K entries."""
    k = w.shape[1]
    if input_absmax is None:
        return torch.ones(k)
    if input_absmax.shape != (k,):
        raise ValueError(f"input_absmax must have shape ({k},), got {tuple(input_absmax.shape)}")
    a = input_absmax.detach().float().clamp(min=1e-5)
    return (a ** alpha / w.abs().amax(dim=0).clamp(min=1e-5) ** (1.0 - alpha)).clamp(1e-3, 1e3)


def pack_w4(weight: torch.Tensor) -> torch.Tensor:
    """Quantize ``weight`` ((N, K) float) to 4-bit codes with a float16 scale and minimum per
    64 inputs, in the compiled kernel's stream layout: uint8 ``(NG, G, 2304)`` with
    ``NG = ceil(N / 64)`` blocks of 64 output channels and ``G = ceil(K / 64)`` groups.

    Block ``c``, group ``g``: 8 lines of 256 bytes, line ``o`` holding for channel
    ``64 c + j`` and ``i < 4`` the byte ``q[., 64 g + 8 o + i] | q[., 64 g + 8 o + 4 + i] << 4``
    at ``[o, j, i]`` (the four 64-byte vectors of a line are what ``vpdpbusd`` multiplies by
    four activation codes), then the 64 channels' scales and their minimums (float16).
    Padding channels and inputs are zeros.
    """
    w = weight.detach().float()
    n, k = w.shape
    ng, groups = -(-n // _BLOCK), -(-k // W4_GROUP)
    padded = w.new_zeros(ng * _BLOCK, groups * W4_GROUP)
    padded[:n, :k] = w
    wg = padded.view(ng * _BLOCK, groups, W4_GROUP)
    lo, hi = wg.amin(dim=2), wg.amax(dim=2)  # (Np, G)
    scale = ((hi - lo) / _LEVELS).clamp(max=60000.0).half()
    minimum = lo.clamp(-60000.0, 60000.0).half()
    sf = scale.float()
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    q = torch.round((wg - minimum.float()[..., None]) / safe[..., None]).clamp_(0, _LEVELS)
    q = torch.where(sf[..., None] > 0, q, torch.zeros_like(q)).to(torch.uint8)  # (Np, G, 64)
    return layout_w4(q.view(ng * _BLOCK, groups * W4_GROUP), scale, minimum)


def layout_w4(codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> torch.Tensor:
    """Codes uint8 ``(N, Kp)`` (0..15, ``Kp`` a multiple of 64), scales and minimums
    ``(N, G)`` (float16 values) in :func:`pack_w4`'s stream layout; channels are padded to
    whole blocks with zeros."""
    n, kp = codes.shape
    groups = kp // W4_GROUP
    if kp != groups * W4_GROUP or scales.shape != (n, groups) or minimums.shape != (n, groups):
        raise ValueError(f"codes {tuple(codes.shape)}, scales {tuple(scales.shape)} and minimums "
                         f"{tuple(minimums.shape)} do not describe groups of {W4_GROUP} inputs")
    ng = -(-n // _BLOCK)
    q = codes.new_zeros(ng * _BLOCK, kp)
    q[:n] = codes
    s16, z16 = (t.new_zeros(ng * _BLOCK, groups, dtype=torch.float16) for t in (scales, minimums))
    s16[:n], z16[:n] = scales.half(), minimums.half()
    q = q.view(ng, _BLOCK, groups, 8, 2, 4)
    lines = (q[:, :, :, :, 0] | (q[:, :, :, :, 1] << 4))  # (NG, 64, G, 8, 4)
    lines = lines.permute(0, 2, 3, 1, 4).reshape(ng, groups, 8 * 256)
    s_bytes = s16.view(ng, _BLOCK, groups).transpose(1, 2).contiguous().view(torch.uint8)  # (NG, G, 128)
    z_bytes = z16.view(ng, _BLOCK, groups).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat([lines, s_bytes, z_bytes], dim=2).contiguous()


def unpack_w4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pack_w4`'s stream back as ``(codes, scales, minimums)``: codes uint8
    ``(Np, Kp)`` in 0..15, scales and minimums float32 ``(Np, G)`` (padded sizes)."""
    if packed.dim() != 3 or packed.dtype != torch.uint8 or packed.shape[2] != _GROUP_BYTES:
        raise ValueError(f"expected a uint8 (NG, G, {_GROUP_BYTES}) stream, got {packed.dtype} {tuple(packed.shape)}")
    ng, groups = packed.shape[:2]
    lines = packed[:, :, :2048].reshape(ng, groups, 8, _BLOCK, 4).permute(0, 3, 1, 2, 4)  # (NG, 64, G, 8, 4)
    codes = torch.stack([lines & 0x0F, lines >> 4], dim=4)  # (NG, 64, G, 8, 2, 4)
    codes = codes.reshape(ng * _BLOCK, groups * W4_GROUP)

    def halves(start: int) -> torch.Tensor:
        raw = packed[:, :, start:start + 2 * _BLOCK].contiguous().view(torch.float16)  # (NG, G, 64)
        return raw.transpose(1, 2).reshape(ng * _BLOCK, groups).float()

    return codes, halves(2048), halves(2048 + 2 * _BLOCK)


def _select_channels(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The stream of output channels ``rows`` of ``packed`` (their bytes copied as they
    are, without unpacking the rest: a draft's LM head takes a few rows at a time)."""
    ng, groups = packed.shape[:2]
    block, lane = rows // _BLOCK, rows % _BLOCK
    r, n_new = rows.numel(), -(-rows.numel() // _BLOCK)
    parts = []
    for start, width, shape in ((0, 2048, (8, _BLOCK, 4)), (2048, 128, (_BLOCK, 2)), (2176, 128, (_BLOCK, 2))):
        view = packed[:, :, start:start + width].reshape(ng, groups, *shape)
        picked = view[block, :, :, lane] if len(shape) == 3 else view[block, :, lane]  # (R, G, ...) per channel
        out = picked.new_zeros(n_new * _BLOCK, *picked.shape[1:])
        out[:r] = picked
        out = out.view(n_new, _BLOCK, *picked.shape[1:])
        out = out.permute(0, 2, 3, 1, 4) if len(shape) == 3 else out.permute(0, 2, 1, 3)  # back to the layout
        parts.append(out.reshape(n_new, groups, width))
    return torch.cat(parts, dim=2).contiguous()


class W4A8TokenLinear(nn.Module):
    """4-bit weights (a float16 scale and minimum per 64 inputs) x int8 activations with one
    scale per token and a residual pass; see :mod:`specviz.quant.w4a8`.

    ``packed`` uint8 ``(NG, G, 2304)`` (:func:`pack_w4` of the smoothed weight),
    ``inv_smooth`` (K,) float32, ``bias`` (N,) float32 or None.

    Raises:
        ValueError: ``input_absmax`` does not have ``in_features`` entries.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, input_absmax: torch.Tensor | None = None,
                 alpha: float = 0.5, residual: bool = True) -> None:
        super().__init__()
        w = weight.detach().float()  # (N, K)
        self.out_features, self.in_features = w.shape
        smooth = smoothing(w, input_absmax, alpha)
        self.register_buffer("packed", pack_w4(w * smooth[None, :]))
        self.register_buffer("inv_smooth", (1.0 / smooth).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.alpha, self.residual = float(alpha), bool(residual)

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_absmax: torch.Tensor | None = None,
                    residual: bool = True) -> "W4A8TokenLinear":
        return cls(linear.weight, linear.bias, input_absmax, residual=residual)

    def _unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes as float32, scales, minimums)``, kept after the first call of the
        PyTorch code (for as long as ``packed`` is the same tensor)."""
        held = self.__dict__.get("_specviz_unpacked")
        if held is None or held[0] is not self.packed:
            codes, scales, minimums = unpack_w4(self.packed)
            held = (self.packed, codes.float(), scales, minimums)
            self.__dict__["_specviz_unpacked"] = held
        return held[1:]

    def rows(self, rows: torch.Tensor) -> "W4A8TokenLinear":
        """Output channels ``rows`` as a layer of their own: the same codes, scales, minimums
        and smoothing, so each output is bitwise this layer's for that channel (a draft's
        reduced LM head, :func:`specviz.draft.vocab.head_rows`)."""
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        if rows.numel() == 0 or int(rows.min()) < 0 or int(rows.max()) >= self.out_features:
            raise ValueError(f"rows must be a non-empty selection of the layer's {self.out_features} outputs")
        new = type(self).__new__(type(self))
        nn.Module.__init__(new)
        new.register_buffer("packed", _select_channels(self.packed, rows))
        new.register_buffer("inv_smooth", self.inv_smooth)
        new.register_buffer("bias", None if self.bias is None else self.bias[rows].contiguous())
        new.out_features, new.in_features = rows.numel(), self.in_features
        new.alpha, new.residual = self.alpha, self.residual
        return new

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the layer multiplies an unsmoothed input by (up to activation
        rounding), (N, K) float32."""
        codes, scales, minimums = self._unpacked()
        w = codes.view(codes.shape[0], -1, W4_GROUP) * scales[..., None] + minimums[..., None]
        w = w.reshape(codes.shape)[:self.out_features, :self.in_features]
        return w * self.inv_smooth[None, :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return by_position(self, x, self._forward)

    def _forward(self, x: torch.Tensor, residual: bool) -> torch.Tensor:
        op = w4a8_token_op()
        if op is not None:
            return op(x, self.inv_smooth, self.packed, self.bias, residual, self.out_features, vnni_kernel())
        return self.forward_pytorch(x, residual)

    def forward_pytorch(self, x: torch.Tensor, residual: bool | None = None) -> torch.Tensor:
        """:meth:`forward` in PyTorch operators, bit for bit (what runs without the compiled
        operator), every row in ``residual``'s passes (None: the layer's own)."""
        residual = self.residual if residual is None else residual
        k, n = self.in_features, self.out_features
        if x.shape[-1] != k:
            raise ValueError(f"expected input (..., {k}), got {tuple(x.shape)}")
        xs = x.reshape(-1, k).float() * self.inv_smooth  # (M, K) smoothed
        rows = xs.shape[0]
        codes_w, scales, minimums = self._unpacked()  # (Np, Kp), (Np, G), (Np, G)
        groups = scales.shape[1]
        passes = 2 if residual else 1
        codes = xs.new_zeros(passes * rows, groups * W4_GROUP)  # (P*M, Kp) activation codes
        amax = torch.linalg.vector_norm(xs, float("inf"), dim=1, keepdim=True).clamp_(min=1e-30)  # (M, 1)
        t = xs.mul_(_CODES / amax)
        torch.round(t, out=codes[:rows, :k])
        step = amax / _CODES
        if residual:
            err = t.sub_(codes[:rows, :k])
            emax = torch.linalg.vector_norm(err, float("inf"), dim=1, keepdim=True).clamp_(min=1e-30)
            torch.round(err.mul_(_CODES / emax), out=codes[rows:, :k])
        grouped = codes.view(-1, groups, W4_GROUP)  # (P*M, G, 64)
        # exact: every partial sum is an integer below 2**24 (64 x 15 x 127)
        dots = torch.einsum("rgk,ngk->grn", grouped, codes_w.view(-1, groups, W4_GROUP))  # (G, P*M, Np)
        sums = grouped.sum(dim=2)  # (P*M, G)
        acc = xs.new_zeros(passes * rows, codes_w.shape[0])
        for g in range(groups):  # in group order, each product and sum rounded on its own
            acc = acc + dots[g] * scales[:, g]
            acc = acc + minimums[:, g][None, :] * sums[:, g:g + 1]
        acc = acc[:, :n]
        y = acc[:rows] * step
        if residual:
            y = y + acc[rows:] * (step * (emax / _CODES))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={W4_GROUP}, "
                f"alpha={self.alpha}, residual={self.residual}, bias={self.bias is not None}")
