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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from specviz.quant.extension import vnni_kernel
from specviz.quant.w4a8 import W4A8TokenLinear
from specviz.quant.w8a8 import SharedInputGroup, SharedInputSlice, W8A8TokenLinear, vnni_layout
from specviz.quant.w8a8 import _fbgemm_available  # noqa: F401  (callers check the engine before building a layer)

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
    "vnni_layout",
]


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
        layer._pack()
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
