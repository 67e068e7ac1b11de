"""transformers' progress bars and one-time notes silenced: the engines and the fixture writers load through it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars and one-time 'kernel not installed' notes for a while.

    On a CPU the pure-PyTorch KDA / conv1d fallbacks are the intended path, not a degraded one.
    """
    from transformers.utils import logging as tlog

    level = tlog.get_verbosity()
    bars = tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        tlog.set_verbosity(level)
        if bars:
            tlog.enable_progress_bar()
