"""The progress bar of a chaos run: one redrawn line on a terminal, a line every 10 s otherwise."""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["Progress"]

WIDTH = 30


class Progress:
    def __init__(self, duration: float, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.duration = duration
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._last_plain = -1e9
        self._drawn = False

    def _write(self, text: str) -> None:
        if self.enabled:
            self.stream.write(text)
            self.stream.flush()

    def line(self, text: str) -> None:
        if self._drawn:
            self._write("\n")
            self._drawn = False
        self._write(text + "\n")

    def event(self, text: str) -> None:
        self.line(f"  - {text}")

    def update(self, elapsed: float, faults: int, acked: int, failed: int) -> None:
        frac = min(1.0, max(0.0, elapsed / self.duration)) if self.duration else 1.0
        bar = "#" * int(frac * WIDTH) + "." * (WIDTH - int(frac * WIDTH))
        text = (f"[{bar}] {frac * 100:3.0f}% {elapsed:5.0f}/{self.duration:.0f}s  faults {faults}  "
                f"acked {acked}  failed ops {failed}")
        if self.tty:
            self._write("\r" + text)
            self._drawn = True
        elif time.monotonic() - self._last_plain >= 10.0:
            self._last_plain = time.monotonic()
            self._write(text + "\n")

    def done(self, report: dict[str, Any]) -> None:
        self.line(f"chaos run {'PASSED' if report['ok'] else 'FAILED'} (seed {report['seed']})")
