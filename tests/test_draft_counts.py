"""Verify rows' penalty counts on the device (``add_draft_counts``) equal rows built on the host
with each row's drafts appended to the outputs (``SamplingBatch.build``, the reference).
"""

from __future__ import annotations

import pytest
import torch

from pcgspec.sampling.batch import SamplingBatch, add_draft_counts
from pcgspec.sampling_params import SamplingParams

V = 50


def _rows(params, outputs, drafts_per_row, k):
    rows = [(b, j) for b in range(len(params)) for j in range(k + 1)]
    return SamplingBatch.build(
        params=[params[b] for b, _ in rows],
        seeds=[b for b, _ in rows],
        positions=[len(outputs[b]) + j for b, j in rows],
        prompt_ids=[[1, 2, 3] for _ in rows],
        output_ids=[outputs[b] + drafts_per_row(b, j) for b, j in rows],
        vocab_size=V,
        device="cpu",
    )


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_counts_match_host_rows(k):
    gen = torch.Generator().manual_seed(k)
    params = [SamplingParams(temperature=0, repetition_penalty=1.3),
              SamplingParams(temperature=0.7, frequency_penalty=0.5, presence_penalty=0.2),
              SamplingParams(temperature=0)]  # fmt: skip
    outputs = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (0, 7, 3)]
    drafts = torch.randint(0, V, (3, k), generator=gen)
    drafts[1, -1] = drafts[1, 0]  # a repeated draft counts twice
    want = _rows(params, outputs, lambda b, j: drafts[b, :j].tolist(), k)
    got = add_draft_counts(_rows(params, outputs, lambda b, j: [], k), drafts)
    assert torch.equal(got.output_counts, want.output_counts)
    assert torch.equal(got.prompt_mask, want.prompt_mask)


def test_without_penalties_nothing_is_counted():
    rows = _rows([SamplingParams(temperature=0)], [[4, 5]], lambda b, j: [], 2)
    assert rows.output_counts is None
    assert add_draft_counts(rows, torch.zeros(1, 2, dtype=torch.int64)) is rows
