"""What ``LLM.generate`` returns, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pcgspec.engine.request import Request, SpecCounters, TokenLogprobs

TokenDecoder = Callable[[int], str]


@dataclass(frozen=True)
class Logprob:
    """One token's log probability, as vLLM's ``Logprob``: ``rank`` is 1 for the most likely
    token, None for a sampled token outside the requested top-N (its rank is not computed).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # per token: sampled token, then top-N


@dataclass(frozen=True)
class RequestMetrics:
    ttft: float | None  # seconds from arrival to the first output token
    e2e_latency: float | None
    num_output_tokens: int
    tokens_per_s: float | None  # output tokens / e2e latency
    num_preemptions: int = 0
    # Speculative decoding (zero / None / empty without it)
    spec_verify_steps: int = 0
    spec_accepted_draft_tokens: int = 0
    avg_spec_accept_length: float | None = None  # accepted drafts + 1 bonus, per verify step
    spec_accepted_per_position: tuple[int, ...] = ()  # [j]: times draft j was accepted


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (vLLM's name)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        return self.outputs[0].logprobs

    @classmethod
    def from_requests(
        cls, prompt: str | None, reqs: list[Request], decode: TokenDecoder | None = None
    ) -> RequestOutput:
        """``decode`` (token id -> text) fills each ``Logprob.decoded_token``."""
        first = reqs[0]
        wants_logprobs = first.params.logprobs is not None
        outputs = [
            CompletionOutput(
                index=r.index,
                text=r.text,
                token_ids=r.output_token_ids,
                finish_reason=r.finish_reason,
                stop_reason=r.stop_reason,
                logprobs=[_as_dict(lp, decode) for lp in r.logprobs] if wants_logprobs else None,
            )
            for r in reqs
        ]
        return cls(
            first.group_id,
            prompt,
            first.prompt_token_ids,
            outputs,
            all(r.finished for r in reqs),
            _metrics(reqs),
            first.num_cached_tokens,
        )


def _as_dict(lp: TokenLogprobs, decode: TokenDecoder | None) -> dict[int, Logprob]:
    """The sampled token first, then the top-N in rank order (``lp.top`` is sorted)."""
    ranks = {t: rank for rank, (t, _) in enumerate(lp.top, start=1)}

    def entry(token: int, logprob: float) -> Logprob:
        return Logprob(logprob, ranks.get(token), decode(token) if decode else None)

    return {
        lp.token_id: entry(lp.token_id, lp.logprob),
        **{t: entry(t, v) for t, v in lp.top if t != lp.token_id},
    }


def _metrics(reqs: list[Request]) -> RequestMetrics:
    first = reqs[0]
    firsts = [r.first_token_time for r in reqs if r.first_token_time is not None]
    ends = [r.finish_time for r in reqs if r.finish_time is not None]
    ttft = min(firsts) - first.arrival_time if firsts else None
    e2e = max(ends) - first.arrival_time if len(ends) == len(reqs) else None
    num = sum(r.num_output_tokens for r in reqs)
    spec = SpecCounters()
    for r in reqs:
        spec.merge(r.spec)
    return RequestMetrics(
        ttft=ttft,
        e2e_latency=e2e,
        num_output_tokens=num,
        tokens_per_s=num / e2e if e2e else None,
        num_preemptions=sum(r.num_preemptions for r in reqs),
        spec_verify_steps=spec.verify_steps,
        spec_accepted_draft_tokens=spec.accepted_drafts,
        avg_spec_accept_length=spec.avg_accept_length,
        spec_accepted_per_position=tuple(spec.accepted_per_position),
    )
