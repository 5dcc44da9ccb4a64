"""Generators of session-shaped traces: multi-turn chat, a coding agent, deep research.

Each writes sessions (docs/traces.md, 'Sessions'): a session's first turn arrives at its start
(sessions start as a Poisson process); every later call follows the one before it after a think
time or a tool time (closed loop), and its prompt is that call's whole history (its prompt and
its output less the thinking, `reasoning_len`) plus new tokens: the user's next message, a tool's
output, a fetched document. A session that would outgrow `context_limit` is compacted: the next
call keeps only the shared system prefix and reads a summary instead of the history. Every first
turn begins with one system prompt shared by all sessions (a prefix group). Sessions are written
whole and in order of start, as a streamed replay wants them.

The parameters' defaults come from published statistics where there are any and from stated
assumptions elsewhere (docs/traces.md, 'Session shapes', names which is which). Counts (turns,
calls) are geometric with the given mean, token counts and times lognormal with the given mean.
Every draw is a pure function of (seed, kind, session), so a session does not depend on how many
are generated around it. `scale` multiplies every token count (prompt parts, outputs, the context
limit): 0.125 turns the coding agent's 68k-token prompts into ~8.5k-token ones of the same shape
(the same growth per call relative to the prompt, the same cached share).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from zipage.errors import ConfigError
from zipage.trace import ARRIVAL_DECIMALS, Trace, TraceRequest, session_history, stable_hash

TIME_DECIMALS = 3  # think and tool times, in seconds: to the millisecond


@dataclass(frozen=True)
class SessionOption:
    """A parameter of the session generators, and its `zipage trace make` flag."""

    name: str
    kind: type  # int or float
    minimum: float
    maximum: float
    strict: bool  # the minimum itself is refused
    meaning: str
    example: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def bounds(self) -> str:
        low = f"> {_number(self.minimum)}" if self.strict else f">= {_number(self.minimum)}"
        return f"{low} and <= {_number(self.maximum)}"

    def error(self, value: Any) -> ConfigError:
        what = "an integer" if self.kind is int else "a number"
        return ConfigError(f"{self.flag} must be {what} {self.bounds()} ({self.meaning}), got "
                           f"{value!r}; e.g. {self.flag} {self.example}")

    def check(self, value: Any) -> int | float:
        """`value` if it is valid, else one ConfigError line naming the flag and the fix."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                self.kind is int and not isinstance(value, int)):
            raise self.error(value)
        if not math.isfinite(value) or not (
                (value > self.minimum if self.strict else value >= self.minimum)
                and value <= self.maximum):
            raise self.error(value)
        return value

    def parse(self, text: str) -> int | float:
        """A flag's text as this option's value (checked)."""
        try:
            value = int(text) if self.kind is int else float(text)
        except ValueError:
            raise self.error(text) from None
        return self.check(value)


# Every parameter a session generator takes besides the seed; the flags of `zipage trace make`.
SESSION_OPTIONS: dict[str, SessionOption] = {option.name: option for option in (
    SessionOption("sessions", int, 1, 10_000_000, False, "how many sessions", "64"),
    SessionOption("session_rate", float, 0, 1e6, True, "new sessions per second, Poisson",
                  "0.5"),
    SessionOption("turns", float, 1, 1000, False, "mean user turns per session", "3"),
    SessionOption("calls", float, 1, 1000, False, "mean LLM calls per user turn", "8"),
    SessionOption("think_time", float, 0, 86_400, False,
                  "mean seconds a user takes before the next turn", "20"),
    SessionOption("tool_time", float, 0, 86_400, False,
                  "mean seconds a tool call takes before the next LLM call", "5"),
    SessionOption("system_prompt_len", int, 0, 10_000_000, False,
                  "tokens of the system prompt every session shares, before --scale", "2000"),
    SessionOption("context_limit", int, 1, 100_000_000, False,
                  "a session's history is compacted before a prompt would pass this many tokens, "
                  "before --scale", "128000"),
    SessionOption("thinking", float, 0, 1_000_000, False,
                  "mean thinking tokens a reasoning model writes before each answer, dropped "
                  "from the next turn's history (0: none), before --scale", "1135"),
    SessionOption("scale", float, 0, 100, True,
                  "multiplies every token count: prompt parts, outputs, the context limit", "0.125"),
)}


