"""Figures the container test measures (build time, image size, start-up), printed after the run."""

from __future__ import annotations

__all__ = ["TIMINGS"]

TIMINGS: dict[str, str] = {}
