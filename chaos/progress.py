"""The progress of a chaos run (tqdm): a bar over the run's duration with the counts so far, and
the run's events printed above it. Off a terminal (CI logs) the bar refreshes every 10 s."""
from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["Progress"]


class Progress:
    def __init__(self, duration: float, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        tty = self.stream.isatty()
        self.enabled = enabled
        self._bar = tqdm(total=round(duration), unit="s", file=self.stream, disable=not enabled,
                         mininterval=0.5 if tty else 10.0, dynamic_ncols=tty, leave=True,
                         bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}s{postfix}")

    def line(self, text: str) -> None:
        if self.enabled:
            self._bar.write(text, file=self.stream)

    def event(self, text: str) -> None:
        self.line(f"  - {text}")

    def update(self, elapsed: float, faults: int, acked: int, failed: int) -> None:
        self._bar.n = min(self._bar.total, round(elapsed))
        self._bar.set_postfix_str(f"faults {faults}  acked {acked}  failed ops {failed}", refresh=False)
        self._bar.refresh()

    def done(self, report: dict[str, Any]) -> None:
        self._bar.close()
        self.line(f"chaos run {'PASSED' if report['ok'] else 'FAILED'} (seed {report['seed']})")