# ------------------------------------------------------------------ published statistics
# Multi-turn chat. LMSYS-Chat-1M (Zheng et al., ICLR 2024; its dataset card's basic statistics):
# 1M conversations, 2.0 turns per conversation, 69.5 tokens per user prompt, 214.5 tokens per
# response. (Chatbot Arena Conversations, same card format: 1.2 turns, 52.3 and 189.5 tokens;
# ShareChat, arXiv 2512.17843: 142,808 conversations with over 660,000 turns, ~4.6 a
# conversation: `--turns 4.6`.)
CHAT_TURNS = 2.0
CHAT_USER_TOKENS = 69.5
CHAT_OUTPUT_TOKENS = 214.5
# A reasoning model's chat: ServeGen's DeepSeek-R1 pool (alibaba/ServeGen, arXiv 2505.09999),
# its day composed by `zipage trace import servegen` (docs/traces.md): 1,135 thinking tokens a
# request on average, median 478, so a lognormal of spread sqrt(2 ln(1135 / 478)) = 1.3.
REASONING_THINKING_TOKENS = 1135.0
THINKING_SIGMA = 1.3

# Coding agent. GitHub Copilot coding-agent traces, June 1-7 2026 (Azure/AzurePublicDataset,
# GitHubCopilotCodingAgentDataset2026.md and its dataset card; Liu et al., arXiv 2608.00101):
# 301,026 sessions, 1,189,581 user turns (3.95 a session), 9,310,255 LLM calls (7.83 a turn,
# 30.9 a session), 631.4B prompt tokens (67.8k a call), 540.95B of them cached (85.7 %),
# 4.91B completion tokens (528 a call), 8,681,190 tool calls (0.93 a call).
AGENT_TURNS = 3.95
AGENT_CALLS_PER_TURN = 7.83
AGENT_OUTPUT_TOKENS = 528.0
AGENT_MEAN_PROMPT = 67_800  # what the assumptions below are calibrated to (docs/traces.md)

# Deep research. Kimi-Researcher (Moonshot AI, 2025): "an average of 23 reasoning steps and
# explores over 200 URLs per task".
RESEARCH_STEPS_PER_TURN = 23.0


@dataclass(frozen=True)
class _Lengths:
    """One shape's token means (before `scale`) and lognormal spreads."""

    system: int  # the shared system prompt (and tool specs)
    first: float  # the first user message (with its attached context)
    user: float  # a later user message
    output: float  # a call's output, thinking included
    thinking: float = 0.0  # the share of a call's output that is thinking (reasoning_len)
    reasoning: float = 0.0  # mean thinking tokens written before each output (reasoning_len)
    tool: float = 0.0  # a tool's output appended before the next call
    report: float = 0.0  # the visible answer the last call of a turn adds to its output
    summary: float = 0.0  # what a compaction leaves of the history
    sigma: float = 0.8  # lognormal spread of every length


CHAT = _Lengths(system=256, first=CHAT_USER_TOKENS, user=CHAT_USER_TOKENS,
                output=CHAT_OUTPUT_TOKENS, sigma=0.9)
# Assumptions (none is in the release): a 12k-token system prompt with tool specs, a 3k-token
# task with its workspace context, 300-token later messages, a 200k-token context window and
# 4k-token summaries at compaction; tool outputs of 1.9k tokens then make the mean prompt the
# published 67.8k (docs/traces.md).
AGENT = _Lengths(system=12_000, first=3000, user=300, output=AGENT_OUTPUT_TOKENS, tool=1900,
                 summary=4000, sigma=0.9)
# Assumptions: a step's output is 1.5k tokens, 90 % of it thinking (the rest calls a tool); a
# fetched document or a page of search results is 2.5k tokens; a turn's last step adds a
# 2.5k-token report.
RESEARCH = _Lengths(system=2000, first=150, user=100, output=1500, thinking=0.9, tool=2500,
                    report=2500, summary=4000, sigma=0.7)


# ------------------------------------------------------------------ generators

def chat_sessions(seed: int = 0, *, sessions: int = 64, session_rate: float = 0.5,
                  turns: float = CHAT_TURNS, think_time: float = 20.0,
                  system_prompt_len: int = CHAT.system, thinking: float = 0.0,
                  scale: float = 1.0) -> Trace:
    """Multi-turn chat: a user message (mean 69.5 tokens), an answer (mean 214.5), the next
    message after a think time; 2.0 turns a conversation on average (LMSYS-Chat-1M). With
    `thinking`, a reasoning model's chat: each answer follows that many thinking tokens on
    average (ServeGen's DeepSeek-R1: 1,135), which the next turn's history drops."""
    checked = _checked(sessions=sessions, session_rate=session_rate, turns=turns,
                       think_time=think_time, system_prompt_len=system_prompt_len,
                       thinking=thinking, scale=scale)
    lengths = replace(CHAT, reasoning=checked.pop("thinking"))
    return _trace("chat-sessions", lengths, seed, **checked)


