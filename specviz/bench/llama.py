"""llama.cpp as a measured peer of the benchmark, on the same GGUF files as the built-in pair.

llama.cpp is the engine most CPU users would run these models with. ``python -m specviz.bench``
times two of its programs next to specviz when they are found (``--llama-cpp DIR``, or on
``PATH``); specviz never downloads or builds them. To build them from llama.cpp's source
(about 10 minutes on 2 cores)::

    cmake -S llama.cpp -B llama.cpp/build -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build llama.cpp/build -j --target llama-bench llama-speculative-simple

* ``llama-plain``: ``llama-bench -pg P,N``, one timed prefill of the prompt's P tokens plus N
  generated tokens (N = the token budget) on the target; llama-bench feeds its own tokens,
  which does not change the cost of plain decoding, so the row has a time and a token count
  but no output.
* ``llama-spec-k<K>``: ``llama-speculative-simple`` with the draft model proposing up to K
  tokens per step, on the prompt's exact chat-templated text; the row's time is its prompt
  encoding plus decoding, its output the generated text re-tokenized with the pair's tokenizer.
* ``llama-ngram[-n<N>-k<K>]``: the same program without a draft model, drafting by prompt
  lookup (``--spec-type ngram-simple``): the last N tokens looked up in the context, the K
  tokens after the match proposed (default: llama.cpp's own sizes).

All of them use the Q4_K_M GGUF weights and llama.cpp's own kernels, not the weight mode of
``--dtype``: these rows compare engines, not numerics (``matches_plain`` is expected below 1).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specviz.metrics.external import llama_cpp_runs

__all__ = ["LLAMA_BINARIES", "find_llama_cpp", "LlamaRun", "llama_plain", "llama_speculative", "llama_ngram"]

#: the llama.cpp programs the benchmark runs
LLAMA_BINARIES = ("llama-bench", "llama-speculative-simple")


def find_llama_cpp(directory: str | os.PathLike | None = None) -> Path | None:
    """The directory holding both :data:`LLAMA_BINARIES`: ``directory`` (or its ``bin/`` or
    ``build/bin/``) when given, else the directory of ``llama-bench`` on ``PATH``; None if
    they are not found without a ``directory``.

    Raises:
        FileNotFoundError: ``directory`` was given and does not hold both programs (says
            where it looked and how to build them).
    """
    if directory is None:
        found = shutil.which(LLAMA_BINARIES[0])
        if found and shutil.which(LLAMA_BINARIES[1]):
            return Path(found).resolve().parent
        return None
    base = Path(directory).expanduser()
    candidates = [base, base / "bin", base / "build" / "bin"]
    for c in candidates:
        if all(os.access(c / b, os.X_OK) for b in LLAMA_BINARIES):
            return c
    raise FileNotFoundError(
        f"llama.cpp programs {', '.join(LLAMA_BINARIES)} not found in {', '.join(map(str, candidates))}; build "
        "them with: cmake -S llama.cpp -B llama.cpp/build -DLLAMA_CURL=OFF && cmake --build llama.cpp/build "
        "-j --target llama-bench llama-speculative-simple")


@dataclass(frozen=True)
class LlamaRun:
    """One llama.cpp generation.

    Attributes:
        wall_s: prompt processing plus generation, as the program timed it.
        new_tokens: tokens generated.
        text: the generated text ("" for ``llama-plain``).
        drafted, accepted: draft tokens proposed and accepted (0 for ``llama-plain``).
        steps: target verification steps (``new_tokens`` for plain decoding).
    """

    wall_s: float
    new_tokens: int
    text: str
    drafted: int
    accepted: int
    steps: int


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace")
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{Path(cmd[0]).name} ran over {timeout:.0f} s: {' '.join(cmd)}") from None
    if out.returncode != 0:
        tail = "\n".join((out.stderr or out.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"{Path(cmd[0]).name} failed (exit {out.returncode}): {' '.join(cmd)}\n{tail}")
    return out


def llama_plain(bin_dir: Path, target_gguf: Path, n_prompt: int, n_new: int, threads: int,
                timeout: float = 1800.0) -> LlamaRun:
    """Time llama.cpp's plain decoding: one ``llama-bench -pg n_prompt,n_new`` repetition."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(target_gguf), "-p", "0", "-n", "0", "-pg", f"{n_prompt},{n_new}",
           "-r", "1", "-t", str(threads), "-o", "json"]
    out = _run(cmd, timeout)
    try:
        record = json.loads(out.stdout)[0]
        wall = float(record["avg_ns"]) / 1e9
    except (ValueError, KeyError, IndexError) as exc:
        raise RuntimeError(f"cannot read llama-bench's JSON ({exc}): {out.stdout[:300]!r}") from None
    return LlamaRun(wall, n_new, "", 0, 0, n_new)


