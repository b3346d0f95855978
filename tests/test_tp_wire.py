"""What a tensor-parallel worker receives each step: rank 0's ``ForwardBatch`` through one int64
message (no pickling), field for field, in two gloo processes; a message longer than the fixed
first broadcast (payload and header both) arrives whole; the sampling tensors stay on rank 0.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.multiprocessing as mp

from pcgspec.distributed.broadcast import StepChannel
from pcgspec.distributed.process_group import Rendezvous, TPProcessGroups
from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch
from pcgspec.runners.batch_wire import from_message, to_message
from pcgspec.runners.forward_batch import CaptureHiddenMode, ForwardBatch, ForwardMode

CAPACITY = 64


def batches() -> list[ForwardBatch]:
    """A prefill, a 20-request decode (its header alone overflows 64 words) and a verify-like
    batch with every optional field set.
    """
    chunks = [SeqChunk(list(range(1, 12)), 0, [0, 1, 2]), SeqChunk([5], 0, [3])]
    prefill = build_forward_batch(ForwardMode.EXTEND, chunks, 4, "cpu")
    chunks = [SeqChunk([i], 7 + i, range(4 * i, 4 * i + 8)) for i in range(20)]
    decode = build_forward_batch(ForwardMode.DECODE, chunks, 4, "cpu")
    g = torch.Generator().manual_seed(0)
    full = dataclasses.replace(
        prefill,
        forward_mode=ForwardMode.TARGET_VERIFY,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        input_embeds=torch.randn(12, 8, generator=g).to(torch.bfloat16),
        return_input_logprobs=True,
        spec_num_draft_tokens=3,
        extend_start=torch.tensor([0, 11], dtype=torch.int32),
        sampling=object(),
    )
    return [prefill, decode, full]


def assert_same(got: ForwardBatch, want: ForwardBatch) -> None:
    for f in dataclasses.fields(ForwardBatch):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name == "sampling":
            assert a is None, "sampling is rank 0's"
        elif isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f.name
        else:
            assert a == b and type(a) is type(b), f.name


def _rank(rendezvous: Rendezvous, rank: int, results: mp.Queue) -> None:
    groups = TPProcessGroups(rendezvous, rank, torch.device("cpu"))
    channel = StepChannel(groups, capacity=CAPACITY)
    try:
        if rank == 0:
            for batch in batches():
                channel.send(to_message(batch))
            channel.stop()
            return
        got = []
        while (message := channel.recv()) is not None:
            got.append(from_message(message))
        for g, w in zip(got, batches(), strict=True):
            assert_same(g, w)
        results.put("ok")
    except BaseException as e:  # noqa: BLE001 (reported to the test)
        results.put(f"{type(e).__name__}: {e}")
    finally:
        groups.destroy()


def test_a_worker_receives_rank0s_batches_field_for_field() -> None:
    decode = batches()[1]
    assert len(to_message(decode).header) > CAPACITY  # the header itself overflows
    ctx = mp.get_context("spawn")
    results, rendezvous = ctx.Queue(), Rendezvous.local(2)
    procs = [ctx.Process(target=_rank, args=(rendezvous, r, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert results.get(timeout=120) == "ok"
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]


def test_a_field_without_a_wire_form_raises() -> None:
    batch = dataclasses.replace(batches()[0], page_size=[4])
    with pytest.raises(TypeError, match="ForwardBatch.page_size"):
        to_message(batch)


def test_a_kv_move_message_round_trips_and_is_told_from_batches() -> None:
    """A draft tree's K/V move as the worker gets it (the channel flattens the integer tensors
    into one int64 payload): page table, roots and paths back with their shapes and dtypes."""
    from pcgspec.distributed.broadcast import StepMessage
    from pcgspec.runners.batch_wire import is_kv_move, kv_move_from_message, kv_move_message

    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    start = torch.tensor([5, -1, 17])
    path = torch.tensor([[0, 2, 3, -1], [0, -1, -1, -1], [0, 1, 4, 5]])
    sent = kv_move_message(table, start, path)
    payload = torch.cat([t.reshape(-1).to(torch.int64) for t in sent.ints])
    got = kv_move_from_message(StepMessage(sent.header, [payload], []))
    for g, w in zip(got, (table, start, path)):
        assert g.dtype == w.dtype and torch.equal(g, w)
    assert is_kv_move(sent)
    assert not any(is_kv_move(to_message(b)) for b in batches())
