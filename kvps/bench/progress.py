"""The progress of a bench run (tqdm): planned phases weighted by their estimated seconds, the
current phase and its detail on the bar, lines that stay printed above it. Off a terminal (CI
logs, pipes) the bar refreshes every 10 s and each phase also gets a line when it ends."""
from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Self, TextIO

from tqdm import tqdm

__all__ = ["Progress", "say"]


def say(text: str) -> None:
    """A line on stderr (benchmark scripts that draw no bar)."""
    print(text, file=sys.stderr, flush=True)


class Progress:
    def __init__(self, estimates: dict[str, float], stream: TextIO | None = None,
                 enabled: bool = True) -> None:
        self.estimates = dict(estimates)  # phase -> estimated seconds
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._bar = tqdm(total=round(sum(self.estimates.values()) or 1.0, 1), unit="s",
                         file=self.stream, disable=not enabled, mininterval=0.5 if self.tty else 10.0,
                         dynamic_ncols=self.tty, bar_format="{l_bar}{bar}| {elapsed}{postfix}")
        self._phase = ""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        self._phase = name
        self._bar.set_postfix_str(name)
        try:
            yield
        finally:
            self._bar.update(self.estimates.get(name, 0.0))
            if not self.tty:
                self.log(f"{name} done in {time.monotonic() - started:.1f}s")

    def detail(self, text: str) -> None:
        """A short status for the current phase, shown on the bar."""
        self._bar.set_postfix_str(f"{self._phase}: {text}")

    def log(self, text: str) -> None:
        """A line that stays (printed above the bar)."""
        if self.enabled:
            self._bar.write(text, file=self.stream)
