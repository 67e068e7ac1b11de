"""O_DIRECT plumbing: aligned buffers, opening with a probe, full reads and writes.

O_DIRECT needs the buffer address, the file offset and the length aligned (4 KiB covers every device we
target). Buffers come from anonymous mmap: page-aligned, and pinnable later with cudaHostRegister.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
from pathlib import Path

import numpy as np

from store.errors import DirectIOUnsupported
from store.format import ALIGN

# Errors a filesystem gives for "no O_DIRECT here" (at open on older tmpfs, at the first read on others).
NO_DIRECT_ERRNOS = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


def alloc_aligned(nbytes: int) -> np.ndarray:
    """A zeroed uint8 array of at least nbytes (rounded up to 4 KiB) on a page-aligned anonymous mapping."""
    size = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
    arr = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)     # the array keeps the mapping alive
    return arr[:nbytes] if nbytes else arr[:0]


def alloc_slots(count: int, slot_bytes: int) -> np.ndarray:
    """A (count, stride) uint8 arena whose rows are each 4 KiB-aligned: one row per record buffer."""
    stride = (slot_bytes + ALIGN - 1) // ALIGN * ALIGN
    return alloc_aligned(count * stride).reshape(count, stride)


def is_aligned(buf: np.ndarray) -> bool:
    return buf.ctypes.data % ALIGN == 0


def direct_fix(path: Path | str) -> str:
    return (f"move {path} to an ext4 or xfs filesystem (tmpfs, overlay and some network filesystems refuse "
            "O_DIRECT), or set GLM53_ALLOW_BUFFERED_READS=1 to accept slower buffered reads")


def no_direct_error(path: Path | str, exc: OSError) -> DirectIOUnsupported:
    return DirectIOUnsupported(f"the filesystem holding {path} does not support O_DIRECT reads "
                               f"({os.strerror(exc.errno or 0)})", direct_fix(path))


def open_direct(path: Path | str, flags: int = os.O_RDONLY) -> int:
    """Open with O_DIRECT and prove a 4 KiB aligned read works. Raises DirectIOUnsupported (or OSError)."""
    try:
        fd = os.open(path, flags | os.O_DIRECT)
    except OSError as exc:
        if exc.errno in NO_DIRECT_ERRNOS:
            raise no_direct_error(path, exc) from None
        raise
    try:
        if os.fstat(fd).st_size >= ALIGN:
            probe = alloc_aligned(ALIGN)
            os.preadv(fd, [memoryview(probe)], 0)
    except OSError as exc:
        os.close(fd)
        if exc.errno in NO_DIRECT_ERRNOS:
            raise no_direct_error(path, exc) from None
        raise
    return fd


def open_for_read(path: Path | str, allow_buffered: bool, warn=None) -> tuple[int, bool]:
    """(fd, direct). Falls back to a buffered fd only when allowed, and then says so through warn()."""
    try:
        return open_direct(path), True
    except DirectIOUnsupported as exc:
        if not allow_buffered:
            raise
        if warn is not None:
            warn(f"{exc.problem}; reading it buffered because GLM53_ALLOW_BUFFERED_READS is set "
                 "(slower, and it fills the page cache)")
        return os.open(path, os.O_RDONLY), False


def dir_supports_direct(directory: Path) -> bool:
    """Whether files in this directory accept O_DIRECT writes and reads (probed with a temporary file)."""
    fd, name = tempfile.mkstemp(prefix=".glm53-odirect-", dir=directory)
    os.close(fd)
    try:
        try:
            dfd = os.open(name, os.O_RDWR | os.O_DIRECT)
        except OSError as exc:
            if exc.errno in NO_DIRECT_ERRNOS:
                return False
            raise
        try:
            buf = alloc_aligned(ALIGN)
            os.pwritev(dfd, [memoryview(buf)], 0)
            os.preadv(dfd, [memoryview(buf)], 0)
            return True
        except OSError as exc:
            if exc.errno in NO_DIRECT_ERRNOS:
                return False
            raise
        finally:
            os.close(dfd)
    finally:
        os.unlink(name)


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read until view is full or EOF; returns bytes read (short only at EOF)."""
    pos, n = 0, len(view)
    while pos < n:
        got = os.preadv(fd, [view[pos:]], offset + pos)
        if got <= 0:
            break
        pos += got
    return pos


def pwrite_from(fd: int, view: memoryview, offset: int) -> None:
    pos, n = 0, len(view)
    while pos < n:
        pos += os.pwritev(fd, [view[pos:]], offset + pos)
