"""The prestage: a few of the next layer's likely misses copied over PCIe while the link would otherwise idle.

On a link-bound host (a consumer card on PCIe 4.0) a decode step's misses cross the link in series with the layer's
compute: the link is busy with a layer's demand copies and then idle while that layer's experts, the next layer's
attention and the host's step run. The stepper fills that idle time with the best-ranked guesses (the next layer's
router run on this layer's input, glm53.step.lookahead) that are outside VRAM: they go onto the copy stream right
behind the layer's own demand copies, into staging rows reserved for the purpose, and the next layer reads a guessed
expert it picks from its row instead of copying it. The bytes are the expert's own, so the step stays bit-identical.

The reserved rows: PER_PARITY rows for even layers and as many for odd ones, at the top of the dedicated staging
rows. Layer l's step prestages for layer l + 1 into that layer's parity rows, the ones layer l - 1's kernels read
(layer l's own kernels read the other parity's and the demand rows); the copy stream waits for the work queued on the
compute stream before each batch, layer l - 1's kernels among it, and runs its copies in order, layer l - 1's
admissions from those rows among them. Demand copies use the rows below the reserved ones, so a step prestages only
when its demand fits there (`fits`).

A guess counts only for the step it was made for: the very next layer step, decode, with as many rows. Any other
step (a prefill chunk, whose staging uses every row; another batch) drops it.

Whether it pays is judged by outcome (glm53.step.paired_judge): each wrong guess costs link time that the next
demand copies may wait for, and the router run ahead costs host time every layer.
"""

from __future__ import annotations

from typing import Any

from glm53.step.paired_judge import PairedJudge

PER_PARITY = 2  # rows per layer parity: about the link's idle time a layer on PCIe 4.0 (docs/decode-step-design.md)


class PrestageJudge(PairedJudge):
    what = "prestage"


class Prestage:
    def __init__(self, dedicated_rows: int, top_k: int, per_parity: int = PER_PARITY,
                 judge: PairedJudge | None = None):
        """dedicated_rows: the staging rows of the link's own (the rest are borrowed cache slots); top_k: picks
        per row of a step."""
        self.per_parity = int(per_parity)
        self.base = int(dedicated_rows) - 2 * self.per_parity  # demand rows: [0, base)
        self.top_k = int(top_k)
        if self.per_parity < 1 or self.base < self.top_k:
            raise ValueError(f"{dedicated_rows} dedicated staging rows leave no room for {2 * self.per_parity} "
                             f"prestage rows beside one row's {top_k} demand copies")
        self.judge = PrestageJudge() if judge is None else judge
        self._pending: tuple[int, int, dict[int, int], Any] | None = None  # (layer, rows, expert -> row, ticket)
        self.staged = 0  # experts copied ahead
        self.used = 0    # of those, read by the step they were copied for
        self.dropped = 0  # guesses dropped because another step came between

    @classmethod
    def room(cls, dedicated_rows: int, top_k: int, per_parity: int = PER_PARITY) -> bool:
        """Whether a layout with these dedicated rows can prestage at all."""
        return per_parity >= 1 and dedicated_rows - 2 * per_parity >= top_k

    def fits(self, rows: int) -> bool:
        """Whether a step of `rows` token rows leaves the reserved rows alone (its demand fits below them)."""
        return rows * self.top_k <= self.base

    def rows_of(self, layer: int) -> list[int]:
        """The staging rows reserved for layer's parity."""
        first = self.base + (layer % 2) * self.per_parity
        return list(range(first, first + self.per_parity))

    def put(self, layer: int, rows: int, experts: list[int], ticket: Any) -> dict[int, int]:
        """experts were copied, in order, into layer's reserved rows for its coming step of `rows` token rows."""
        where = dict(zip(experts, self.rows_of(layer), strict=False))
        self._pending = (layer, rows, where, ticket)
        self.staged += len(where)
        return where

    def take(self, layer: int, decode: bool, rows: int) -> tuple[dict[int, int], Any]:
        """The experts copied ahead for this step (expert -> staging row) and their copy ticket; ({}, None) if none
        were, or they were for another step (dropped)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return {}, None
        for_layer, for_rows, where, ticket = pending
        if not decode or for_layer != layer or for_rows != rows or not self.fits(rows):
            self.dropped += len(where)
            return {}, None
        return where, ticket

    def snapshot(self) -> dict:
        return {"rows_per_parity": self.per_parity, "staged": self.staged, "used": self.used,
                "dropped": self.dropped, "precision": round(self.used / self.staged, 4) if self.staged else None,
                "judge": self.judge.snapshot()}
