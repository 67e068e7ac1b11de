"""glm53.exl3.events: what each kind of exllamav3 1.6.5 iterate() result becomes (the engine reads only these)."""

from __future__ import annotations

import types

import torch

from glm53.exl3.events import Failed, JobTimes, Progress, Tokens, event_of


def ids(*xs: int) -> torch.Tensor:
    return torch.tensor([list(xs)], dtype=torch.long)


OWNER, JOB = object(), types.SimpleNamespace(identifier="req")


def test_prefill_progress_and_unread_stages():
    ev = event_of({"stage": "prefill", "identifier": OWNER, "job": JOB, "curr_progress": 256, "max_progress": 600})
    assert ev == Progress(OWNER, JOB, 256, 600)
    assert event_of({"stage": "something else", "identifier": OWNER, "job": JOB}) is None


def test_a_failed_job_is_owned_by_its_jobs_identifier():
    err = RuntimeError("prefill fault")
    assert event_of({"stage": "error", "job": JOB, "error": err}) == Failed("req", JOB, err)


def test_released_tokens_and_their_logits():
    logits = torch.arange(2 * 5, dtype=torch.float).view(1, 2, 5)
    ev = event_of({"stage": "streaming", "eos": False, "identifier": OWNER, "job": JOB, "token_ids": ids(3, 4),
                   "logits": logits})
    assert isinstance(ev, Tokens) and ev.token_ids == [3, 4] and not ev.ended and ev.finish is None
    assert torch.equal(ev.logits, logits[0]) and ev.times is None and ev.cached_tokens is None
    ids_, rows = ev.reply()
    assert ids_ == [3, 4] and rows is ev.logits
    held = event_of({"stage": "streaming", "eos": False, "identifier": OWNER, "job": JOB})
    assert held.token_ids == [] and held.logits is None  # its text ends in an incomplete character


def test_the_end_of_a_job_says_why_and_what_it_cost():
    end = {"stage": "streaming", "eos": True, "identifier": OWNER, "job": JOB, "prompt_tokens": 9, "new_tokens": 4,
           "time_enqueued": 0.5, "time_prefill": 0.25, "time_generate": 1.0, "cached_tokens": 6}
    ev = event_of({**end, "eos_reason": "max_new_tokens", "token_ids": ids(7)})
    assert ev.ended and ev.finish == "length" and ev.stop_token is None and ev.cached_tokens == 6
    assert ev.times == JobTimes(9, 4, 0.5, 0.25, 1.0) and ev.reply()[0] == [7]
    assert event_of({**end, "eos_reason": "end_filter", "token_ids": ids(7)}).finish == "stop"  # grammar done
    # A stop token: the tokens before it come in "held", released nowhere else; the stop token is not a reply token.
    stop = event_of({**end, "eos_reason": "stop_token", "eos_triggering_token_id": 2, "held": {"token_ids": ids(5, 6)}})
    assert stop.finish is None and stop.stop_token == 2 and stop.token_ids == [] and stop.held == [5, 6]
    assert stop.reply() == ([5, 6], None)
    bare = event_of({"stage": "streaming", "eos": True, "identifier": OWNER, "job": JOB})
    assert bare.times.new_tokens is None and bare.finish == "length"  # a count it did not give is not a zero
