"""Recorded generations: :class:`~specviz.decode.GenerationResult` objects with every
:class:`~specviz.decode.StepTrace` (tree tokens and parents, draft probabilities q, target
probabilities p, acceptance, expected acceptance, times) and the decoded text of every token
they hold, in a versioned gzip'd JSON file. A recording replays the real models' steps with
no model and no tokenizer: :class:`RecordedTokenizer` decodes its tokens for the renderers.

The explorer's replay mode reads one (:func:`specviz.render.explorer.explore` with
``model="replay"``); :func:`specviz.render.explorer.record_traces` writes one.

File layout (version 1)::

    {"format": "specviz-traces", "version": 1,
     "info": {"target": ..., "draft": ..., "weights": "fp32", "device": "cpu", ...},
     "tokens": {"<id>": "<decoded text>", ...},
     "traces": [{"settings": {...}, "result": {...}}, ...]}

Floating-point vectors are stored as ``{"dtype": "float32", "values": [...]}`` with NaN as
null and float32 values written in their shortest exact form, so a result read back equals
the one written, bit for bit.

Dimension legend: N = tree nodes including the root, S = side tokens.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from specviz.decode.records import STOP_REASONS, GenerationResult, StepTrace
from specviz.sampling import SamplingConfig
from specviz.data.store import atomic_write_bytes
from specviz.tree.core import DraftTree
from specviz.tree.side import SideBranch
from specviz.verify.base import Acceptance

__all__ = [
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "TraceFileError",
    "RecordedTokenizer",
    "TraceFile",
    "result_to_dict",
    "result_from_dict",
    "result_token_ids",
    "token_texts",
    "read_traces",
    "write_traces",
]

#: the ``format`` field of every trace file
TRACE_FORMAT = "specviz-traces"
#: the version this specviz writes and reads
TRACE_VERSION = 1


class TraceFileError(ValueError):
    """A trace file that cannot be used: not gzip'd JSON, another format or version, or a
    field that is missing or malformed (the message names the file and where)."""


class RecordedTokenizer:
    """Decodes token ids from the texts stored with a recording, the way the renderers ask
    a tokenizer (``decode([id])``), so recorded steps draw with their real token texts.

    Args:
        texts: token id -> its decoded text.
    """

    def __init__(self, texts: Mapping[int, str]) -> None:
        self.texts = {int(k): str(v) for k, v in texts.items()}

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The texts of ``ids`` joined (exact for one token, which is how labels are decoded).

        Raises:
            KeyError: an id the recording holds no text for.
        """
        out = []
        for i in ids:
            i = int(i)
            if i not in self.texts:
                raise KeyError(f"token id {i} is not in the recording's token table")
            out.append(self.texts[i])
        return "".join(out)

    def __len__(self) -> int:
        return len(self.texts)


@dataclass(frozen=True)
class TraceFile:
    """The contents of a trace file.

    Attributes:
        info: what produced the traces (model names, weight mode, device, new tokens, ...).
        entries: ``(settings, result)`` per recorded generation, in file order; settings
            are a plain mapping whose meaning belongs to the writer (the explorer's sliders).
        tokens: token id -> decoded text for every token the results hold.
    """

    info: Mapping[str, Any]
    entries: tuple[tuple[Mapping[str, Any], GenerationResult], ...] = ()
    tokens: Mapping[int, str] = field(default_factory=dict)

    @property
    def tokenizer(self) -> RecordedTokenizer:
        """A tokenizer stand-in that decodes the recorded tokens."""
        return RecordedTokenizer(self.tokens)


# -- values ---------------------------------------------------------------------------------

def _floats(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().cpu()
    if t.dtype == torch.float32:
        # shortest decimal that reads back as the same float32
        values = [None if math.isnan(v) else float(str(np.float32(v))) for v in t.tolist()]
    else:
        values = [None if math.isnan(v) else float(v) for v in t.double().tolist()]
    return {"dtype": str(t.dtype).removeprefix("torch."), "values": values}


_FLOAT_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                 "bfloat16": torch.bfloat16}


