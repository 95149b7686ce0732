"""Where a model runs: device names, their resolution, and synchronised timing.

specviz keeps its own bookkeeping (draft trees, masks, token lists, verification) on
the CPU and runs only the model forwards on the model's device: a forward's inputs go
to the model's device and its logits come back as CPU float32
(:func:`specviz.models.kvcache.forward_tokens`). Moving the logits back waits for the
device, so every wall-clock time around a forward is already synchronised; timings of
calls that do not return logits call :func:`synchronize`.

Device names: ``"auto"`` (the first of CUDA, MPS, CPU that is present and can run the
weight mode), ``"cpu"``, ``"cuda"`` (or ``"cuda:N"``) and ``"mps"``.

Plain decoding of one stream reads every weight once per token, so a device's memory
bandwidth bounds it: at most ``bandwidth / weight bytes`` tokens per second.
:func:`copy_bandwidth` measures that bandwidth on the device the way STREAM's copy does and
:func:`device_name` says which processor or GPU it is; the benchmark records both beside
its plain rows.
"""

from __future__ import annotations

import statistics
import time

import torch

from specviz.data.machine import cpu_label
from specviz.validate import check_int

__all__ = ["DEVICE_CHOICES", "available_devices", "resolve_device", "model_device", "synchronize", "to_device",
           "device_name", "copy_bandwidth"]

DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def available_devices() -> list[str]:
    """The device kinds this machine can run, CPU last: e.g. ``["cuda", "cpu"]``."""
    out = []
    if torch.cuda.is_available():
        out.append("cuda")
    if _mps_available():
        out.append("mps")
    return out + ["cpu"]


def resolve_device(device: "str | torch.device | None", mode=None) -> torch.device:
    """The ``torch.device`` meant by ``device``.

    Args:
        device: ``"auto"`` or None (the first of CUDA, MPS and CPU that is present and
            runs ``mode``), ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or a ``torch.device``.
        mode: a :class:`~specviz.quant.weights.WeightMode`; some modes' kernels run on
            the CPU only.

    Raises:
        ValueError: an unknown device name, a device this machine lacks, or a weight mode
            that cannot run on the device asked for (says which devices it runs on).
    """
    devices = tuple(getattr(mode, "devices", ("cpu", "cuda", "mps")))
    if device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        kind = next(k for k in available_devices() if k in devices or k == "cpu")
        return torch.device(kind)
    try:
        dev = torch.device(device.strip().lower() if isinstance(device, str) else device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use one of {', '.join(DEVICE_CHOICES)} (or cuda:N)") from None
    if dev.type not in DEVICE_CHOICES:
        raise ValueError(f"unknown device {device!r}; use one of {', '.join(DEVICE_CHOICES)} (or cuda:N)")
    if dev.type not in available_devices():
        raise ValueError(f"device {dev.type!r} is not available on this machine (available: "
                         f"{', '.join(available_devices())})")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {str(dev)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if mode is not None and dev.type not in devices:
        raise ValueError(f"weight mode {mode.name!r} runs on {', '.join(devices)} only, not on {dev.type}; "
                         "on an accelerator use fp32, bf16 or fp16")
    return dev


def model_device(model) -> torch.device:
    """The device of a module's parameters (CPU for a module without any)."""
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def synchronize(device: "torch.device | str | None" = None) -> None:
    """Wait until the device has finished its queued work (a no-op on the CPU)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


def to_device(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``tensor`` on ``device`` (the same tensor when it is already there; None stays None)."""
    if tensor is None or tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=False)


def device_name(device: "torch.device | str | None" = None) -> str:
    """The processor behind ``device``: the GPU's name on CUDA, the CPU's model and core
    count on the CPU (:func:`~specviz.data.machine.cpu_label`)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    if dev.type == "mps":
        return "Apple GPU (MPS)"
    return cpu_label()


@torch.no_grad()
def copy_bandwidth(device: "torch.device | str | None" = None, nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """``device``'s memory bandwidth in GB/s, measured as STREAM's copy measures it: a
    float32 tensor of ``nbytes`` copied into another of the same size, its read and its
    written bytes counted (``2 * nbytes / seconds``); the median of ``repeats``
    synchronised copies after one warm-up copy. Make ``nbytes`` far larger than the
    processor's caches (the default, 256 MiB, is), or it measures the caches.

    Raises:
        ValueError: ``nbytes`` under 4 or ``repeats`` under 1.
    """
    check_int("nbytes", nbytes, 4)
    check_int("repeats", repeats, 1)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: pages touched, kernels loaded
    synchronize(dev)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(dev)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9
