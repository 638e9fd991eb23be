"""The start-up seconds of every process (or in-process vLLM engine) the tests start, printed at
the end of each run (``tests/conftest.py``'s terminal summary), slowest first and totalled per kind:
where a shared fixture would save time is visible in every run's output, not only when measured.

Only the starting is timed (until the process answers its readiness check), never the tests.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

__all__ = ["Startup", "record", "set_current_test", "summary"]


@dataclass(frozen=True)
class Startup:
    kind: str  # "encode-server", "vLLM OpenAI server", "vLLM engine (in-process)"
    what: str  # which one: its model, its role
    seconds: float
    test: str  # the test (or fixture's first test) that started it


_STARTUPS: list[Startup] = []
_CURRENT_TEST = [""]


def set_current_test(nodeid: str) -> None:
    _CURRENT_TEST[0] = nodeid


def record(kind: str, what: str, seconds: float) -> None:
    _STARTUPS.append(Startup(kind, what, seconds, _CURRENT_TEST[0]))


def summary(slowest: int = 30) -> list[str]:
    """The lines the terminal summary prints: per kind, how many and their seconds; then the slowest."""
    if not _STARTUPS:
        return []
    per_kind: dict[str, list[float]] = defaultdict(list)
    for s in _STARTUPS:
        per_kind[s.kind].append(s.seconds)
    lines = [f"{len(_STARTUPS)} process start-ups, {sum(s.seconds for s in _STARTUPS):.0f} s in all:"]
    for kind, seconds in sorted(per_kind.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"  {kind}: {len(seconds)} started, {sum(seconds):.1f} s (slowest {max(seconds):.1f} s)")
    lines.append(f"the {min(slowest, len(_STARTUPS))} slowest:")
    for s in sorted(_STARTUPS, key=lambda s: -s.seconds)[:slowest]:
        lines.append(f"  {s.seconds:6.1f} s  {s.kind}: {s.what}  ({s.test})")
    return lines
