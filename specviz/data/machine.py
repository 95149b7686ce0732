"""Which machine a measurement ran on: the processor label every timing row carries, and the
file-name-safe key that per-machine caches (the weight-mode probe, converted weights) use."""

from __future__ import annotations

import os
import platform
import re
import socket

import torch

__all__ = ["cpu_label", "machine_label", "machine_key", "cpu_flags"]


def _cpuinfo_lines() -> list[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            return fh.readlines()
    except OSError:
        return []


def cpu_label() -> str:
    """``<CPU model>, <n> cores``: the processor a timing ran on (host name left out)."""
    cpu = platform.processor() or platform.machine()
    if platform.system() == "Linux":
        cpu = next((ln.split(":", 1)[1].strip() for ln in _cpuinfo_lines() if ln.startswith("model name")), cpu)
    return f"{cpu}, {os.cpu_count()} cores"


def machine_label() -> str:
    """``<host name> (<CPU model>, <n> cores)``: which machine measured a timing."""
    return f"{socket.gethostname()} ({cpu_label()})"


def machine_key() -> str:
    """This machine's key for per-machine caches: CPU model, core count and torch version (a
    file-name-safe slug; the host name is left out, so identical CI machines share it)."""
    raw = f"{cpu_label()}-torch{torch.__version__}"
    return re.sub(r"[^A-Za-z0-9.]+", "-", raw).strip("-")


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags ``/proc/cpuinfo`` lists for the first processor (empty where
    there is no such file): ``"avx512_vnni" in cpu_flags()`` and the like."""
    line = next((ln for ln in _cpuinfo_lines() if ln.startswith("flags")), "")
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()