def llama_speculative(bin_dir: Path, target_gguf: Path, draft_gguf: Path, prompt_text: str, n_new: int, k: int,
                      threads: int, temperature: float = 0.0, seed: int = 0, timeout: float = 1800.0) -> LlamaRun:
    """Run ``llama-speculative-simple`` on ``prompt_text`` (already chat-templated; special
    tokens are parsed) with up to ``k`` draft tokens per step. Sampling (``temperature`` > 0)
    uses no top-k, top-p or min-p cut, like the other methods."""
    return _speculative(bin_dir, target_gguf, ["-md", str(draft_gguf), "--spec-type", "draft-simple",
                                               "--spec-draft-n-max", str(k)],
                        prompt_text, n_new, threads, temperature, seed, timeout)


def llama_ngram(bin_dir: Path, target_gguf: Path, prompt_text: str, n_new: int, threads: int, n: int | None = None,
                k: int | None = None, temperature: float = 0.0, seed: int = 0, timeout: float = 1800.0) -> LlamaRun:
    """Run ``llama-speculative-simple`` with llama.cpp's prompt-lookup drafts
    (``--spec-type ngram-simple``, no draft model): the last ``n`` tokens looked up in the
    context, up to ``k`` tokens after the match proposed (None: llama.cpp's defaults)."""
    extra = ["--spec-type", "ngram-simple"]
    if n is not None:
        extra += ["--spec-ngram-simple-size-n", str(n)]
    if k is not None:
        extra += ["--spec-ngram-simple-size-m", str(k), "--spec-draft-n-max", str(k)]
    return _speculative(bin_dir, target_gguf, extra, prompt_text, n_new, threads, temperature, seed, timeout)


def _speculative(bin_dir: Path, target_gguf: Path, extra: list[str], prompt_text: str, n_new: int, threads: int,
                 temperature: float, seed: int, timeout: float) -> LlamaRun:
    with tempfile.TemporaryDirectory(prefix="specviz-llama-") as tmp:
        prompt_file = Path(tmp) / "prompt.txt"
        # llama.cpp drops one trailing newline of a prompt file; the chat template's prompt ends with one
        prompt_file.write_text(prompt_text + "\n")
        cmd = [str(bin_dir / "llama-speculative-simple"), "-m", str(target_gguf), *extra, "-f", str(prompt_file),
               "-n", str(n_new), "-t", str(threads), "-c", str(4096), "--seed", str(seed),
               "--temp", f"{temperature:g}", "--top-k", "0", "--top-p", "1.0", "--min-p", "0.0"]
        out = _run(cmd, timeout)
    logs = out.stderr + out.stdout
    try:
        values = llama_cpp_runs(logs, name="llama-speculative-simple's output")[-1]
        for key, what in (("encode_s", "encoding"), ("decode_s", "decoding")):
            if key not in values:
                raise ValueError(f"llama-speculative-simple printed no {what} time")
    except ValueError as exc:
        raise RuntimeError(f"{exc}; its log ends:\n" + "\n".join(logs.strip().splitlines()[-5:])) from None
    text = out.stdout
    at = text.find(prompt_text)
    text = text[at + len(prompt_text):] if at >= 0 else text
    n = int(values["n_predict"])
    accepted = int(values["n_accept"])
    return LlamaRun(values["encode_s"] + values["decode_s"], n, text.rstrip("\n"), int(values["n_drafted"]),
                    accepted, max(1, n - accepted))
