"""Wall-clock sections of a step."""

from __future__ import annotations

import time
from contextlib import contextmanager


class StepTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def section(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def pop(self) -> dict[str, float]:
        """{'time/<name>_s': seconds} for the sections since the last pop."""
        out = {f"time/{name}_s": value for name, value in self.seconds.items()}
        self.seconds = {}
        return out
