"""`glm53 bench agent`: a scripted coding-agent session replayed over HTTP with the openai client, the way an
agent's client talks to the server, and what prefix reuse made of it.

The session: a system prompt with the agent's tools, the task, then one request per turn, each adding one
tool step's output (file reads, grep hits, test logs, diffs: glm53.bench.agent_script) until the prompt is
about --target-tokens. Per turn: prompt tokens, cached tokens (usage.prompt_tokens_details), time to the
first generated delta (streamed), decode tok/s; at the end the cached share and each turn's TTFT against the
time its new (uncached) tokens take at the cold prefill rate, measured in the same run on a cold prompt.

What goes back into the history. The model under test has random weights on the bench fixtures, so the
script, not the model, decides what each step is and what it outputs. What the model said goes back exactly
as a client sends it: its content and tool calls as the server returned them, its reasoning dropped (the
common client) or, with --keep-reasoning, sent back as reasoning_content. Replacing the reply with a scripted
call would make the history differ from the generated tokens, a miss no real client has; sending the reply
back is what tests whether the server's history re-renders token for token. After the reply comes the
step's output: as the tool result of the model's call when it made one (further calls get a short refusal),
else, when it answered in text, as a user message carrying the call and its output, which is how a client
that runs tools itself reports them (aider's shape). Either way the output text, and so the growth, is the
script's. A random model's thinking never ends; the request's max_reasoning_tokens (half the reply budget)
closes it, as the server's reasoning budget would, so every reply has reasoning and an answer as a real
turn does.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from glm53.bench.agent_script import KINDS, ORDER, TOOLS, Script, kind_of
from glm53.bench.served import BenchError, Server, Streamed, stream_chat

# The targets on the GPU machine (issue 26).
SHARE_TARGET = 0.9  # cached share of the prompt tokens from the second turn on
MEDIAN_FACTOR, MAX_FACTOR, SLACK_S = 1.5, 3.0, 0.3  # TTFT <= factor x the new tokens' cold time + slack
FALLBACK_CHARS_PER_TOKEN = 3.5  # a server without /tokenize
TURN_OVERHEAD_TOKENS = 24  # role markers and the call around each step's output (estimate; re-measured each turn)
WARM_UP_TOOL = {"type": "function", "function": {"name": "ping", "description": "Answer pong.",
                                                "parameters": {"type": "object", "properties": {}}}}
NOT_RUN = "error: not run (this agent runs one tool call per step)"


@dataclass
class AgentOptions:
    target_tokens: int = 60_000
    turns: int = 16
    reply_tokens: int = 64
    system_tokens: int | None = None  # the system message's own size (tools come on top); default target / 10
    cold_tokens: int | None = None  # the cold-rate prompt; default target / 2
    keep_reasoning: bool = False
    reasoning_tokens: int | None = None  # each request's max_reasoning_tokens; default reply / 2; 0: not sent
    seed: int = 1
    request_timeout_s: float = 900.0

    def check(self, context: int) -> None:
        if self.turns < 2:
            raise BenchError("--turns must be at least 2 (the first turn is cold; reuse starts with the second)")
        if self.reply_tokens < 4:
            raise BenchError("--reply-tokens must be at least 4")
        need = self.target_tokens + self.reply_tokens + 64
        if context and (need > context or self.cold() > context - 16):
            raise BenchError(f"the server's context is {context} tokens; --target-tokens {self.target_tokens} plus "
                             f"a reply needs {need}: lower --target-tokens or raise GLM53_CONTEXT")
        if self.system() + 200 >= self.target_tokens:
            raise BenchError(f"--target-tokens {self.target_tokens} leaves no room for the session after a "
                             f"{self.system()}-token system prompt: raise it or lower --system-tokens")

    def system(self) -> int:
        return self.system_tokens if self.system_tokens is not None else self.target_tokens // 10

    def cold(self) -> int:
        return self.cold_tokens if self.cold_tokens is not None else self.target_tokens // 2

    def thinking(self) -> dict[str, int]:
        """The request field that bounds the reply's reasoning (none: the server's own budget applies)."""
        budget = self.reply_tokens // 2 if self.reasoning_tokens is None else self.reasoning_tokens
        return {"max_reasoning_tokens": budget} if budget > 0 else {}


@dataclass
class Turn:
    turn: int
    step: str  # what the previous step's output came as: "task" (turn 1), "tool" (the model called) or "user"
    prompt_tokens: int
    cached_tokens: int | None
    ttft_s: float
    decode_tps: float
    completion_tokens: int
    finish_reason: str | None
    tool_calls: int
    prev_prompt_tokens: int | None  # the previous turn's prompt
    same_prefix: int | None  # tokens this prompt shares with the previous turn's (via /tokenize)
    content_chars: int = 0  # the reply as returned: its text, and its reasoning
    reasoning_chars: int = 0
    cold_s: float = 0.0  # the new tokens' time at the cold rate

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - (self.cached_tokens or 0)


@dataclass
class AgentResult:
    options: AgentOptions
    model_id: str
    cold_prompt_tokens: int
    cold_cached_tokens: int | None
    cold_ttft_s: float
    turns: list[Turn] = field(default_factory=list)
    stats_before: dict[str, Any] | None = None
    stats_after: dict[str, Any] | None = None
    chars_per_token: dict[str, float] = field(default_factory=dict)

    @property
    def cold_rate(self) -> float:
        """Cold prefill tokens/s: the cold prompt over its time to first token."""
        return self.cold_prompt_tokens / self.cold_ttft_s if self.cold_ttft_s > 0 else 0.0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def calibrate(server: Server, script: Script) -> dict[str, float]:
    """Characters per token of each kind of text the session sends, by the server's tokenizer."""
    samples = {kind: script.step(ORDER.index(kind), 6000).output for kind in KINDS}
    samples["system"] = Script.system_prompt(6000)
    samples["cold"] = script.cold_text(6000, salt="calibration")
    out = {}
    for kind, text in samples.items():
        tokens = server.count_tokens(text)
        out[kind] = len(text) / tokens if tokens else FALLBACK_CHARS_PER_TOKEN
    return out


