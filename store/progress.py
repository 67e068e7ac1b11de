"""Byte progress with GB/s: a tqdm bar on a terminal, a line every few seconds in logs (docker, CI)."""

from __future__ import annotations

import sys
import threading
import time


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


class ProgressMeter:
    def __init__(self, desc: str, total: int, initial: int = 0, enabled: bool = True, every_s: float = 10.0):
        self.desc, self.total, self.done = desc, total, initial
        self.enabled, self.every_s = enabled, every_s
        self.start = time.perf_counter()
        self.counted = 0                          # bytes moved in this run (the rate excludes resumed work)
        self.extra = ""
        self._lock = threading.Lock()
        self._bar = None
        self._last = self.start
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=desc, unit="B", unit_scale=True,
                             unit_divisor=1000, dynamic_ncols=True, file=sys.stderr)

    def update(self, n: int) -> None:
        with self._lock:
            self.done += n
            self.counted += n
            if self._bar is not None:
                self._bar.update(n)
            elif self.enabled and time.perf_counter() - self._last >= self.every_s:
                self._last = time.perf_counter()
                print(self.line(), file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        """A short status shown beside the bar (e.g. how far checkpoint hashing is)."""
        self.extra = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def rate(self) -> float:
        dt = time.perf_counter() - self.start
        return self.counted / dt if dt > 0 else 0.0

    def line(self) -> str:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        extra = f", {self.extra}" if self.extra else ""
        return f"{self.desc}: {gb(self.done)} of {gb(self.total)} ({pct:.0f}%), {self.rate() / 1e9:.2f} GB/s{extra}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
