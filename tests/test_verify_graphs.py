"""TARGET_VERIFY graphs: the decode-graph runner with k+1 tokens per request. Replays equal eager
verify passes over random request subsets (every bucket, padded requests included), padded
requests write no KV, ``ModelRunner.forward`` routes verify batches to them, and ``can_run``
refuses what they cannot serve. On CPU the eager stand-in replaces CUDA graphs; the ``gpu`` test
captures real ones through ``ModelRunner``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from test_decode_graphs import (
    MAX_BS,
    MAX_NEW,
    PAGE_SIZE,
    STEPS,
    Requests,
    assert_only_slots_written,
    kv_snapshot,
    tiny_path,  # noqa: F401  (fixture)
    tiny_runner,
)

from pcgspec.kernels.padded_rows import VerifyTokens
from pcgspec.runners.batch_builder import (
    SeqChunk,
    build_forward_batch,
    build_verify_batch,
    device_page_table,
)
from pcgspec.runners.decode_graph_runner import DecodeGraphRunner
from pcgspec.runners.forward_batch import ForwardBatch, ForwardMode
from pcgspec.runners.model_runner import ModelRunner

K1 = 3  # k+1 tokens per request (Requests leaves room for MAX_NEW = 8 more tokens)


def verify_batch(reqs: Requests, rows: Sequence[int], n: int = K1) -> ForwardBatch:
    chunks = [
        SeqChunk(reqs.ids[r][reqs.lens[r] : reqs.lens[r] + n], reqs.lens[r], reqs.pages[r])
        for r in rows
    ]
    return build_forward_batch(
        ForwardMode.TARGET_VERIFY,
        chunks,
        PAGE_SIZE,
        reqs.runner.device,
        logits_rows=range(len(rows) * n),
        spec_num_draft_tokens=n,
    )


def verify_graphs(runner: ModelRunner, warm_up: bool = True) -> DecodeGraphRunner:
    """The runner's verify graphs on CUDA; on CPU the eager stand-in, captured (``warm_up``
    False: without the eager runs before each capture, which only compile kernels)."""
    if runner.verify_graphs is not None:
        return runner.verify_graphs
    graphs = DecodeGraphRunner(runner, ForwardMode.TARGET_VERIFY, K1)
    if not warm_up:
        graphs.num_warmup = 0
    graphs.capture()
    return graphs


@torch.inference_mode()
def check_verify_against_eager(runner: ModelRunner, graphs: DecodeGraphRunner, tol: float) -> None:
    reqs, kv = Requests(runner), runner.kv_cache
    room, replays = [n + MAX_NEW for n in reqs.lens], 0
    for step in STEPS:
        rows = [r for r in step if reqs.lens[r] + K1 <= room[r]]
        if not rows:
            continue
        replays += 1
        batch = verify_batch(reqs, rows)
        assert graphs.can_run(batch)
        before = kv_snapshot(kv)
        hidden, aux, logits = graphs.replay(batch)
        assert logits is None  # verify graphs leave the LM head to the caller
        assert aux is None and hidden.shape == (len(rows) * K1, runner.model.hidden_size)
        hidden = hidden.clone()
        assert_only_slots_written(kv, before, batch.out_cache_loc)
        want, _ = runner.run_eager(batch)
        torch.testing.assert_close(hidden, want, atol=tol, rtol=tol)
        for r in rows:  # all accepted: the next verify writes fresh slots (checked above)
            reqs.lens[r] += K1
    assert graphs.stats()["runs"] == replays == 4  # buckets 16, 1, 4, 16


@pytest.mark.parametrize("piecewise", [False, True], ids=["plain-decoder", "compiled-decoder"])
def test_verify_replays_match_eager(tiny_path, piecewise: bool) -> None:  # noqa: F811
    runner = tiny_runner(tiny_path, disable_piecewise_cuda_graph=not piecewise)
    graphs = verify_graphs(runner)
    assert sorted(graphs.graphs) == [1, 2, 4, 8, 16] and graphs.tokens_per_seq == K1
    check_verify_against_eager(runner, graphs, tol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only; gpu tests run Triton")
def test_verify_replays_match_eager_triton_interpreted(tiny_path) -> None:  # noqa: F811
    runner = tiny_runner(tiny_path, attention_backend="triton", disable_piecewise_cuda_graph=True)
    # NOTE: the interpreter compiles nothing: warm-ups would only rerun each bucket twice
    check_verify_against_eager(runner, verify_graphs(runner, warm_up=False), tol=1e-5)


def test_model_runner_routes_verify_batches(tiny_path) -> None:  # noqa: F811
    runner = tiny_runner(tiny_path, disable_piecewise_cuda_graph=True)
    runner.verify_graphs = verify_graphs(runner)  # NOTE: ModelRunner builds them on CUDA only
    reqs = Requests(runner)
    batch = verify_batch(reqs, [4, 2, 9])
    with torch.inference_mode():
        want = runner.model.compute_logits(runner.run_eager(batch)[0])
        got = runner.forward(batch).logits
        runner.forward(reqs.decode([1]))  # DECODE batches never reach the verify graphs
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    no_fallbacks = dict.fromkeys(DecodeGraphRunner.reasons, 0)
    assert runner.verify_graphs.stats() == {
        "graphs": 5,
        "runs": 1,
        "padded_rows": K1,
        "fallbacks": no_fallbacks,
    }


@torch.inference_mode()
def test_a_verify_batch_built_in_place_replays_like_eager(tiny_path) -> None:  # noqa: F811
    """``build_verify_batch`` into the bucket's static rows (``rows_for``): the same rows as
    the host-built batch, the padding request of bucket 4 writes no KV, the replay copies only
    the page table and equals an eager pass; ``rows_for`` declines what no graph serves.
    """
    runner = tiny_runner(tiny_path, disable_piecewise_cuda_graph=True)
    graphs, reqs, device = verify_graphs(runner), Requests(runner), runner.device
    rows = [4, 2, 9]
    lens = [reqs.lens[r] for r in rows]  # the last token's position: its K/V is not cached yet
    last = torch.tensor([reqs.ids[r][n] for r, n in zip(rows, lens)], device=device)
    drafts = torch.tensor([reqs.ids[r][n + 1 : n + K1] for r, n in zip(rows, lens)], device=device)
    tokens = VerifyTokens(last.flip(0), torch.arange(2, -1, -1, device=device), drafts)
    seq_lens = torch.tensor(lens, device=device) + 1
    table = device_page_table([reqs.pages[r] for r in rows], device)
    bounds = [n + K1 for n in lens]
    host = verify_batch(reqs, rows)
    built = build_verify_batch(tokens, seq_lens, table, PAGE_SIZE, bounds)
    graph_rows = graphs.rows_for(len(rows), table.shape[1], max(bounds))
    in_place = build_verify_batch(tokens, seq_lens, table, PAGE_SIZE, bounds, graph_rows)
    assert in_place.input_ids.data_ptr() == graphs.buffers.input_ids.data_ptr()
    for name in ("input_ids", "positions", "out_cache_loc"):
        assert torch.equal(getattr(in_place, name), getattr(host, name)), name
        assert torch.equal(getattr(built, name), getattr(host, name)), name
    assert torch.equal(in_place.seq_lens, host.seq_lens)
    assert torch.equal(in_place.logits_indices, host.logits_indices)
    kv = runner.kv_cache
    before = kv_snapshot(kv)
    assert graphs.can_run(in_place)
    hidden = graphs.replay(in_place).hidden.clone()
    assert graphs.stats()["padded_rows"] == K1  # bucket 4: one request of k+1 rows
    assert_only_slots_written(kv, before, in_place.out_cache_loc)
    torch.testing.assert_close(hidden, runner.run_eager(built)[0], atol=1e-5, rtol=1e-5)
    assert graphs.rows_for(MAX_BS + 1, table.shape[1], max(bounds)) is None
    assert graphs.rows_for(3, graphs.max_pages + 1, max(bounds)) is None
    assert graphs.rows_for(3, table.shape[1], graphs.max_seq_len + 1) is None


def test_verify_can_run_refusals(tiny_path) -> None:  # noqa: F811
    runner = tiny_runner(tiny_path, disable_piecewise_cuda_graph=True)
    graphs = verify_graphs(runner)
    with torch.inference_mode():
        reqs = Requests(runner, num=MAX_BS + 1)
    assert graphs.can_run(verify_batch(reqs, [0, 1]))
    refused = {
        "mode": [reqs.decode([0, 1]), verify_batch(reqs, [0, 1], n=K1 - 1)],
        "batch_size": [verify_batch(reqs, range(MAX_BS + 1))],
    }
    for reason, batches in refused.items():
        for bad in batches:
            assert not graphs.can_run(bad), reason
    fallbacks = {k: v for k, v in graphs.stats()["fallbacks"].items() if v}
    assert fallbacks == {"mode": 2, "batch_size": 1}
    with pytest.raises(ValueError, match="tokens_per_seq"):
        DecodeGraphRunner(runner, ForwardMode.DECODE, 2)
    with pytest.raises(ValueError, match="mode"):
        DecodeGraphRunner(runner, ForwardMode.EXTEND, 2)


@pytest.mark.gpu
def test_cuda_verify_graphs_match_eager(tiny_path) -> None:  # noqa: F811
    runner = tiny_runner(
        tiny_path,
        device="cuda",
        disable_piecewise_cuda_graph=True,
        speculative_algorithm="NGRAM",
        speculative_num_steps=K1 - 1,
    )
    graphs = runner.verify_graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8, 16]
    check_verify_against_eager(runner, graphs, tol=1e-5)
