"""Trained draft heads on disk: where a training run keeps its result, and the module back.

* :func:`load_heads` - a trained module back, checked against the target;
* :func:`find_heads` / :func:`load_cached_heads` - the result of a kind for a target that the
  registry's ``medusa`` and ``eagle`` strategies use (``$SPECVIZ_HEADS``, else the cached one
  trained on the most data); :func:`heads_validation` - what a run measured on its
  validation split; :func:`read_result_meta` - a result directory's ``meta.json``.

Training itself lives in :mod:`specviz.heads.training`, which writes these directories.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from specviz.models.heads import EagleHead, MedusaHeads
from specviz.models.builtin import cache_dir
from specviz.models.types import LoadedModel
from specviz.validate import check_choice

__all__ = ["KINDS", "HEADS_ENV", "load_heads", "find_heads", "heads_validation", "read_result_meta",
           "load_cached_heads", "train_command", "heads_root", "name_slug", "build_heads", "target_meta",
           "resolve_heads_path"]


#: the kinds of draft heads
KINDS: tuple[str, ...] = ("medusa", "eagle")



def name_slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "model"



def heads_root(cache: str | os.PathLike | None) -> Path:
    return cache_dir(cache) / "heads"



def train_command(kind: str, target_name: str) -> str:
    """The command line that trains ``kind`` heads for ``target_name``."""
    if target_name.startswith("tiny-qwen2-seed0"):
        return f"python -m specviz.heads train --kind {kind} --tiny --steps 200"
    return f"python -m specviz.heads train --kind {kind} --target {target_name} --minutes 10"



def build_heads(kind: str, target: LoadedModel, n_heads: int, vocab_map: torch.Tensor | None, seed: int,
           mlp_size: int | None = None):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "medusa":
            return MedusaHeads(target, n_heads, vocab_map)
        return EagleHead(target, vocab_map, mlp_size)



def target_meta(target: LoadedModel) -> dict:
    return {"target": target.name, "hidden_size": int(target.model.config.hidden_size),
            "vocab_size": int(target.vocab_size)}



def resolve_heads_path(path_or_key: str | os.PathLike) -> Path:
    path = Path(path_or_key).expanduser()
    if path.exists():
        return path
    keyed = heads_root(None) / str(path_or_key)
    if keyed.exists():
        return keyed
    raise FileNotFoundError(f"no trained heads at {path} (nor {keyed} in the specviz cache)")



def load_heads(path_or_key: str | os.PathLike, target: LoadedModel) -> torch.nn.Module:
    """A trained head module, checked against ``target``, in eval mode on its device: the
    weights of the lowest validation loss when the run held out a validation split, else
    the last ones.

    Args:
        path_or_key: a result directory, its ``checkpoint.pt``, or a directory relative to
            ``<cache>/heads`` (e.g. ``"tiny-qwen2-seed0/medusa-c.../"``).
        target: the model the heads will draft for.

    Raises:
        FileNotFoundError: no such directory or no ``checkpoint.pt`` in it (names the path).
        ValueError: heads trained for another target, for another hidden size or
            vocabulary size, or a file that is not a specviz heads checkpoint.
    """
    path = resolve_heads_path(path_or_key)
    ckpt = path / "checkpoint.pt" if path.is_dir() else path
    if not ckpt.exists():
        raise FileNotFoundError(f"no trained heads at {ckpt}: the file is missing")
    try:
        saved = torch.load(ckpt, map_location="cpu", weights_only=True)
        meta = saved["meta"]
        kind = meta["kind"]
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same message
        raise ValueError(f"{ckpt} is not a specviz heads checkpoint ({exc})") from None
    if meta.get("target") != target.name:
        raise ValueError(f"heads in {ckpt} were trained for target {meta.get('target')!r}, not {target.name!r}")
    wanted = target_meta(target)
    for key, what in (("hidden_size", "hidden size"), ("vocab_size", "vocabulary size")):
        if meta.get(key) != wanted[key]:
            raise ValueError(f"heads in {ckpt} have {what} {meta.get(key)}, but target {target.name!r} has "
                             f"{wanted[key]}")
    if kind not in KINDS:
        raise ValueError(f"{ckpt} holds heads of unknown kind {kind!r}; known kinds: {', '.join(KINDS)}")
    state = (saved.get("best") or {}).get("state") or saved["state"]  # early stopping's weights, if any
    mlp_size = (meta.get("config") or {}).get("mlp_size") if kind == "eagle" else None
    module = build_heads(kind, target, int(meta.get("n_heads") or 1), state.get("vocab_map"), 0, mlp_size)
    module.load_state_dict(state)
    module.eval()
    return module



def read_result_meta(path: str | os.PathLike) -> tuple[Path, dict]:
    """The result directory of a training run and what its ``meta.json`` records.

    Args:
        path: the result directory or a file in it (e.g. its ``checkpoint.pt``).

    Raises:
        FileNotFoundError: no readable ``meta.json`` there (names the file): not a
            training result.
    """
    path = Path(path).expanduser()
    meta_path = (path.parent if path.is_file() else path) / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or "kind" not in meta:
        raise FileNotFoundError(f"no training result at {path} (no readable {meta_path})")
    return meta_path.parent, meta



#: environment variable naming the result directories the registry's head strategies use
HEADS_ENV = "SPECVIZ_HEADS"



def find_heads(target_name: str, kind: str, cache: str | os.PathLike | None = None) -> Path:
    """The ``kind`` result for ``target_name`` that the registry's strategies draft with.

    The result directories listed in ``$SPECVIZ_HEADS`` (separated by ``os.pathsep``;
    ``python -m specviz.bench --heads DIR ...`` sets it) come first: the first one of
    this kind for this target is used. Otherwise, among the finished results in the
    specviz cache: the one trained on the most data tokens, the newest of those (so the
    small runs of a notebook's defaults do not displace a real training run).

    Raises:
        FileNotFoundError: a listed directory holds no training result, or none is cached
            (the message gives the command that trains one).
    """
    check_choice("kind", kind, KINDS)
    for entry in filter(None, os.environ.get(HEADS_ENV, "").split(os.pathsep)):
        try:
            path, meta = read_result_meta(entry)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"${HEADS_ENV} lists {entry}: {exc}") from None
        if meta.get("kind") == kind and meta.get("target") == target_name:
            return path
    folder = heads_root(cache) / name_slug(target_name)
    found = []
    for meta_path in folder.glob(f"{kind}-*/meta.json"):
        try:
            path, meta = read_result_meta(meta_path.parent)
        except FileNotFoundError:
            continue
        if meta.get("finished") and meta.get("target") == target_name and meta.get("kind") == kind:
            found.append((int(meta.get("data_tokens") or 0), float(meta.get("updated", 0.0)), str(path)))
    if not found:
        raise FileNotFoundError(f"no trained {kind} heads for target {target_name!r} in {folder}; train them "
                                f"with: {train_command(kind, target_name)}")
    return Path(max(found)[2])



def heads_validation(path: str | os.PathLike) -> dict:
    """The validation results a training run recorded (``TrainResult.validation``).

    Raises:
        FileNotFoundError: no ``meta.json`` at ``path``.
        ValueError: the run held out no validation split (or has not finished).
    """
    path, meta = read_result_meta(resolve_heads_path(path))
    if not meta.get("validation"):
        raise ValueError(f"the heads in {path} record no validation results (trained without a "
                         "validation split, or unfinished); retrain them with HeadConfig(validation > 0), the default")
    return meta["validation"]



def load_cached_heads(target: LoadedModel, kind: str) -> torch.nn.Module:
    """:func:`load_heads` of :func:`find_heads` for ``target``."""
    return load_heads(find_heads(target.name, kind), target)
