"""The speculative step of a DECODE batch: propose -> verify -> accept -> commit/rollback.

The target scores ``[last token, d_0 .. d_{k-1}]`` per request in one ``TARGET_VERIFY`` pass
(a verify graph where one is captured). Row ``j`` of request ``b`` chooses output position
``num_output_tokens + j`` with the penalties as of that position, so a verify step emits
exactly the tokens that plain decoding would: greedy by argmax, seeded sampling by
``TARGET_MATCH`` (the target's own seeded draw must equal the deterministic draft).

The drafts stay on the device from propose to verify: the verify batch's ids and its rows'
penalty counts take them there. The rows come from the requests' sampling slots
(``SamplingSlots.rows``), whose position counters and output counts advance on the device after
verification. The step copies to the host once, the accepted lengths and tokens that stop
checks, streaming and page bookkeeping need (with the number of drafts each request had, for
the policy's match rates).

A plain decode step (the caller's) runs instead when the policy (``SpecPolicy``) says
speculation does not pay, when a request wants logprobs (not computed for accepted drafts yet),
when a request would pass the context length, or when the KV pool cannot hold k more slots per
request. The choice comes before the step's tokens are on the host (under the overlap schedule
the last ones are still on the device), so the engine reads them only for a speculative step.
Model drafters see every target pass through ``observe`` (the positions it computed and, for
EAGLE3 / MTP, their hidden states).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pcgspec.engine.request import Request, SpecCounters
from pcgspec.engine.scheduler import ScheduledBatch, Scheduler
from pcgspec.kernels.verify_draft_tokens import (
    VerifyOutput,
    VerifyStrategy,
    verify_draft_tokens,
    verify_draft_tokens_ref,
)
from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch
from pcgspec.runners.decode_graph_runner import decode_batch_sizes
from pcgspec.runners.forward_batch import ForwardMode
from pcgspec.runners.model_runner import ForwardOutput, ModelRunner
from pcgspec.sampling.batch import SamplingBatch
from pcgspec.sampling.sampler import probs_from_logits, process_logits
from pcgspec.sampling.slots import SamplingSlots
from pcgspec.speculative.base import FILLER_TOKEN, DraftProposal, ProposeInput, Proposer
from pcgspec.speculative.config import SpeculativeConfig
from pcgspec.speculative.draft_runner import DraftRunner
from pcgspec.speculative.model_proposer import ModelProposer
from pcgspec.speculative.ngram import NgramProposer
from pcgspec.speculative.policy import SpecPolicy


class SpecWorker:
    def __init__(
        self,
        config: SpeculativeConfig,
        runner: ModelRunner,
        scheduler: Scheduler,
        slots: SamplingSlots,
        eos_token_ids: frozenset[int],
        draft: DraftRunner | None = None,
    ) -> None:
        if (draft is None) != (config.algorithm == "NGRAM"):
            raise ValueError(f"{config.algorithm} needs a draft model exactly when it is not NGRAM")
        self.num_steps = config.num_steps
        self.runner = runner
        self.scheduler = scheduler
        self.slots = slots
        self.eos_token_ids = eos_token_ids
        self.proposer: Proposer = (
            NgramProposer.from_config(config, slots) if draft is None
            else ModelProposer(draft, config.num_steps)
        )  # fmt: skip
        self.policy = SpecPolicy(config.speculative_policy, config.num_steps,
                                 decode_batch_sizes(scheduler.max_running_requests))
        self.stats = SpecCounters()  # summed over requests
        self.num_fallbacks = 0  # plain steps for logprobs, the context length or KV space

    def observe(self, batch: ScheduledBatch, out: ForwardOutput) -> None:
        """A plain target pass ran ``batch`` (before ``Scheduler.update``): tell the proposer
        which positions of each request it computed, with their hidden rows when captured.
        """
        hidden, row = out.hidden_states, 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            rows = None if hidden is None else hidden[row : row + n]
            self.proposer.observe(req, req.num_computed_tokens, rows)
            row += n

    def chooses(self, batch: ScheduledBatch | None) -> bool:
        """Whether ``batch`` should take a speculative step: a decode batch the policy chooses
        to speculate on, none of whose requests wants logprobs (not computed for accepted
        drafts yet) or would pass its context length. Decided before the step's tokens are on
        the host (prompt lookup's matches are not known yet).
        """
        if batch is None or not batch.mode.is_decode():
            return False
        k = self.num_steps
        if any(r.params.logprobs is not None or r.num_tokens + k > r.max_len
               for r in batch.requests):  # fmt: skip
            self.num_fallbacks += 1
            return False
        return self.policy.choose(batch.requests)

    def step(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """Run one speculative step on a batch whose tokens are all on the host; returns the
        batch to hand to ``Scheduler.update`` (with the tokens committed per request), or None:
        nothing ran, do a plain decode step.
        """
        reqs = batch.requests
        k = self.num_steps
        if not self.scheduler.reserve(list(reqs), [len(r.token_ids) + k for r in reqs]):
            self.num_fallbacks += 1  # the KV pool cannot hold k more slots per request
            return None
        proposal = self.propose(reqs)
        verified, hidden = self.verify(reqs, proposal)
        committed = self.accept_and_commit(reqs, verified, hidden, proposal.num_tokens)
        self.slots.commit(reqs, verified.tokens, verified.accept_len + 1)
        self.rollback(reqs)
        return ScheduledBatch(batch.mode, reqs, committed, [True] * len(reqs))

    # propose -----------------------------------------------------------------------------

    def propose(self, reqs: Sequence[Request]) -> DraftProposal:
        return self.proposer.propose(ProposeInput(reqs))

    # verify ------------------------------------------------------------------------------

    def verify(
        self, reqs: Sequence[Request], proposal: DraftProposal
    ) -> tuple[VerifyOutput, torch.Tensor | None]:
        """One TARGET_VERIFY pass over k+1 tokens per request, then the verify kernel. Also
        returns the pass's captured hidden states (``[B * (k+1), Hh]``) when the drafter reads them.
        """
        k, device = self.num_steps, self.runner.device
        drafts = proposal.tokens.to(device, non_blocking=True)  # [B, k]
        chunks = [SeqChunk([r.token_ids[-1], *[FILLER_TOKEN] * k], len(r.token_ids) - 1, r.pages)
                  for r in reqs]  # fmt: skip
        sampling = self.slots.rows(reqs, drafts)  # k+1 rows per request, drafts counted
        batch = build_forward_batch(
            ForwardMode.TARGET_VERIFY, chunks, self.runner.page_size, device,
            logits_rows=range(len(reqs) * (k + 1)), sampling=sampling,
            spec_num_draft_tokens=k + 1,
            capture_hidden_mode=self.runner.capture_hidden_mode(ForwardMode.TARGET_VERIFY),
        )  # fmt: skip
        batch.input_ids.view(len(reqs), k + 1)[:, 1:].copy_(drafts)
        out = self.runner.forward(batch)
        with torch.inference_mode():
            target, strategy = _target_rows(process_logits(out.logits, sampling), sampling)
            verify = verify_draft_tokens if device.type == "cuda" else verify_draft_tokens_ref
            verified = verify(
                target.view(len(reqs), k + 1, -1), drafts, strategy,
                seed=sampling.seed.view(len(reqs), k + 1),
                position=sampling.position.view(len(reqs), k + 1),
                num_draft=proposal.num_tokens,
            )  # fmt: skip
        return verified, out.hidden_states

    # accept + commit / rollback ----------------------------------------------------------

    def accept_and_commit(
        self, reqs: Sequence[Request], out: VerifyOutput, hidden: torch.Tensor | None,
        num_drafts: torch.Tensor,
    ) -> list[int]:  # fmt: skip
        """Append the accepted drafts and the next token, stopping at the first finish (EOS,
        stop token or string, max_tokens), and hand the proposer the verify rows whose K/V now
        stand (the input token and the accepted drafts). ``num_drafts`` [B]: the drafts each
        request had (prompt lookup finds none for some; the policy averages the accept lengths
        of steps with drafts). Returns the tokens committed per request.
        """
        committed, k1 = [], self.num_steps + 1
        # NOTE: the step's one device-to-host copy.
        rows = torch.cat([out.accept_len[:, None], num_drafts[:, None], out.tokens], 1).tolist()
        for b, (req, (accept_len, drafted, *tokens)) in enumerate(zip(reqs, rows)):
            req.spec.record(accept_len, self.num_steps)
            self.stats.record(accept_len, self.num_steps)
            self.policy.record_drafted(req, drafted > 0)
            if drafted:
                self.policy.record_accept(req, accept_len + 1)
            start, n = len(req.token_ids) - 1, 0
            for token in tokens[: accept_len + 1]:
                req.append_token(token, self.eos_token_ids)
                n += 1
                if req.finished:
                    break
            committed.append(n)
            if not req.finished:
                rows = None if hidden is None else hidden[b * k1 : b * k1 + n]
                self.proposer.observe(req, start, rows)
        return committed

    def rollback(self, reqs: Sequence[Request]) -> None:
        """Keep the pages of the committed tokens only. The KV of accepted drafts is valid;
        rejected slots past the new length are overwritten by later steps. The newest token's
        KV is written by the next step (``Scheduler.update`` sets ``num_computed_tokens``).
        """
        for req in reqs:
            self.scheduler.trim(req, len(req.token_ids))


def _target_rows(
    processed: torch.Tensor, sampling: SamplingBatch
) -> tuple[torch.Tensor, VerifyStrategy]:
    """What the verify kernel scores: processed logits under GREEDY when every row is greedy;
    else probabilities under TARGET_MATCH, greedy rows as one-hot argmax rows (so they pick
    exactly the token plain decoding's argmax picks).
    """
    if sampling.all_greedy:
        return processed, VerifyStrategy.GREEDY
    probs = probs_from_logits(processed)
    one_hot = F.one_hot(processed.argmax(dim=-1), probs.shape[-1]).to(probs.dtype)
    return torch.where(sampling.is_greedy[:, None], one_hot, probs), VerifyStrategy.TARGET_MATCH
