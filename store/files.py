"""What kind of thing a path is, found without opening it: open() on a FIFO blocks until a writer comes (start-up
or a check would hang silently), and a directory, a socket or a device is no file of ours either."""

from __future__ import annotations

import os
import stat
from pathlib import Path

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def not_regular(path: str | Path) -> str | None:
    """What `path` is when it exists and is not a regular file ("a directory", "a FIFO (named pipe)", ...); None
    for a regular file (a link is followed) and for a path that does not exist (opening it says so)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")
