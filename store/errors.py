"""Store errors: every one names the problem and the fix, because they end up in front of a user."""

from __future__ import annotations


class StoreError(Exception):
    """Base class. `problem` says what is wrong, `fix` says what to do about it (often a command)."""

    def __init__(self, problem: str, fix: str = ""):
        self.problem = problem
        self.fix = fix
        super().__init__(problem + (f"\n  fix: {fix}" if fix else ""))


class StoreFormatError(StoreError):
    """Not a store, a store of another format version, a damaged header or table, or a truncated file."""


class StoreIdentityError(StoreError):
    """The store was packed from a different checkpoint than the one mounted."""


class StoreCorruptError(StoreError):
    """A record's bytes do not match its checksums."""


class StoreReadError(StoreError):
    """A record could not be read (I/O error or short read) even after retries."""


class DirectIOUnsupported(StoreError):
    """The filesystem holding the store refuses O_DIRECT and buffered reads were not allowed."""


class CheckpointError(StoreError):
    """The checkpoint directory cannot be packed: missing config, shard, tensor, or inconsistent shapes."""


class DiskFullError(StoreError):
    """Not enough space (or a file-size limit) to write the store."""


class PackInterrupted(StoreError):
    """Pack stopped early (Ctrl-C or a failure); the work so far is kept for resuming."""
