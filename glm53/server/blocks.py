"""A chat choice's deltas -> ordered content blocks (thinking, text, tool call), for the wire formats that
send a reply as a list of typed blocks (Anthropic Messages' content, the Responses API's output items).

Chat Completions sends reasoning, content and tool calls as three parallel fields; the block formats send
them in the order the model wrote them, each block opened, filled and closed. The streamed reply and the
collected one are built from the same block events, so they agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from glm53.server.chat import Delta

Kind = Literal["thinking", "text", "tool"]


@dataclass
class Block:
    kind: Kind
    index: int  # position in the reply (Anthropic's content index, the Responses output_index)
    text: str = ""  # the thinking, the text, or a tool call's arguments JSON
    call_id: str = ""
    name: str = ""


@dataclass
class BlockEvent:
    type: Literal["start", "delta", "stop"]
    block: Block
    piece: str = ""  # the text a "delta" adds


class BlockSequence:
    """Feed each delta of one choice; get the block events it implies. finish() closes the open block."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.open: Block | None = None

    def _switch(self, out: list[BlockEvent], kind: Kind, call_id: str = "", name: str = "") -> Block:
        if self.open is not None and self.open.kind == kind and kind != "tool":
            return self.open
        self._close(out)
        block = Block(kind, len(self.blocks), call_id=call_id, name=name)
        self.blocks.append(block)
        self.open = block
        out.append(BlockEvent("start", block))
        return block

    def _close(self, out: list[BlockEvent]) -> None:
        if self.open is not None:
            out.append(BlockEvent("stop", self.open))
            self.open = None

    def _add(self, out: list[BlockEvent], block: Block, piece: str) -> None:
        if piece:
            block.text += piece
            out.append(BlockEvent("delta", block, piece))

    def feed(self, delta: Delta) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        if delta.reasoning:
            self._add(out, self._switch(out, "thinking"), delta.reasoning)
        if delta.content:
            self._add(out, self._switch(out, "text"), delta.content)
        for tc in delta.tool_calls:
            if tc.id is not None or self.open is None or self.open.kind != "tool":
                self._switch(out, "tool", tc.id or "", tc.name or "")
            assert self.open is not None
            self._add(out, self.open, tc.arguments)
        return out

    def finish(self) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        self._close(out)
        return out
