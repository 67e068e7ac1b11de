"""The byte image of one expert slot, and named tensor views into it.

A slot is one flat uint8 buffer of `nbytes`; each named field (an EXL3 expert: gate/up/down trellis, suh, svh)
is a typed view at a fixed offset. Every tier holds experts in this image, so moving an expert between
tiers is one contiguous copy, and a field view is made once and stays valid for the life of the buffer:
refilling a slot copies INTO it and never replaces a tensor object whose address a kernel has baked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the slot image

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class SlotLayout:
    fields: tuple[Field, ...]
    nbytes: int

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate field names in slot layout: {names}")
        spans = sorted((f.offset, f.offset + f.nbytes, f.name) for f in self.fields)
        for (_, a1, an), (b0, _, bn) in zip(spans, spans[1:], strict=False):
            if b0 < a1:
                raise ValueError(f"fields {an} and {bn} overlap")
        for f in self.fields:
            if f.offset % f.dtype.itemsize:
                raise ValueError(f"field {f.name} at offset {f.offset} is not {f.dtype}-aligned")
            if f.offset < 0 or f.offset + f.nbytes > self.nbytes:
                raise ValueError(f"field {f.name} does not fit in a {self.nbytes}-byte slot")

    @classmethod
    def packed(cls, fields: list[tuple[str, torch.dtype, tuple[int, ...]]], align: int = 256) -> SlotLayout:
        """Fields back to back in the given order, each starting at a multiple of `align` bytes."""
        out, off = [], 0
        for name, dtype, shape in fields:
            off = -(-off // align) * align
            f = Field(name, dtype, tuple(shape), off)
            out.append(f)
            off += f.nbytes
        return cls(tuple(out), -(-off // align) * align)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named typed views of one slot image (a contiguous uint8 tensor of nbytes). No copies."""
        if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != self.nbytes or not flat.is_contiguous():
            raise ValueError(f"expected a contiguous uint8 tensor of {self.nbytes} bytes, got {flat.dtype} {tuple(flat.shape)}")
        return {f.name: flat[f.offset : f.offset + f.nbytes].view(f.dtype).view(f.shape) for f in self.fields}


def exl3_expert_layout(hidden: int = 4096, intermediate: int = 2048, bits: int = 3, align: int = 256) -> SlotLayout:
    """The slot image of one EXL3 routed expert: gate, up, down trellis, then their suh/svh.

    Trellis of a (in x out) linear is int16 (in/16, out/16, 16*bits); suh is fp16 (in), svh fp16 (out).
    GLM-5.3-Flash at 3 bits: 9 MiB of trellis + 36 KiB of scales. The store's record must begin with exactly
    this image (same order, same alignment) for NVMe -> RAM -> VRAM to be one copy each.
    """
    proj = {"gate": (hidden, intermediate), "up": (hidden, intermediate), "down": (intermediate, hidden)}
    fields: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for p, (i, o) in proj.items():
        fields.append((f"{p}.trellis", torch.int16, (i // 16, o // 16, 16 * bits)))
    for p, (i, o) in proj.items():
        fields.append((f"{p}.suh", torch.float16, (i,)))
        fields.append((f"{p}.svh", torch.float16, (o,)))
    return SlotLayout.packed(fields, align)
