"""Loading a model: the built-in offline pair, any Hugging Face id or local directory.

* :func:`load_model` - a causal LM and its tokenizer in a weight mode
  (:mod:`specviz.quant.weights`) on a device: a built-in name (assembled from its data
  packages and cached by :mod:`specviz.models.builtin`), a Hub id, a local directory, or a
  :class:`~specviz.models.types.LoadedModel` to convert;
* :func:`load_pair` - a target and a draft that share a tokenizer
  (:func:`check_same_tokenizer`), the draft's decoder layers fused where its mode allows
  (:func:`with_draft_layers`).

Tiny random models for tests are in :mod:`specviz.models.tiny`.
"""

from __future__ import annotations

import copy
import json
import os
import weakref
from pathlib import Path

import torch

from specviz.models.builtin import (BUILTIN_MODELS, DEFAULT_DRAFT, DEFAULT_TARGET, builtin_entry, cache_dir,
                                    convert_builtin_cached)
from specviz.models.convert import convert_model
from specviz.models.device import resolve_device
from specviz.models.fused import DRAFT_LAYERS
from specviz.models.types import LoadedModel, ModelPair, TokenizerMismatchError
from specviz.quant.weights import CACHEABLE_MODES, WEIGHT_MODES, WeightMode, parse_weight_mode
from specviz.validate import check_choice

__all__ = ["load_model", "load_pair", "check_same_tokenizer", "with_draft_layers", "DISTILLED_META"]

#: the file a distilled draft's directory holds (:func:`specviz.heads.distill.distill_draft`),
#: naming the target it was distilled towards
DISTILLED_META = "specviz_distill.json"


def load_model(name_or_path: "str | os.PathLike | LoadedModel", dtype: WeightMode | torch.dtype | str = "fp32",
               cache: str | os.PathLike | None = None, device: "str | torch.device | None" = None) -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode, on ``device``.

    Args:
        name_or_path: a built-in name (see ``BUILTIN_MODELS``), a local directory, or a
            Hugging Face Hub id (needs network the first time). A ``LoadedModel`` is
            returned unchanged if its weight mode matches, or converted as a copy otherwise.
        dtype: a weight mode of :data:`~specviz.quant.weights.WEIGHT_MODES` ("fp32",
            "bf16", "fp16", "w8a8-token", "w4a8-token") or a torch float dtype: fp32
            (default) is the reference for exact equality, bf16 is fast on CPUs with bf16
            units and on accelerators, w8a8-token and w4a8-token quantize the fp32 weights
            (small forwards are cheaper on x86 CPUs; w4a8-token is a draft's mode).
            ``"auto"`` is not a mode here: the command lines and the study resolve it with
            :func:`specviz.bench.auto.resolve_auto` (probed once per machine and cached).
        cache: cache directory (default ``$SPECVIZ_CACHE`` or ``~/.cache/specviz``).
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` (``"cuda:N"``) or ``"mps"``
            (:func:`~specviz.models.device.resolve_device`). None means ``"auto"`` for a
            name (CUDA, then MPS, then the CPU, skipping devices the weight mode does not
            run on) and the model's own device for a ``LoadedModel`` (moved as a copy when
            another is asked for). Weights are converted on the CPU, then moved.

    Raises:
        ValueError: unknown name that is neither a built-in, a directory nor a loadable id;
            corrupted data packages; unknown or retired weight mode; a ``LoadedModel`` already
            in a converted mode (w8a8-token, w4a8-token) asked for another mode; an unknown
            or absent device, or one the weight mode does not run on.
        FileNotFoundError: a built-in model's data packages are missing (names the pip command).
        PermissionError: the cache directory is not writable.
    """
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
        model = convert_model(model, mode, src.tokenizer).to(dev)
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
        source = str(builtin_entry(spec, load_dtype, cache_dir(cache)))
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
            convert_builtin_cached(BUILTIN_MODELS[name.lower()], model, mode, tokenizer, cache_dir(cache))
        else:
            convert_model(model, mode, tokenizer)
    model.eval().to(dev)
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, dtype=dtype, weight_mode=mode.name)


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
              dtype: WeightMode | torch.dtype | str = "fp32",
              cache: str | os.PathLike | None = None, device: "str | torch.device | None" = None,
              draft_dtype: WeightMode | torch.dtype | str | None = None,
              draft_layers: str = "fused-one-pass") -> ModelPair:
    """Load a target and a draft model in weight mode ``dtype`` on ``device`` (as in
    :func:`load_model`) and check that they share a tokenizer.

    ``draft_dtype`` loads the draft in another mode (None: ``dtype``). A draft's accuracy costs acceptance, never exactness, so a
    faster, less accurate mode can pay there (``w4a8-token``).

    ``draft_layers``: how a draft in ``w4a8-token`` on the CPU runs its decoder layers
    (:mod:`specviz.models.fused`): ``"fused-one-pass"`` (default: one compiled call per
    layer, and every product's input quantized in one pass, in the forwards that run the
    modules too; about 30% less time per forward, its logits different from the modules'
    by rounding) or ``"modules"`` (the modules' forward). Other drafts run their modules.

    Raises:
        TokenizerMismatchError: the vocabularies or special tokens differ (says which).
    """
    check_choice("draft_layers", draft_layers, DRAFT_LAYERS)
    if draft_dtype is None:
        draft_dtype = dtype
    _check_distilled_for(target, draft)
    t = load_model(target, dtype, cache, device)
    d = load_model(draft, draft_dtype, cache, t.device)
    check_same_tokenizer(t.tokenizer, d.tokenizer)
    if d.vocab_size != t.vocab_size:
        raise TokenizerMismatchError(
            f"target and draft output layers differ in size: target vocab_size {t.vocab_size}, "
            f"draft vocab_size {d.vocab_size}")
    return with_draft_layers(ModelPair(target=t, draft=d), draft_layers)


def _check_distilled_for(target: "str | LoadedModel", draft: "str | LoadedModel") -> None:
    """Refuse a distilled draft's directory beside a target other than the one it was
    distilled towards (its :data:`DISTILLED_META` names it)."""
    if isinstance(draft, LoadedModel) or not (Path(str(draft)).expanduser() / DISTILLED_META).is_file():
        return
    meant = json.loads((Path(str(draft)).expanduser() / DISTILLED_META).read_text()).get("target")
    name = target.name if isinstance(target, LoadedModel) else str(target)
    if meant is not None and name.lower() != str(meant).lower():
        raise ValueError(f"the draft in {draft} was distilled towards {meant!r}, not {name!r}; distil one for "
                         f"this target (python -m specviz.heads distill --target {name} ...)")


def with_draft_layers(pair: ModelPair, layers: str) -> ModelPair:
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



