"""GLM's chat markup: the special-token strings of the GLM-5.3 tokenizer and chat template.

The server's reasoning / tool-call parser reads generated text with them, and the test-checkpoint tokenizer
(glm53.fixture.tokenizer) builds its vocabulary and template from them, so the two cannot drift apart.
"""

from __future__ import annotations

ENDOFTEXT = "<|endoftext|>"
GMASK = "[gMASK]"
SOP = "<sop>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
OBSERVATION = "<|observation|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
ARG_KEY_OPEN = "<arg_key>"
ARG_KEY_CLOSE = "</arg_key>"
ARG_VALUE_OPEN = "<arg_value>"
ARG_VALUE_CLOSE = "</arg_value>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
NOTHINK = "/nothink"
BEGIN_OF_IMAGE = "<|begin_of_image|>"
END_OF_IMAGE = "<|end_of_image|>"
BEGIN_OF_VIDEO = "<|begin_of_video|>"
END_OF_VIDEO = "<|end_of_video|>"
IMAGE = "<|image|>"
VIDEO = "<|video|>"

# A generated turn ends at any of these (GLM's generation_config lists the same three).
EOS_TOKENS = (ENDOFTEXT, USER, OBSERVATION)

# Control tokens: never part of visible text, dropped by decode(skip_special_tokens=True).
CONTROL_TOKENS = (
    ENDOFTEXT, "[MASK]", GMASK, "[sMASK]", SOP, "<eop>", SYSTEM, USER, ASSISTANT, OBSERVATION,
    BEGIN_OF_IMAGE, END_OF_IMAGE, BEGIN_OF_VIDEO, END_OF_VIDEO, IMAGE, VIDEO,
)  # fmt: skip
# Markup tokens: single ids, but kept by decode(skip_special_tokens=True) so a parser can see them (as in GLM).
MARKUP_TOKENS = (
    THINK_OPEN, THINK_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, ARG_KEY_OPEN, ARG_KEY_CLOSE,
    ARG_VALUE_OPEN, ARG_VALUE_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE, NOTHINK,
)  # fmt: skip
