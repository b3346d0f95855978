"""What a step added to one sequence, as an immutable delta the event loop can own."""

from __future__ import annotations

from dataclasses import dataclass

from pcgspec.engine.request import Request, TokenLogprobs


@dataclass(frozen=True)
class SeqDelta:
    index: int  # which of the request's n sequences
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None  # set on the last delta of the sequence only
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (known once prefilled)
    first_token: FirstTokenTimes | None = None  # on the delta with the sequence's first token


@dataclass(frozen=True)
class FirstTokenTimes:
    """Engine-side ``time.perf_counter`` stamps of one sequence's way to its first token. The
    clock is the host's monotonic clock, so the server process compares them with its own."""

    arrival: float  # at the engine (``add_request``)
    scheduled: float  # its first prefill step
    read_back: float  # its first token read back

    @property
    def queue_s(self) -> float:
        return self.scheduled - self.arrival

    @property
    def prefill_s(self) -> float:
        return self.read_back - self.scheduled


class SeqTracker:
    """How much of one sequence was already handed out. Engine thread only.

    Text is released only where no stop string can still begin (the last ``longest - 1``
    characters wait), so the streamed text is always a prefix of the final text: a stop string
    found later truncates the text at or after what was sent.
    """

    def __init__(self, req: Request) -> None:
        self.req = req
        self.done = False
        self._text = 0
        self._tokens = 0
        self._logprobs = 0
        stops = req.params.stop_strings
        self._holdback = max(map(len, stops)) - 1 if stops else 0

    def delta(self) -> SeqDelta | None:
        """What is new since the last call; None when nothing is (or the sequence is done)."""
        req = self.req
        if self.done:
            return None
        text = req.text
        end = len(text) if req.finished else max(self._text, len(text) - self._holdback)
        tokens = req.token_ids[req.prompt_len + self._tokens :]
        logprobs = req.logprobs[self._logprobs :]
        if end == self._text and not tokens and not logprobs and not req.finished:
            return None
        first = None
        if (
            tokens
            and not self._tokens
            and req.scheduled_time is not None
            and req.first_token_time is not None
        ):
            first = FirstTokenTimes(req.arrival_time, req.scheduled_time, req.first_token_time)
        delta = SeqDelta(
            req.index,
            text[self._text : end],
            tuple(tokens),
            tuple(logprobs),
            req.finish_reason if req.finished else None,
            req.num_cached_tokens,
            first,
        )
        self._text = end
        self._tokens += len(tokens)
        self._logprobs += len(logprobs)
        self.done = req.finished
        return delta
