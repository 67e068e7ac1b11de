"""Grammar-constrained decoding with llguidance (the library exllamav3 itself uses), for the CPU engine.

llguidance is optional here: exllamav3 depends on it, so the GPU image always has it; a CPU-only install
without it reports supports_grammar = False and the server refuses response_format cleanly.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from typing import Any

import torch


def available() -> bool:
    # find_spec, not import: llguidance.torch pulls in torch._dynamo (~0.4 s) that only grammar requests need.
    return importlib.util.find_spec("llguidance") is not None


def _llguidance(module: str = "llguidance") -> Any:
    # llguidance.torch decorates with torch.jit.script_method, deprecated in torch 2.13: not ours to fix.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module(module)


def make_tokenizer(hf_tokenizer: Any, n_vocab: int, eos_ids: list[int]) -> Any:
    """The llguidance view of the vocabulary; any of eos_ids may end a finished grammar."""
    return _llguidance("llguidance.hf").from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=list(eos_ids) or None)


class GrammarConstraint:
    """One request's matcher: masks logits to the tokens the grammar allows next, follows sampled tokens."""

    def __init__(self, ll_tokenizer: Any, grammar: str) -> None:
        llguidance = _llguidance()
        lt = _llguidance("llguidance.torch")
        error = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer)
        if error:
            raise ValueError(f"invalid grammar: {error}")
        self._lt = lt
        self._matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        if self._matcher.is_error():
            raise ValueError(f"invalid grammar: {self._matcher.get_error()}")
        self._mask = lt.allocate_token_bitmask(1, ll_tokenizer.vocab_size)

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of 1-D `logits` with disallowed tokens at -inf (the original stays for logprobs)."""
        self._lt.fill_next_token_bitmask(self._matcher, self._mask, 0)
        if self._matcher.is_error():
            raise RuntimeError(f"grammar matcher failed: {self._matcher.get_error()}")
        out = logits.float().clone()
        self._lt.apply_token_bitmask_inplace(out, self._mask[0])
        return out

    def advance(self, token: int) -> bool:
        """Consume a sampled token; True once the grammar is complete and allows nothing more."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"grammar rejected token {token}: {self._matcher.get_error()}")
        return self._matcher.is_stopped()
