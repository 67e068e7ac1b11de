"""Byte units and the plan's wording for sizes: every message of the decision package says 12 GiB the same way."""

from __future__ import annotations

GIB = 1 << 30
MIB = 1 << 20
KIB = 1 << 10


def gib(n: float) -> str:
    """Bytes as GiB for messages: 12 GiB, 11.8 GiB."""
    return f"{n / GIB:.1f}".removesuffix(".0") + " GiB"


def human(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            return f"{n / size:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} B"