def agent_sessions(seed: int = 0, *, sessions: int = 16, session_rate: float = 0.05,
                   turns: float = AGENT_TURNS, calls: float = AGENT_CALLS_PER_TURN,
                   think_time: float = 60.0, tool_time: float = 5.0,
                   system_prompt_len: int = AGENT.system, context_limit: int = 200_000,
                   scale: float = 1.0) -> Trace:
    """A coding agent (GitHub Copilot's, June 2026): 3.95 user turns a session, 7.83 LLM calls
    a turn, each call sent after the previous one's tool ran and reading its output; ~68k-token
    prompts, ~530-token outputs."""
    return _trace("agent-sessions", AGENT, seed, **_checked(
        sessions=sessions, session_rate=session_rate, turns=turns, calls=calls,
        think_time=think_time, tool_time=tool_time, system_prompt_len=system_prompt_len,
        context_limit=context_limit, scale=scale))


def research_sessions(seed: int = 0, *, sessions: int = 8, session_rate: float = 0.02,
                      turns: float = 1.5, calls: float = RESEARCH_STEPS_PER_TURN,
                      think_time: float = 60.0, tool_time: float = 3.0,
                      system_prompt_len: int = RESEARCH.system, context_limit: int = 128_000,
                      scale: float = 1.0) -> Trace:
    """Deep research: a question, then ~23 steps (Kimi-Researcher's average), each a long
    reasoning output (90 % thinking) that calls a search or fetch tool whose document the next
    step reads, ending in a report; now and then a follow-up question."""
    return _trace("research-sessions", RESEARCH, seed, **_checked(
        sessions=sessions, session_rate=session_rate, turns=turns, calls=calls,
        think_time=think_time, tool_time=tool_time, system_prompt_len=system_prompt_len,
        context_limit=context_limit, scale=scale))


SESSION_WORKLOADS: dict[str, Callable[..., Trace]] = {
    "chat-sessions": chat_sessions,
    "agent-sessions": agent_sessions,
    "research-sessions": research_sessions,
}


# ------------------------------------------------------------------ statistics

@dataclass(frozen=True)
class SessionStatistics:
    """What a session trace looks like (docs/traces.md, 'Session shapes')."""

    sessions: int
    turns_per_session: float  # user turns (ids ...-tN...)
    calls_per_session: float  # requests
    mean_prompt: float
    mean_output: float
    history_share: float  # prompt tokens that are the predecessor's history
    shared_share: float  # ... or the shared system prompt a session starts with
    compactions: int  # follow-ups that keep less than their predecessor's history

    def row(self, name: str) -> str:
        return (f"| {name} | {self.sessions} | {self.turns_per_session:.2f} | "
                f"{self.calls_per_session:.1f} | {self.mean_prompt:,.0f} | "
                f"{self.mean_output:,.0f} | {100 * self.history_share:.1f} % | "
                f"{100 * self.shared_share:.1f} % | {self.compactions} |")


_TURN = re.compile(r"-t(\d+)(?:-|$)")


def session_statistics(trace: Trace) -> SessionStatistics:
    """Sessions, turns and calls per session, mean prompt and output, and the share of prompt
    tokens a perfect prefix cache serves: the predecessor's history (follow-ups), and that plus
    the shared system prompt of first turns after the first of its group."""
    requests = trace.requests
    by_id = {request.id: request for request in requests}
    sessions = {request.session for request in requests if request.session is not None}
    turns = {(request.session, match.group(1)) for request in requests
             if (match := _TURN.search(request.id)) is not None}
    prompt = sum(request.prompt_len for request in requests)
    history = sum(request.prefix_len for request in requests if request.after is not None)
    seen_groups: set[str] = set()
    shared = 0
    for request in requests:
        if request.prefix_group is not None:
            if request.prefix_group in seen_groups:
                shared += request.prefix_len
            seen_groups.add(request.prefix_group)
    compactions = sum(1 for request in requests if request.after is not None
                      and request.prefix_len < session_history(by_id[request.after]))
    count = max(len(sessions), 1)
    return SessionStatistics(
        sessions=len(sessions), turns_per_session=len(turns) / count,
        calls_per_session=len(requests) / count, mean_prompt=prompt / len(requests),
        mean_output=sum(request.output_len for request in requests) / len(requests),
        history_share=history / prompt, shared_share=(history + shared) / prompt,
        compactions=compactions)


# ------------------------------------------------------------------ the shared machinery

