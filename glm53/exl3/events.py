"""What one `Generator.iterate()` result says, as glm53 reads it: small typed events instead of exllamav3's dicts.

`owner` is what the job was started for (glm53's request), `job` the handle `Runtime.start` returned: a late
result of a cancelled job is told apart from the request's current job by comparing handles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Progress:
    """A chunk of the job's prompt was prefilled: `done` of `total` prompt tokens."""

    owner: Any
    job: Any
    done: int
    total: int


@dataclass(frozen=True)
class JobTimes:
    """Where a finished job's time went, by exllamav3's own clocks."""

    prompt_tokens: int
    new_tokens: int | None  # None: the result did not say
    enqueued_s: float
    prefill_s: float
    generate_s: float


@dataclass(frozen=True)
class Tokens:
    """Tokens the job released (several at once while their text ends in an incomplete character), with their logits
    (tokens, vocab) when the job returns logits. `ended`: the job's last result; `held` / `held_logits`: what the
    job still held then (exllamav3 reports the tokens before a stop token there, released nowhere else).
    `finish`: why it ended without a stop token ("stop": its grammar completed; "length": its max_new_tokens,
    capped to the cache, ran out), None otherwise. `stop_token`: the stop token that ended it. `cached_tokens`
    (prompt tokens taken from the page cache, carried across requeues) and `times` come with the last result."""

    owner: Any
    job: Any
    token_ids: list[int]
    logits: Any = None
    ended: bool = False
    held: list[int] | None = None
    held_logits: Any = None
    finish: str | None = None
    stop_token: int | None = None
    cached_tokens: int | None = None
    times: JobTimes | None = None

    def reply(self) -> tuple[list[int], Any]:
        """The reply's tokens in this result and their logits: what the job held, when it ended on a stop token."""
        if self.stop_token is None:
            return self.token_ids, self.logits
        return (self.token_ids if self.held is None else self.held,
                self.logits if self.held_logits is None else self.held_logits)


@dataclass(frozen=True)
class Failed:
    """exllamav3 contained a failure of this job alone (its prefill or page allocation raised) and dropped it."""

    owner: Any
    job: Any
    error: Any


Event = Progress | Tokens | Failed


def event_of(r: dict) -> Event | None:
    """The event one iterate() result carries, or None for a result glm53 does not read."""
    stage = r.get("stage")
    if stage == "error":
        # The result carries no "identifier", only the job.
        job = r.get("job")
        return Failed(getattr(job, "identifier", None), job, r.get("error"))
    owner, job = r.get("identifier"), r.get("job")
    if stage == "prefill":
        return Progress(owner, job, int(r.get("curr_progress", 0)), int(r.get("max_progress", 0)))
    if stage != "streaming":
        return None
    stop_token = r.get("eos_triggering_token_id") if r.get("eos_reason") == "stop_token" else None
    ended = bool(r.get("eos"))
    finish = None
    if ended and stop_token is None:
        finish = "stop" if r.get("eos_reason") == "end_filter" else "length"
    held = (r.get("held") or {}) if ended else {}
    times = None
    if ended:
        new = r.get("new_tokens")
        times = JobTimes(int(r.get("prompt_tokens") or 0), None if new is None else int(new),
                         float(r.get("time_enqueued") or 0.0), float(r.get("time_prefill") or 0.0),
                         float(r.get("time_generate") or 0.0))
    return Tokens(owner, job, _ids(r.get("token_ids")), _row(r.get("logits")), ended,
                  _ids(held["token_ids"]) if "token_ids" in held else None, _row(held.get("logits")), finish,
                  stop_token, r.get("cached_tokens") if ended else None, times)


def _ids(tokens: Any) -> list[int]:
    return tokens[0].tolist() if tokens is not None else []


def _row(logits: Any) -> Any:
    return logits[0] if logits is not None else None
