"""The target's features: its last hidden state (the input of its LM head) at every position.

* :func:`target_features` - one teacher-forced forward of a token sequence, ``(T, H)``;
* :func:`extract_features` - the features of a whole training set, cached on disk in
  shards (one file per shard, written atomically), with a progress bar on stderr;
  finished shards are skipped when it runs again, so an interrupted extraction resumes;
* :func:`load_features` - the shards back as one tensor per sequence.

A feature directory holds ``features.json`` (the target, hidden size, the data's sha256
and the shard size) and ``shard-00000.pt``, ... ; it belongs to one target and one data
set, and any other use of it is refused.

Dimension legend: T = tokens of a sequence, H = hidden size.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

from specviz.models.kvcache import forward_tokens, new_cache
from specviz.models.types import LoadedModel
from specviz.data.store import atomic_write_bytes, atomic_write_text
from specviz.validate import check_int

__all__ = ["target_features", "extract_features", "load_features", "FEATURE_DTYPES"]

#: storage dtypes of :func:`extract_features`: float16 halves the disk and memory of
#: float32 (a shard that would overflow it is kept in float32)
FEATURE_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16,
                                          "float32": torch.float32}


@torch.no_grad()
def target_features(target: LoadedModel, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """The target's last hidden state (after its final norm: the input of its LM head) at
    every position of ``token_ids``, from one teacher-forced causal forward.

    Returns:
        ``(T, H)`` float32 CPU tensor (``(0, H)`` for an empty sequence).

    Raises:
        ValueError: ids that are not a 1-D integer sequence, or longer than the target's
            context.
    """
    ids = torch.as_tensor(token_ids) if len(token_ids) else torch.zeros(0, dtype=torch.long)
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"token_ids must be a 1-D sequence of token ids, got {ids.dtype} {tuple(ids.shape)}")
    width = int(target.model.config.hidden_size)
    if ids.numel() == 0:
        return torch.zeros(0, width)
    if ids.numel() > target.max_context:
        raise ValueError(f"{ids.numel()} tokens exceed {target.name}'s context of {target.max_context}")
    ids = ids.to(torch.long)
    _, hidden = forward_tokens(target.model, new_cache(target.model), ids[None], torch.arange(ids.numel())[None],
                               None, logits_to_keep=1, hidden=True)  # (1, T, H)
    return hidden[0]


def _meta(target: LoadedModel, sha256: str, count: int, shard_size: int, dtype: str) -> dict:
    return {"target": target.name, "weight_mode": target.weight_mode,
            "hidden_size": int(target.model.config.hidden_size), "data_sha256": sha256, "sequences": count,
            "shard_size": shard_size, "dtype": dtype}


def _check_meta(path: Path, found: dict, wanted: dict) -> None:
    for key in ("target", "weight_mode", "hidden_size", "data_sha256", "sequences", "shard_size", "dtype"):
        if found.get(key) != wanted[key]:
            raise ValueError(f"feature directory {path} holds {key} {found.get(key)!r}, not {wanted[key]!r}; "
                             "give another directory (or delete this one)")


def _save(path: Path, obj) -> None:
    """``torch.save`` of ``obj`` (tensors, or a dict of them), written atomically."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


