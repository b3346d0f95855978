"""What a step added to one sequence, as an immutable delta the event loop can own.

The engine loop builds one delta per stream and step, on the engine's critical path, as a plain
tuple of ``SeqDelta``'s fields in order (its wire form): a tuple is built several times faster
than a dataclass, and a named tuple pickles by its class (a step's message of 16 streams took
24-28 us to build and pickle that way against 17 us as plain tuples, 2-core x86-64 host). The
server process rebuilds the named tuples (``from_wire_form``).
"""

from __future__ import annotations

from typing import NamedTuple

from pcgspec.engine.request import Request, RequestStatus, TokenLogprobs


class FirstTokenTimes(NamedTuple):
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


class SeqDelta(NamedTuple):
    index: int  # which of the request's n sequences
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None  # set on the last delta of the sequence only
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (known once prefilled)
    first_token: FirstTokenTimes | None = None  # on the delta with the sequence's first token


# A delta's wire form: ``SeqDelta``'s fields in order (the round-trip test holds them together).
WireDelta = tuple[
    int, str, tuple[int, ...], tuple[TokenLogprobs, ...], str | None, int, FirstTokenTimes | None
]
TOKEN_IDS = SeqDelta._fields.index("token_ids")  # indices of fields in a wire form
FIRST_TOKEN = SeqDelta._fields.index("first_token")


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
        self._prompt_len = req.prompt_len
        self._next_token = self._prompt_len  # index in ``req.token_ids`` of the first unsent
        self._logprobs = 0
        stops = req.params.stop_strings
        self._holdback = max(map(len, stops)) - 1 if stops else 0

    def delta(self) -> WireDelta | None:
        """What is new since the last call, in wire form (``SeqDelta``'s fields); None when
        nothing is (or the sequence is done)."""
        if self.done:
            return None
        req = self.req
        finished = req.status is RequestStatus.FINISHED
        text = req.detokenizer.text
        end = len(text) if finished else max(self._text, len(text) - self._holdback)
        start = self._next_token
        tokens = tuple(req.token_ids[start:])
        logprobs = tuple(req.logprobs[self._logprobs :]) if req.logprobs else ()
        if end == self._text and not tokens and not logprobs and not finished:
            return None
        first = None
        if tokens and start == self._prompt_len and req.scheduled_time is not None:
            first_time = req.first_token_time
            if first_time is not None:
                first = FirstTokenTimes(req.arrival_time, req.scheduled_time, first_time)
        delta = (
            req.index,
            text[self._text : end],
            tokens,
            logprobs,
            req.finish_reason if finished else None,
            req.num_cached_tokens,
            first,
        )
        self._text = end
        self._next_token = start + len(tokens)
        self._logprobs += len(logprobs)
        self.done = finished
        return delta


def from_wire_form(deltas: list[WireDelta]) -> list[SeqDelta]:
    """The deltas ``SeqTracker.delta`` built."""
    return [SeqDelta._make(d) for d in deltas]
