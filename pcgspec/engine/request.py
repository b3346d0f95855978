"""One sequence being generated: its tokens, KV pages, progress and stop state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pcgspec.engine.detokenizer import IncrementalDetokenizer
from pcgspec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pcgspec.engine.radix_cache import PrefixHit


class RequestStatus(enum.Enum):
    WAITING = enum.auto()  # not (fully) prefilled: queued, mid chunked prefill, or preempted
    RUNNING = enum.auto()  # decoding
    FINISHED = enum.auto()


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs of one output token: the sampled one first, then the top-N alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class SpecCounters:
    """Speculative decoding counters of one request (or, summed, of an engine)."""

    verify_steps: int = 0
    accepted_drafts: int = 0  # draft tokens the target accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: draft j accepted

    def record(self, accept_len: int, num_steps: int) -> None:
        if len(self.accepted_per_position) < num_steps:
            self.accepted_per_position += [0] * (num_steps - len(self.accepted_per_position))
        self.verify_steps += 1
        self.accepted_drafts += accept_len
        for j in range(accept_len):
            self.accepted_per_position[j] += 1

    def merge(self, other: SpecCounters) -> None:
        self.verify_steps += other.verify_steps
        self.accepted_drafts += other.accepted_drafts
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = self.accepted_per_position + [0] * (width - len(self.accepted_per_position))
        for j, n in enumerate(other.accepted_per_position):
            mine[j] += n
        self.accepted_per_position = mine

    @property
    def avg_accept_length(self) -> float | None:
        """Accepted drafts + 1 bonus token per verify step, averaged (SGLang's
        ``avg_spec_accept_length``); None before the first verify step."""
        if not self.verify_steps:
            return None
        return (self.accepted_drafts + self.verify_steps) / self.verify_steps


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    detokenizer: IncrementalDetokenizer
    max_len: int  # the model's context length
    group_id: str = ""  # the user-facing request this sequence belongs to (n > 1)
    index: int = 0  # which of the group's n sequences
    arrival_time: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(init=False)
    pages: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (or launched steps write)
    num_pending_tokens: int = 0  # sampled by a launched step, not yet read back (overlap)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    prefix_hit: PrefixHit | None = None  # the cached prefix its pages start with, while held
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None  # why a step failed on this request (finish_reason "error")
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    scheduled_time: float | None = None  # its first prefill step was scheduled
    first_token_time: float | None = None  # its first output token was read back
    finish_time: float | None = None
    num_preemptions: int = 0
    spec: SpecCounters = field(default_factory=SpecCounters)
    # a model drafter's progress on this request (``ModelProposer``'s ``DraftState``), kept
    # here so that the drafter's bookkeeping of every plain step is an attribute access
    draft_state: Any = field(default=None, repr=False)
    # the speculation policy's estimates of this request (its accept length, how often it had
    # drafts), kept here for the same reason (``SpecPolicy``)
    spec_estimates: dict[int, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, the pending ones (still on the device) included."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def length_reached(self) -> bool:
        """Whether its tokens, pending ones included, reach max_tokens or the context length:
        the pending tokens will finish it, so it needs no further step.
        """
        max_tokens = self.params.max_tokens
        if max_tokens is not None and self.num_tokens - self.prompt_len >= max_tokens:
            return True
        return self.num_tokens >= self.max_len

    @property
    def text(self) -> str:
        return self.detokenizer.text

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, eos_token_ids: frozenset[int]) -> None:
        """Add one output token, extend the text and check every stop condition."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.token_ids.append(token_id)
        params = self.params
        if not params.ignore_eos and token_id in eos_token_ids:
            self.finish("stop", token_id)
        elif params.stop_token_ids and token_id in params.stop_token_ids:
            self.finish("stop", token_id)
        else:
            delta = self.detokenizer.add_token(token_id)
            if delta and params.stop_strings:
                self._check_stop_strings(len(delta))
        if self.finished:
            return
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            self.finish("length")
        elif len(self.token_ids) >= self.max_len:
            self.finish("length")

    def _check_stop_strings(self, delta_len: int) -> None:
        text = self.detokenizer.text
        longest = max(len(s) for s in self.params.stop_strings)
        start = max(0, len(text) - delta_len - longest + 1)
        hits = [(text.find(s, start), s) for s in self.params.stop_strings]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return
        index, stop = min(hits)
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        self.detokenizer.text = text[:end]
        self.finish("stop", stop)

    def fail(self, error: str) -> None:
        """Finish with "error": a step failed on this request's data."""
        self.error = error
        self.finish("error")

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.perf_counter()