def _ask(server: Server, client: Any, messages: list[dict], opts: AgentOptions, max_tokens: int = 0,
         **extra: Any) -> Streamed:
    return stream_chat(client, model=server.model_id, messages=messages, max_tokens=max_tokens or opts.reply_tokens,
                       temperature=0, extra_body=opts.thinking(), **extra)


def _reply_message(got: Streamed, keep_reasoning: bool) -> dict[str, Any]:
    """The assistant turn as a client sends it back."""
    msg: dict[str, Any] = {"role": "assistant", "content": got.content if got.content or not got.tool_calls else None}
    if got.tool_calls:
        msg["tool_calls"] = got.tool_calls
    if keep_reasoning and got.reasoning:
        msg["reasoning_content"] = got.reasoning
    return msg


def _step_messages(got: Streamed, step: Any) -> tuple[str, list[dict[str, Any]]]:
    if got.tool_calls:
        msgs = [{"role": "tool", "tool_call_id": c["id"], "content": step.output if i == 0 else NOT_RUN}
                for i, c in enumerate(got.tool_calls)]
        return "tool", msgs
    return "user", [{"role": "user", "content": step.as_text()}]


def _cold(server: Server, client: Any, script: Script, opts: AgentOptions, cpt: dict[str, float],
          log: Any) -> Streamed:
    """The cold prefill rate's request, after a warm-up: first-request costs (kernel loads, allocations, the
    grammar machinery a request with tools starts) belong to neither the cold rate nor the session. The warm-up
    has a tool of its own, so it caches none of the session."""
    _ask(server, client, [{"role": "user", "content": f"Warm-up {opts.seed}: say hello."}], opts, tools=[WARM_UP_TOOL])
    text = script.cold_text(int(opts.cold() * cpt["cold"]), salt=str(time.time_ns()))
    cold = _ask(server, client, [{"role": "user", "content": text}], opts, max_tokens=2)  # only its TTFT counts
    log(f"cold prompt: {cold.prompt_tokens} tokens, first token after {cold.ttft_s:.2f} s (cached {cold.cached_tokens})")
    if cold.cached_tokens and cold.cached_tokens > 0.05 * cold.prompt_tokens:
        log("warning: the cold prompt was partly served from the cache: the cold rate is too fast")
    return cold


def _step_tokens(opts: AgentOptions, got: Streamed, k: int) -> int:
    """The size of the step after turn k: the rest of the growth to the target, shared by weight over the steps
    left (each also brings a reply and its markup)."""
    left = range(k - 1, opts.turns - 1)
    room = opts.target_tokens - got.prompt_tokens - len(left) * (got.completion_tokens + TURN_OVERHEAD_TOKENS)
    return max(16, int(room * Script.weight(k - 1) / sum(Script.weight(i) for i in left)))


