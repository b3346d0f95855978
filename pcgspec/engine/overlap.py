"""The overlap schedule: the host schedules and launches step N+1 while the device runs step N.

Step N+1's decode inputs are step N's sampled tokens: the host builds the batch with
``PENDING_TOKEN`` in their place and the device puts in each request's last token, which step N's
sampler left in the sampling slots (``resolve_pending``). Sequence lengths and pages depend on
token counts only, which the host knows (``Request.num_pending_tokens``). A launched step starts
copying its tokens (and logprobs) into pinned host memory behind an event (``LaunchedStep``);
the host reads them one step late, after launching the next step, for stop checks,
detokenizing and streaming. So a request that finished at step N took part in step N+1 at most
(that result is dropped), and one whose pending token reaches max_tokens or the context length
is not scheduled again. Its pages are freed once its last token is read: a step still running
on them was launched before any step that reuses them, and the device runs steps in launch
order.

A speculative step is launched and read the same way (``LaunchedSpecStep`` in
speculative/worker.py): its verify batch is built from the lengths and last tokens the sampling
slots hold on the device, and until it is read each of its requests counts k+1 pending tokens,
the most it can emit. A plain step launched over it (a decode or mixed step) builds its decode
rows at those worst-case lengths on the host and takes the real positions, KV slots and lengths
from the slots on the device (``Engine._decode_rows_from_device``), so a switch between kinds
never waits for the host; a model drafter hears of that pass once the speculative step is read
(``SpecWorker.observe``).

A step whose sampled rows are first tokens for at least half (``FIRST_TOKEN_SHARE``: a wave of
new requests, or new requests beside as many running ones or fewer) is read before anything else
is launched, so those tokens wait for no other step's host work (``Engine._first_tokens_in_flight``;
SGLang offers it between two prefill steps, ``SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP``). The
early read costs the running requests the overlap of one step (the device idles while the next
step is built), so a few requests joining many are read one step late, like decode rows.

Synchronous stepping is the same path with the read right after the launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pcgspec.engine.request import Request, TokenLogprobs
from pcgspec.sampling.sampler import SampleLogprobs, SamplerOutput

PENDING_TOKEN = -1  # a decode input that a running step samples
# The least share of a step's sampled rows, first tokens, read early. At 16 streams served
# one at a time a step admitting a few arrivals (a fifth of its rows) is common: reading each
# early idled the device for about 0.6 ms of host work every few dozen steps.
FIRST_TOKEN_SHARE = 0.5


def resolve_pending(input_ids: torch.Tensor, last_tokens: torch.Tensor) -> torch.Tensor:
    """A decode batch's ``input_ids`` [B] with each ``PENDING_TOKEN`` replaced by the
    request's ``last_tokens`` [B] (device tensors: no host sync).
    """
    return torch.where(input_ids == PENDING_TOKEN, last_tokens, input_ids)


@dataclass(frozen=True)
class LaunchedStep:
    """The sampled requests of a launched step (one per row) and their tokens on their way to
    the host.
    """

    requests: list[Request]
    tokens: torch.Tensor  # [R] int64 on the host (pinned on CUDA), valid once ``ready`` passed
    logprobs: SampleLogprobs | None  # host copies, like ``tokens``
    ready: torch.cuda.Event | None  # None off CUDA, where the copies are done
    first_tokens: bool = False  # read before the next launch (``FIRST_TOKEN_SHARE``)

    @classmethod
    def start(
        cls, requests: Sequence[Request], sampled: SamplerOutput, num_first_tokens: int = 0
    ) -> LaunchedStep:
        """Start copying ``sampled`` to the host; the requests' tokens are pending until read.
        ``num_first_tokens``: how many of the rows are prefilling rows (mostly first tokens).
        """
        lp = sampled.logprobs
        logprobs = (
            None
            if lp is None
            else SampleLogprobs(
                _to_host(lp.token_logprobs), _to_host(lp.top_ids), _to_host(lp.top_logprobs)
            )
        )
        tokens = _to_host(sampled.tokens)
        ready = None
        if sampled.tokens.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        for req in requests:
            req.num_pending_tokens += 1
        early = num_first_tokens > 0 and num_first_tokens >= FIRST_TOKEN_SHARE * len(requests)
        return cls(list(requests), tokens, logprobs, ready, early)

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def read(self, eos_token_ids: frozenset[int]) -> list[Request]:
        """Wait for the tokens and append each to its request, unless it finished meanwhile
        (its stop was read one step late, or it was aborted or failed): those are dropped.
        Returns the requests that took a token.
        """
        self.wait()
        logprobs = self._logprob_rows()
        took = []
        for row, (req, token) in enumerate(zip(self.requests, self.tokens.tolist())):
            req.num_pending_tokens -= 1
            if req.finished:
                continue
            if logprobs is not None:
                req.logprobs.append(logprobs[row])
            req.append_token(token, eos_token_ids)
            took.append(req)
        return took

    def _logprob_rows(self) -> list[TokenLogprobs] | None:
        lp = self.logprobs
        if lp is None:
            return None
        token_lp, top_ids, top_lp = (
            lp.token_logprobs.tolist(),
            lp.top_ids.tolist(),
            lp.top_logprobs.tolist(),
        )
        out = []
        for i, (req, token) in enumerate(zip(self.requests, self.tokens.tolist())):
            n = req.params.logprobs or 0
            out.append(TokenLogprobs(token, token_lp[i], tuple(zip(top_ids[i][:n], top_lp[i][:n]))))
        return out


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A non-blocking copy of ``t`` on the host (into pinned memory when ``t`` is on CUDA)."""
    return t.to("cpu", non_blocking=True)