def _tensor_from_floats(raw: Any, where: str) -> torch.Tensor:
    if not isinstance(raw, dict) or set(raw) != {"dtype", "values"}:
        raise ValueError(f"{where} must be an object with 'dtype' and 'values'")
    if raw["dtype"] not in _FLOAT_DTYPES:
        raise ValueError(f"{where} has unknown dtype {raw['dtype']!r}")
    values = raw["values"]
    if not isinstance(values, list) or not all(v is None or isinstance(v, (int, float)) and not isinstance(v, bool)
                                               for v in values):
        raise ValueError(f"{where} values must be a list of numbers (null for NaN)")
    return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=_FLOAT_DTYPES[raw["dtype"]])


def _ints(raw: Any, where: str) -> list[int]:
    if not isinstance(raw, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in raw):
        raise ValueError(f"{where} must be a list of integers")
    return raw


def _time(v: float) -> float | None:
    return None if math.isnan(v) else float(v)


def _number(raw: Any, where: str) -> float:
    if raw is None:
        return math.nan
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise ValueError(f"{where} must be a number or null")
    return float(raw)


def _get(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be an object")
    if key not in obj:
        raise ValueError(f"{where} lacks {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ValueError(f"{where}.{key} must be {names}, got {type(value).__name__}")
    return value


# -- results <-> plain data ------------------------------------------------------------------

def _step_to_dict(s: StepTrace) -> dict[str, Any]:
    tree, acc = s.tree, s.acceptance
    side = None
    if s.side is not None:
        side = {"tokens": s.side.tokens.tolist(), "offsets": s.side.offsets.tolist(),
                "mask": ["".join("1" if v else "0" for v in row) for row in s.side.mask.tolist()],
                "groups": s.side.groups.tolist(), "labels": list(s.side.labels)}
    return {
        "step": s.step, "drafter": s.drafter, "context_len": s.context_len,
        "draft_time_s": _time(s.draft_time_s), "verify_time_s": _time(s.verify_time_s),
        "expected_accepted": _time(float(s.expected_accepted)),
        "tree": {"tokens": tree.tokens.tolist(), "parents": tree.parents.tolist(),
                 "q": None if tree.q is None else _floats(tree.q),
                 "ranks": None if tree.ranks is None else tree.ranks.tolist(),
                 "source": None if tree.source is None else tree.source.tolist()},
        "target_token_probs": _floats(s.target_token_probs),
        "acceptance": {"accepted_nodes": list(acc.accepted_nodes), "accepted_tokens": list(acc.accepted_tokens),
                       "bonus_token": int(acc.bonus_token), "node_accept_prob": _floats(acc.node_accept_prob),
                       "tried": [bool(v) for v in acc.tried.tolist()], "rule": acc.rule,
                       "lossless": bool(acc.lossless)},
        "side": side,
    }


def result_to_dict(result: GenerationResult) -> dict[str, Any]:
    """``result`` as JSON-ready plain data (draft distributions ``tree.draft_probs`` are not
    kept: they are ``(N, V)`` per step and no picture needs them)."""
    if not isinstance(result, GenerationResult):
        raise TypeError(f"result must be a GenerationResult, got {type(result).__name__}")
    c = result.config
    return {
        "prompt_ids": list(result.prompt_ids), "output_ids": list(result.output_ids), "text": result.text,
        "wall_s": float(result.wall_s), "stop_reason": result.stop_reason, "drafter": result.drafter,
        "verifier": result.verifier, "max_new_tokens": result.max_new_tokens,
        "config": {"temperature": float(c.temperature), "top_k": int(c.top_k), "top_p": float(c.top_p)},
        "steps": [_step_to_dict(s) for s in result.steps],
    }


def _step_from_dict(raw: Any, where: str) -> StepTrace:
    t = _get(raw, "tree", dict, where)
    tw = f"{where}.tree"
    tokens = _ints(_get(t, "tokens", list, tw), f"{tw}.tokens")
    parents = _ints(_get(t, "parents", list, tw), f"{tw}.parents")
    q = t.get("q")
    ranks, source = t.get("ranks"), t.get("source")
    tree = DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                     q=None if q is None else _tensor_from_floats(q, f"{tw}.q"),
                     ranks=None if ranks is None else torch.tensor(_ints(ranks, f"{tw}.ranks"), dtype=torch.long),
                     source=None if source is None else torch.tensor(_ints(source, f"{tw}.source"), dtype=torch.long))
    a = _get(raw, "acceptance", dict, where)
    aw = f"{where}.acceptance"
    tried = _get(a, "tried", list, aw)
    if not all(isinstance(v, bool) for v in tried):
        raise ValueError(f"{aw}.tried must be a list of true/false")
    accept_prob = _tensor_from_floats(_get(a, "node_accept_prob", dict, aw), f"{aw}.node_accept_prob")
    if len(tried) != tree.n_nodes or accept_prob.numel() != tree.n_nodes:
        raise ValueError(f"{aw}: tried and node_accept_prob need one value per tree node ({tree.n_nodes})")
    nodes = _ints(_get(a, "accepted_nodes", list, aw), f"{aw}.accepted_nodes")
    if any(not 0 < i < tree.n_nodes for i in nodes):
        raise ValueError(f"{aw}.accepted_nodes holds a node outside the {tree.n_nodes}-node tree")
    acceptance = Acceptance(
        accepted_nodes=tuple(nodes),
        accepted_tokens=tuple(_ints(_get(a, "accepted_tokens", list, aw), f"{aw}.accepted_tokens")),
        bonus_token=_get(a, "bonus_token", int, aw), node_accept_prob=accept_prob,
        tried=torch.tensor(tried, dtype=torch.bool), rule=_get(a, "rule", str, aw),
        lossless=_get(a, "lossless", bool, aw))
    p = _tensor_from_floats(_get(raw, "target_token_probs", dict, where), f"{where}.target_token_probs")
    if p.numel() != tree.n_nodes:
        raise ValueError(f"{where}.target_token_probs needs one value per tree node ({tree.n_nodes})")
    side = None
    if raw.get("side") is not None:
        sd = _get(raw, "side", dict, where)
        sw = f"{where}.side"
        mask = _get(sd, "mask", list, sw)
        if not all(isinstance(row, str) and set(row) <= {"0", "1"} for row in mask):
            raise ValueError(f"{sw}.mask must be rows of '0'/'1' characters")
        labels = _get(sd, "labels", list, sw)
        if not all(isinstance(v, str) for v in labels):
            raise ValueError(f"{sw}.labels must be strings")
        side = SideBranch(tokens=torch.tensor(_ints(_get(sd, "tokens", list, sw), f"{sw}.tokens"), dtype=torch.long),
                          offsets=torch.tensor(_ints(_get(sd, "offsets", list, sw), f"{sw}.offsets"),
                                               dtype=torch.long),
                          mask=torch.tensor([[c == "1" for c in row] for row in mask], dtype=torch.bool),
                          groups=torch.tensor(_ints(_get(sd, "groups", list, sw), f"{sw}.groups"), dtype=torch.long),
                          labels=tuple(labels))
    return StepTrace(step=_get(raw, "step", int, where), tree=tree, acceptance=acceptance, target_token_probs=p,
                     expected_accepted=_number(raw.get("expected_accepted"), f"{where}.expected_accepted"),
                     draft_time_s=_number(raw.get("draft_time_s"), f"{where}.draft_time_s"),
                     verify_time_s=_number(raw.get("verify_time_s"), f"{where}.verify_time_s"),
                     drafter=_get(raw, "drafter", str, where), context_len=_get(raw, "context_len", int, where),
                     side=side)


def result_from_dict(raw: Any, where: str = "result") -> GenerationResult:
    """The :class:`GenerationResult` that :func:`result_to_dict` wrote.

    Raises:
        ValueError: a field is missing or malformed, or the steps do not commit the output
            (the message says where, e.g. ``result.steps[3].tree``).
    """
    cfg = _get(raw, "config", dict, where)
    config = SamplingConfig(temperature=_number(cfg.get("temperature"), f"{where}.config.temperature"),
                            top_k=_get(cfg, "top_k", int, f"{where}.config"),
                            top_p=_number(cfg.get("top_p"), f"{where}.config.top_p"))
    steps = tuple(_step_from_dict(s, f"{where}.steps[{i}]") for i, s in enumerate(_get(raw, "steps", list, where)))
    output = tuple(_ints(_get(raw, "output_ids", list, where), f"{where}.output_ids"))
    committed = [t for s in steps for t in s.acceptance.committed_tokens]
    if tuple(committed[:len(output)]) != output:
        raise ValueError(f"{where}: the steps' committed tokens do not spell the output_ids")
    stop = _get(raw, "stop_reason", str, where)
    if stop not in STOP_REASONS:
        raise ValueError(f"{where}.stop_reason must be one of {STOP_REASONS}, got {stop!r}")
    return GenerationResult(
        prompt_ids=tuple(_ints(_get(raw, "prompt_ids", list, where), f"{where}.prompt_ids")), output_ids=output,
        text=_get(raw, "text", str, where), steps=steps, wall_s=_number(raw.get("wall_s"), f"{where}.wall_s"),
        stop_reason=stop, drafter=_get(raw, "drafter", str, where), verifier=_get(raw, "verifier", str, where),
        config=config, max_new_tokens=_get(raw, "max_new_tokens", int, where))


def result_token_ids(result: GenerationResult) -> set[int]:
    """Every token id a picture of ``result`` may label: outputs, tree nodes, bonus and
    side tokens."""
    ids = set(result.output_ids)
    for s in result.steps:
        ids.update(s.tree.tokens.tolist())
        ids.add(int(s.acceptance.bonus_token))
        if s.side is not None:
            ids.update(s.side.tokens.tolist())
    return ids


# -- files ----------------------------------------------------------------------------------

def write_traces(path: str | os.PathLike, traces: TraceFile) -> Path:
    """Write ``traces`` to ``path`` (gzip'd JSON, replaced atomically so an interrupted
    write leaves the previous file); returns the path.

    Raises:
        ValueError: a result holds a token the token table has no text for.
    """
    path = Path(path)
    missing: set[int] = set()
    for _, result in traces.entries:
        missing |= result_token_ids(result) - set(traces.tokens)
    if missing:
        raise ValueError(f"the token table lacks the text of token ids {sorted(missing)[:10]}")
    payload = {
        "format": TRACE_FORMAT, "version": TRACE_VERSION, "info": dict(traces.info),
        "tokens": {str(k): v for k, v in sorted(traces.tokens.items())},
        "traces": [{"settings": dict(settings), "result": result_to_dict(result)}
                   for settings, result in traces.entries],
    }
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    return atomic_write_bytes(path, gzip.compress(data, mtime=0))


def read_traces(path: str | os.PathLike) -> TraceFile:
    """Read and check a trace file.

    Raises:
        FileNotFoundError: no file at ``path``.
        TraceFileError: not gzip'd JSON, another format, another version, or a malformed
            field (the message names the file and the field).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no trace file at {path}")
    try:
        with gzip.open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TraceFileError(f"{path} is not a gzip'd JSON trace file, or it is truncated or corrupted "
                             f"({type(err).__name__}: {err})") from None
    if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise TraceFileError(f"{path} is not a specviz trace file (format {found!r}, expected {TRACE_FORMAT!r})")
    version = data.get("version")
    if version != TRACE_VERSION:
        raise TraceFileError(f"{path} is trace format version {version!r}; this specviz reads version "
                             f"{TRACE_VERSION} (record the traces again with this version)")
    try:
        info = _get(data, "info", dict, "file")
        raw_tokens = _get(data, "tokens", dict, "file")
        tokens = {}
        for k, v in raw_tokens.items():
            if not k.isdigit() or not isinstance(v, str):
                raise ValueError(f"tokens must map token ids to texts, got {k!r}: {v!r}")
            tokens[int(k)] = v
        entries = []
        for i, item in enumerate(_get(data, "traces", list, "file")):
            where = f"traces[{i}]"
            settings = _get(item, "settings", dict, where)
            result = result_from_dict(_get(item, "result", dict, where), f"{where}.result")
            missing = result_token_ids(result) - set(tokens)
            if missing:
                raise ValueError(f"{where}: the token table lacks token ids {sorted(missing)[:10]}")
            entries.append((settings, result))
    except (ValueError, TypeError) as err:
        raise TraceFileError(f"{path}: {err}") from None
    return TraceFile(info=info, entries=tuple(entries), tokens=tokens)


def token_texts(tokenizer: Any, ids: Sequence[int] | set[int]) -> dict[int, str]:
    """``{id: tokenizer.decode([id])}``, the labels the renderers draw."""
    return {int(i): tokenizer.decode([int(i)]) for i in sorted(ids)}