def run_agent(server: Server, opts: AgentOptions, log: Any = print) -> AgentResult:
    opts.check(server.context_length)
    script = Script(opts.seed)
    client = server.client(opts.request_timeout_s)
    cpt = calibrate(server, script)
    log("chars per token: " + ", ".join(f"{k} {v:.2f}" for k, v in cpt.items()))
    cold = _cold(server, client, script, opts, cpt, log)
    result = AgentResult(opts, server.model_id, cold.prompt_tokens, cold.cached_tokens, cold.ttft_s,
                         chars_per_token=cpt, stats_before=server.stats())
    system = Script.system_prompt(int(opts.system() * cpt["system"]))
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": script.task()}]
    prev_ids: list[int] | None = None
    shape = "task"
    for k in range(1, opts.turns + 1):
        ids = server.tokenize({"messages": messages, "tools": TOOLS, **opts.thinking()})
        got = _ask(server, client, messages, opts, tools=TOOLS)
        prev = result.turns[-1].prompt_tokens if result.turns else None
        same = common_prefix(prev_ids, ids) if prev_ids is not None and ids is not None else None
        turn = Turn(k, shape, got.prompt_tokens, got.cached_tokens, got.ttft_s, got.decode_tps, got.completion_tokens,
                    got.finish_reason, len(got.tool_calls), prev, same, len(got.content), len(got.reasoning))
        turn.cold_s = turn.new_tokens / result.cold_rate if result.cold_rate else 0.0
        result.turns.append(turn)
        log(_turn_line(turn))
        prev_ids = ids
        if k == 1 and got.prompt_tokens >= opts.target_tokens:
            log(f"warning: the first turn is {got.prompt_tokens} tokens already (the tools and system prompt), over "
                f"--target-tokens {opts.target_tokens}: each step then adds only a little")
        if k == opts.turns:
            break
        tokens = _step_tokens(opts, got, k)
        if got.prompt_tokens + got.completion_tokens + tokens + TURN_OVERHEAD_TOKENS + opts.reply_tokens > \
                server.context_length > 0:
            log(f"stopped after turn {k}: the next turn would not fit the server's {server.context_length}-token context")
            break
        step = script.step(k - 1, int(tokens * cpt[kind_of(k - 1)]))
        shape, step_msgs = _step_messages(got, step)
        messages += [_reply_message(got, opts.keep_reasoning), *step_msgs]
    result.stats_after = server.stats()
    return result


HEADER = (f"{'turn':>4} {'step':>5} {'prompt':>7} {'cached':>7} {'new':>6} {'same':>7} {'ttft s':>7} "
          f"{'cold s':>7} {'decode/s':>8} {'out':>4} {'end':>10}")


def _turn_line(t: Turn) -> str:
    cached = "-" if t.cached_tokens is None else str(t.cached_tokens)
    same = "-" if t.same_prefix is None else str(t.same_prefix)
    return (f"{t.turn:>4} {t.step:>5} {t.prompt_tokens:>7} {cached:>7} {t.new_tokens:>6} {same:>7} {t.ttft_s:>7.2f} "
            f"{t.cold_s:>7.2f} {t.decode_tps:>8.1f} {t.completion_tokens:>4} {t.finish_reason or '-':>10}")


@dataclass
class Verdict:
    name: str
    ok: bool
    text: str


