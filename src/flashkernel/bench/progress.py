"""A one-line progress display on stderr (no dependency): ``[ 3/36 0:42 eta 7:10] label``."""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}:{seconds % 60:02d}"


class ProgressLine:
    """Rewrites one line in a terminal; elsewhere (a log file) prints a line at most every
    ``log_every_s`` seconds."""

    def __init__(self, total: int, stream=None, enabled: bool = True, log_every_s: float = 10.0):
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.start = time.monotonic()
        self.done = 0
        self.log_every_s = log_every_s
        self.last_logged = float("-inf")
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())

    def text(self, label: str) -> str:
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        width = len(str(self.total))
        return f"[{self.done:>{width}}/{self.total} {_clock(elapsed)} eta {_clock(eta)}] {label}"

    def show(self, label: str) -> None:
        """Show ``label`` as the step now running."""
        if not self.enabled:
            return
        line = self.text(label)
        if self.interactive:
            self.stream.write("\r\033[K" + line[:160])
        elif time.monotonic() - self.last_logged >= self.log_every_s:
            self.last_logged = time.monotonic()
            self.stream.write(line + "\n")
        self.stream.flush()

    def step(self) -> None:
        self.done += 1

    def close(self) -> None:
        if self.enabled and self.interactive:
            self.stream.write("\r\033[K")
            self.stream.flush()
