"""The peak memory a block of work took, on the encoder's device and in host memory.

What the warm-up publishes (``GET /v1/model``'s ``warmup``): on CUDA the allocator's peak
(``torch.cuda.max_memory_allocated``, reset before the block), and on every device the process's
peak resident set (Linux ``VmHWM``, reset before the block through ``/proc/self/clear_refs``; where
it cannot be reset, the lifetime peak, said so by ``host_since_start``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

__all__ = ["MemoryPeak", "PeakMemory"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class MemoryPeak:
    """``device_bytes``: the CUDA allocator's peak over the block (None off CUDA); ``host_bytes``:
    the process's peak resident set (None where the OS does not say); ``host_since_start``: whether
    ``host_bytes`` is the lifetime peak (model load included) rather than the block's."""

    device_bytes: int | None
    host_bytes: int | None
    host_since_start: bool


def _host_peak() -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_host_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")  # "5": reset the peak RSS (Linux 4.0+)
        return True
    except OSError:
        return False


class PeakMemory:
    """``with PeakMemory(device) as peak: ...``; then ``peak.result``."""

    def __init__(self, device: str) -> None:
        self._cuda = device.startswith("cuda")
        self.result = MemoryPeak(None, None, True)

    def __enter__(self) -> PeakMemory:
        if self._cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._reset = _reset_host_peak()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        device = None
        if self._cuda:
            import torch

            torch.cuda.synchronize()
            device = int(torch.cuda.max_memory_allocated())
        self.result = MemoryPeak(device, _host_peak(), not self._reset)