def verdicts(result: AgentResult) -> list[Verdict]:
    """The issue's targets, judged on turns 2.. (the first turn is cold by construction)."""
    follow = result.turns[1:]
    out = []
    if any(t.cached_tokens is None for t in result.turns):
        out.append(Verdict("cached_share", False, "the server reports no usage.prompt_tokens_details.cached_tokens"))
    else:
        share = sum(t.cached_tokens or 0 for t in follow) / max(1, sum(t.prompt_tokens for t in follow))
        out.append(Verdict("cached_share", share >= SHARE_TARGET,
                           f"cached share from turn 2: {share:.3f} (target >= {SHARE_TARGET})"))
    if not follow or not result.cold_rate:
        return out
    ratios = sorted(follow, key=lambda t: t.ttft_s / (MEDIAN_FACTOR * t.cold_s + SLACK_S))
    mid = ratios[(len(ratios) - 1) // 2]  # the lower median: a turn that ran, not an average of two
    limit = MEDIAN_FACTOR * mid.cold_s + SLACK_S
    out.append(Verdict("median_ttft", mid.ttft_s <= limit,
                       f"median turn (turn {mid.turn}): TTFT {mid.ttft_s:.2f} s against {MEDIAN_FACTOR}x its "
                       f"{mid.new_tokens} new tokens' cold {mid.cold_s:.2f} s + {SLACK_S} = {limit:.2f} s"))
    worst = max(follow, key=lambda t: t.ttft_s / (MAX_FACTOR * t.cold_s + SLACK_S))
    limit = MAX_FACTOR * worst.cold_s + SLACK_S
    out.append(Verdict("max_ttft", worst.ttft_s <= limit,
                       f"worst turn (turn {worst.turn}): TTFT {worst.ttft_s:.2f} s against {MAX_FACTOR}x its "
                       f"{worst.new_tokens} new tokens' cold {worst.cold_s:.2f} s + {SLACK_S} = {limit:.2f} s"))
    return out


def findings(result: AgentResult) -> list[str]:
    """What the numbers say about where reuse was lost (printed as notes; none is a target)."""
    out = []
    follow = result.turns[1:]
    for t in follow:
        if t.same_prefix is not None and t.prev_prompt_tokens is not None and t.same_prefix < t.prev_prompt_tokens:
            out.append(f"turn {t.turn}: the history differs from the previous prompt from token {t.same_prefix} of "
                       f"{t.prev_prompt_tokens}: an earlier turn rendered differently this time, so nothing after "
                       f"it can be reused")
    hits = [t for t in follow if t.cached_tokens and t.prev_prompt_tokens]
    if hits:
        lost = statistics.median(max(0, (t.prev_prompt_tokens or 0) - (t.cached_tokens or 0)) for t in hits)
        out.append(f"follow-ups prefilled a median {lost:.0f} tokens of the previous prompt again (what pages and "
                   f"recurrent checkpoints did not keep), besides the reply and the new step")
    if follow and result.cold_rate:
        implied = sum(max(0.0, t.prompt_tokens - t.ttft_s * result.cold_rate) for t in follow)
        reported = sum(t.cached_tokens or 0 for t in follow)
        total = sum(t.prompt_tokens for t in follow)
        if implied > reported + 0.2 * total:
            out.append(f"the TTFTs imply at least {implied / total:.0%} of the follow-ups' prompt tokens came from the "
                       f"cache, usage reports {reported / total:.0%}: cached_tokens undercounts")
    return out


def summary(result: AgentResult) -> dict[str, Any]:
    turns = result.turns
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens or 0 for t in turns)
    follow = turns[1:]
    return {"turns": len(turns), "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_share": cached / prompt if prompt else 0.0,
            "cached_share_from_turn_2": (sum(t.cached_tokens or 0 for t in follow)
                                         / max(1, sum(t.prompt_tokens for t in follow))),
            "cold_prefill_tok_s": result.cold_rate,
            "median_decode_tok_s": statistics.median(t.decode_tps for t in turns) if turns else 0.0,
            "final_prompt_tokens": turns[-1].prompt_tokens if turns else 0}


def render(result: AgentResult) -> str:
    s = summary(result)
    o = result.options
    lines = [f"bench agent: {result.model_id}, {s['turns']} turns to {o.target_tokens} tokens, reasoning "
             f"{'kept' if o.keep_reasoning else 'dropped'} by the client, {o.reply_tokens}-token replies, seed {o.seed}",
             f"cold prefill: {result.cold_prompt_tokens} tokens in {result.cold_ttft_s:.2f} s = "
             f"{result.cold_rate:.0f} tok/s", HEADER]
    lines += [_turn_line(t) for t in result.turns]
    lines.append(f"cached share of all prompt tokens: {s['cached_share']:.3f} ({s['cached_tokens']} of "
                 f"{s['prompt_tokens']}); from turn 2: {s['cached_share_from_turn_2']:.3f}")
    lines.append(f"median decode: {s['median_decode_tok_s']:.1f} tok/s; final prompt {s['final_prompt_tokens']} tokens")
    lines += [f"note: {x}" for x in findings(result)]
    for v in verdicts(result):
        lines.append(f"target {v.name}: {'PASS' if v.ok else 'FAIL'}: {v.text}")
    return "\n".join(lines)


def to_json(result: AgentResult) -> dict[str, Any]:
    turns = []
    for t in result.turns:
        d = asdict(t)
        d["new_tokens"] = t.new_tokens
        turns.append(d)
    return {"bench": "agent", "model": result.model_id, "options": asdict(result.options),
            "cold": {"prompt_tokens": result.cold_prompt_tokens, "cached_tokens": result.cold_cached_tokens,
                     "ttft_s": result.cold_ttft_s, "tok_s": result.cold_rate},
            "chars_per_token": result.chars_per_token, "turns": turns, "summary": summary(result),
            "targets": {v.name: {"ok": v.ok, "text": v.text} for v in verdicts(result)}, "notes": findings(result),
            "server_stats": {"before": result.stats_before, "after": result.stats_after}}


def write_json(path: str, doc: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
        f.write("\n")
