"""A progress bar on stderr: planned phases with estimated durations, redrawn twice a second.

On a terminal it is one line redrawn in place (``\\r``); otherwise (CI logs, pipes) it prints one
line per phase with its elapsed time, so logs stay readable.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Self, TextIO

__all__ = ["Progress"]

WIDTH = 30


class Progress:
    def __init__(self, estimates: dict[str, float], stream: TextIO | None = None,
                 enabled: bool = True) -> None:
        self.estimates = dict(estimates)          # phase -> estimated seconds
        self.total = sum(self.estimates.values()) or 1.0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._done = 0.0
        self._phase: str | None = None
        self._phase_t0 = 0.0
        self._detail = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = time.monotonic()

    def __enter__(self) -> Self:
        if self.tty:
            self._thread = threading.Thread(target=self._redraw_loop, name="bench-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._draw(final=True)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self._lock:
            self._phase, self._phase_t0, self._detail = name, time.monotonic(), ""
        if self.enabled and not self.tty:
            self._line(f"[{self._percent():3.0f}%] {name} ...")
        try:
            yield
        finally:
            elapsed = time.monotonic() - self._phase_t0
            with self._lock:
                self._done += self.estimates.get(name, 0.0)
                self._phase = None
            if self.enabled and not self.tty:
                self._line(f"[{self._percent():3.0f}%] {name} done in {elapsed:.1f}s")

    def detail(self, text: str) -> None:
        """A short status for the current phase (shown on the bar, or as its own line)."""
        with self._lock:
            self._detail = text
        if self.enabled and not self.tty:
            self._line(f"        {text}")

    def log(self, text: str) -> None:
        """A line that stays (printed above the bar)."""
        if self.enabled:
            self._line(text)

    def _percent(self) -> float:
        done = self._done
        if self._phase is not None:
            est = self.estimates.get(self._phase, 0.0)
            done += min(time.monotonic() - self._phase_t0, 0.95 * est)
        return min(100.0, 100.0 * done / self.total)

    def _line(self, text: str) -> None:
        with self._lock:
            if self.tty:
                self.stream.write("\r\033[K")
            self.stream.write(text + "\n")
            self.stream.flush()

    def _draw(self, final: bool = False) -> None:
        with self._lock:
            pct = 100.0 if final else self._percent()
            filled = int(WIDTH * pct / 100)
            label = "done" if final else (self._phase or "")
            if self._detail and not final:
                label += f": {self._detail}"
            elapsed = time.monotonic() - self.t0
            self.stream.write(f"\r\033[K[{'#' * filled}{'.' * (WIDTH - filled)}] {pct:3.0f}% "
                              f"{elapsed:5.0f}s  {label[:60]}")
            if final:
                self.stream.write("\n")
            self.stream.flush()

    def _redraw_loop(self) -> None:
        while not self._stop.wait(0.5):
            self._draw()