def _storable(feats: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``feats`` in storage ``dtype``, or as they are where that would overflow."""
    stored = feats.to(dtype)
    return stored if bool(torch.isfinite(stored).all()) else feats


def _shard_path(directory: Path, index: int) -> Path:
    return directory / f"shard-{index:05d}.pt"


def extract_features(target: LoadedModel, sequences: Sequence[Sequence[int]], directory: str | os.PathLike, *,
                     sha256: str, shard_size: int = 64, dtype: str = "float16", progress: bool = True,
                     kept: Callable[[int], tuple[str, str, torch.Tensor] | None] | None = None) -> Path:
    """Compute :func:`target_features` of every sequence into ``directory``, shard by shard.

    Each shard (``shard_size`` sequences) is one file written atomically when it is
    complete; shards already on disk are skipped, so running it again after an
    interruption resumes where it stopped, and running it on finished work costs nothing.

    Args:
        target: the target model.
        sequences: token id sequences (e.g. :attr:`specviz.heads.Corpus.sequences`).
        directory: where the shards go (created).
        sha256: the data set's hash (:attr:`specviz.heads.Corpus.sha256`), recorded and
            checked so that a directory is never reused for other data.
        shard_size: sequences per shard.
        dtype: storage dtype, a key of :data:`FEATURE_DTYPES`.
        progress: show a progress bar on stderr.
        kept: features already computed (:attr:`specviz.heads.Corpus.features`, kept
            while the target decoded the sequences): ``kept(i)`` is ``(target name,
            weight mode, (T, H) tensor)`` or None. They are used where they come from
            ``target`` in its weight mode and cover the sequence; every other sequence
            gets its teacher-forced forward.

    Returns:
        ``directory``.

    Raises:
        ValueError: ``directory`` holds features of another target or data set, or a bad
            ``dtype`` / ``shard_size``.
    """
    from tqdm import tqdm

    check_int("shard_size", shard_size)
    if dtype not in FEATURE_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(FEATURE_DTYPES)}, got {dtype!r}")
    out = Path(directory)
    meta = _meta(target, sha256, len(sequences), shard_size, dtype)
    meta_path = out / "features.json"
    if meta_path.exists():
        _check_meta(out, json.loads(meta_path.read_text()), meta)
    else:
        atomic_write_text(meta_path, json.dumps(meta, indent=1) + "\n")
    n_shards = -(-len(sequences) // shard_size)
    todo = [s for s in range(n_shards) if not _shard_path(out, s).exists()]
    total = sum(len(sequences[i]) for s in todo for i in range(s * shard_size, min((s + 1) * shard_size,
                                                                                     len(sequences))))
    width = int(target.model.config.hidden_size)

    def reuse(i: int) -> torch.Tensor | None:
        found = kept(i) if kept is not None else None
        if found is None or found[:2] != (target.name, target.weight_mode):
            return None
        feats = found[2]
        return feats.float() if tuple(feats.shape) == (len(sequences[i]), width) else None

    with tqdm(total=total, desc=f"features of {target.name}", unit="tok", file=sys.stderr, disable=not progress,
              mininterval=1.0) as bar:
        for s in todo:
            rows = []
            for i in range(s * shard_size, min((s + 1) * shard_size, len(sequences))):
                feats = reuse(i)
                if feats is None:
                    feats = target_features(target, list(sequences[i]))  # (T, H)
                rows.append(_storable(feats, FEATURE_DTYPES[dtype]))
                bar.update(len(sequences[i]))
            _save(_shard_path(out, s), rows)
    return out


def load_features(directory: str | os.PathLike, *, sha256: str | None = None) -> list[torch.Tensor]:
    """The features :func:`extract_features` wrote, one ``(T, H)`` tensor per sequence, in
    order, in their storage dtype (cast a batch at a time to save memory).

    Raises:
        FileNotFoundError: the directory, its ``features.json`` or a shard is missing.
        ValueError: ``sha256`` given and the features belong to other data.
    """
    path = Path(directory)
    meta_path = path / "features.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"no features in {path} (missing {meta_path}); run extract_features first")
    meta = json.loads(meta_path.read_text())
    if sha256 is not None and meta.get("data_sha256") != sha256:
        raise ValueError(f"features in {path} belong to data {meta.get('data_sha256')!r}, not {sha256!r}")
    n_shards = -(-int(meta["sequences"]) // int(meta["shard_size"]))
    out: list[torch.Tensor] = []
    for s in range(n_shards):
        shard = _shard_path(path, s)
        if not shard.exists():
            raise FileNotFoundError(f"feature shard {shard} is missing; run extract_features again to finish it")
        out.extend(torch.load(shard, map_location="cpu", weights_only=True))
    return out