@dataclass(frozen=True)
class _Shape:
    kind: str
    lengths: _Lengths
    sessions: int
    session_rate: float
    turns: float
    calls: float
    think_time: float
    tool_time: float
    context_limit: int | None

    def trace(self, seed: int) -> Trace:
        gaps = _generator(seed, self.kind, "arrivals").exponential(
            1.0 / self.session_rate, size=self.sessions)
        gaps[0] = 0.0
        starts = np.cumsum(gaps)
        requests: list[TraceRequest] = []
        for index, start in enumerate(starts):
            requests += self._session(seed, index, round(float(start), ARRIVAL_DECIMALS))
        return Trace(name=self.kind, requests=requests)

    def _session(self, seed: int, index: int, start: float) -> list[TraceRequest]:
        # Draw order is part of the format: turns, then per turn its calls, then per call its
        # new tokens, its output (and thinking) and the time before it.
        generator = _generator(seed, self.kind, "session", index)
        lengths, name = self.lengths, f"{self.kind}-{index}"
        group = f"{self.kind}-system" if lengths.system else None
        requests: list[TraceRequest] = []
        previous: TraceRequest | None = None
        for turn in range(_count(generator, self.turns)):
            num_calls = _count(generator, self.calls)
            for call in range(num_calls):
                last = call == num_calls - 1
                if call == 0:
                    new = _length(generator, lengths.first if turn == 0 else lengths.user,
                                  lengths.sigma)
                    wait = _time(generator, self.think_time)
                else:
                    new = _length(generator, lengths.tool, lengths.sigma)
                    wait = _time(generator, self.tool_time)
                output = _length(generator, lengths.output, lengths.sigma)
                thinking = min(output - 1, round(output * lengths.thinking))
                if lengths.reasoning:  # drawn only then: thinking-free traces stay as they were
                    extra = _length(generator, lengths.reasoning, THINKING_SIGMA)
                    output, thinking = output + extra, thinking + extra
                if last and lengths.report:
                    output += _length(generator, lengths.report, lengths.sigma)
                request_id = f"{name}-t{turn}" if self.calls == 1 else f"{name}-t{turn}-c{call}"
                if previous is None:
                    previous = TraceRequest(
                        id=request_id, arrival_s=start, prompt_len=lengths.system + new,
                        output_len=output, prefix_group=group,
                        prefix_len=lengths.system if group else 0, session=name,
                        reasoning_len=thinking)
                else:
                    kept = session_history(previous)
                    if (self.context_limit is not None and kept + new > self.context_limit
                            and kept > lengths.system):
                        # Compaction: the system prompt stays, a summary replaces the rest.
                        kept = lengths.system
                        new += _length(generator, lengths.summary, lengths.sigma)
                    previous = TraceRequest(
                        id=request_id, arrival_s=start, prompt_len=kept + new,
                        output_len=output, prefix_len=kept, session=name, after=previous.id,
                        after_s=wait, reasoning_len=thinking)
                requests.append(previous)
        return requests


def _trace(kind: str, lengths: _Lengths, seed: int, *, scale: float, system_prompt_len: int,
           context_limit: int | None = None, calls: float = 1.0, tool_time: float = 0.0,
           **counts: Any) -> Trace:
    """The trace of a shape whose token counts are `lengths` before `scale`."""
    limit = None if context_limit is None else _tokens(context_limit, scale)
    return _Shape(kind, _scaled(lengths, scale, system_prompt_len), calls=calls,
                  tool_time=tool_time, context_limit=limit, **counts).trace(seed)


def _number(value: float) -> str:
    return f"{int(value):,}" if value == int(value) else f"{value:g}"


def _checked(**values: Any) -> dict[str, Any]:
    return {name: SESSION_OPTIONS[name].check(value) for name, value in values.items()}


def _scaled(lengths: _Lengths, scale: float, system_prompt_len: int) -> _Lengths:
    return _Lengths(
        system=_tokens(system_prompt_len, scale, minimum=0), first=lengths.first * scale,
        user=lengths.user * scale, output=lengths.output * scale, thinking=lengths.thinking,
        reasoning=lengths.reasoning * scale,
        tool=lengths.tool * scale, report=lengths.report * scale,
        summary=lengths.summary * scale, sigma=lengths.sigma)


def _tokens(count: int, scale: float, minimum: int = 1) -> int:
    return max(minimum, round(count * scale))


def _generator(seed: int, *keys: str | int) -> np.random.Generator:
    entropy = [seed] + [key if isinstance(key, int) else stable_hash(key) for key in keys]
    return np.random.default_rng(entropy)


def _count(generator: np.random.Generator, mean: float) -> int:
    """A count >= 1, geometric with mean `mean` (1 exactly when the mean is 1)."""
    return int(generator.geometric(1.0 / mean))


def _length(generator: np.random.Generator, mean: float, sigma: float) -> int:
    """A token count >= 1, lognormal with mean `mean`, clipped at 20 times the mean."""
    value = mean * math.exp(sigma * generator.standard_normal() - sigma * sigma / 2)
    return max(1, round(min(value, 20 * mean)))


def _time(generator: np.random.Generator, mean: float) -> float:
    """Seconds, lognormal with mean `mean` (spread 1.0), clipped at 20 times the mean."""
    value = mean * math.exp(generator.standard_normal() - 0.5)
    return round(min(value, 20 * mean), TIME_DECIMALS)
