"""Tensor parallelism on two GPUs (NCCL): the Llama-3.2-1B shape with random weights saved as a
checkpoint, so TP=1 and TP=2 compute the same function. Greedy tokens of TP=2 equal TP=1 in
float32 through piecewise graphs, decode graphs and NGRAM verify graphs (transformers decides
near-ties); bf16 logits of TP=2 stay within bf16 tolerance of TP=1.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from oracle import assert_greedy_match, greedy
from safetensors.torch import save_file
from test_tp import runner_logits
from test_tp_torchrun import ROOT, finish, torchrun_nodes

from pcgspec import LLM
from pcgspec.config import EngineConfig
from pcgspec.distributed import symm_mem
from pcgspec.distributed.process_group import Rendezvous, TPProcessGroups
from pcgspec.models.layers.weights import unfused_state_dict
from pcgspec.models.random_weights import random_model, shape_config
from pcgspec.runners.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]
SHAPE = "llama-3.2-1b"
VOCAB = 49152  # prompt ids below the tokenizer's (SmolLM2's) vocabulary


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("llama-1b-random")
    model = random_model(SHAPE, torch.bfloat16, "cuda:0", seed=0)
    tensors = unfused_state_dict(model, model.packed_modules_mapping)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, path / "model.safetensors")
    shape_config(SHAPE).save_pretrained(path)
    del model, tensors
    torch.cuda.empty_cache()
    return path


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    rand = [torch.randint(VOCAB, (n,), generator=gen).tolist() for n in (7, 33, 130, 300)]
    loop = [11, 22, 33, 44, 55] * 8  # NGRAM drafts from it
    return [*rand, loop, loop[:17]]


def generate(path, smollm2_path, tp: int, **kw: object) -> tuple[list[list[int]], dict]:
    # NOTE: the prompts hold 527 tokens together: a first prefill chunk of 384 runs through the
    # piecewise graphs (past the extend graphs' 256 tokens, within the largest bucket).
    llm = LLM(
        str(path),
        tokenizer=str(smollm2_path),
        dtype="float32",
        tp_size=tp,
        max_total_tokens=16384,
        cuda_graph_max_bs=8,
        piecewise_cuda_graph_max_tokens=512,
        chunked_prefill_size=384,
        **kw,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], greedy(24), use_tqdm=False)
    graphs = llm.engine.graph_stats()
    stats = {
        "piecewise": graphs["piecewise"],
        "decode": graphs["decode"],
        "verify": graphs.get("verify"),
        "spec": llm.engine.spec_stats(),
        "one_shot_calls": sum(b.calls for b in symm_mem._BUFFERS.values()),
    }
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.fixture(scope="module")
def eagle3_head(checkpoint, tmp_path_factory: pytest.TempPathFactory):
    from pcgspec.models.eagle3 import write_eagle3_checkpoint
    from pcgspec.models.loader import load_config

    return write_eagle3_checkpoint(
        tmp_path_factory.mktemp("eagle3-1b"), load_config(checkpoint), seed=0
    )


@pytest.mark.parametrize("algorithm", [None, "NGRAM", "EAGLE3", "EAGLE3-trees"])
def test_tp2_greedy_equals_tp1_float32_through_the_graphs(
    checkpoint, smollm2_path, algorithm, request
):
    """EAGLE3 (an untrained head: lossless, drafts rarely accepted): the workers capture the
    auxiliary hidden states in their graphs as rank 0 does; with trees, tree verify graphs on
    every rank and the accepted paths' K/V moved on every rank."""
    spec = {} if algorithm is None else {"speculative_algorithm": algorithm.split("-")[0]}
    if algorithm is not None:
        spec["speculative_policy"] = "always"
    if algorithm and algorithm.startswith("EAGLE3"):
        spec["speculative_draft_model_path"] = str(request.getfixturevalue("eagle3_head"))
    if algorithm == "EAGLE3-trees":
        spec |= dict(
            speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6
        )
    expected, single = generate(checkpoint, smollm2_path, 1, **spec)
    got, split = generate(checkpoint, smollm2_path, 2, **spec)
    for stats in (single, split):
        assert stats["piecewise"]["runs"] > 0, stats["piecewise"]
        assert stats["decode"]["graphs"] > 0
        if spec:
            assert stats["spec"]["verify_steps"] > 0
            assert stats["verify"]["runs"] > 0, stats["verify"]  # on every rank alike
        else:
            assert stats["decode"]["runs"] > 0, stats["decode"]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for prompt, ours, ref in zip(prompts(), got, expected):
        assert_greedy_match(hf, prompt, ours, ref)


def test_tp2_bf16_logits_within_tolerance_of_tp1(checkpoint):
    def logits(tp: int) -> list[torch.Tensor]:
        config = EngineConfig(
            model=str(checkpoint),
            dtype="bfloat16",
            page_size=4,
            tp_size=tp,
            max_total_tokens=512,
            cuda_graph_max_bs=2,
            piecewise_cuda_graph_max_tokens=32,
        )
        runner = ModelRunner(config, checkpoint)
        out = [t.cpu() for t in runner_logits(runner)]
        runner.shutdown()
        return out

    expected = logits(1)
    gc.collect()
    torch.cuda.empty_cache()
    for got, ref in zip(logits(2), expected):
        assert ((got - ref).norm() / ref.norm()).item() < 3e-2


def test_torchrun_tp2_equals_spawned_tp2(checkpoint, smollm2_path, tmp_path):
    """``torchrun --nproc-per-node 2`` running ``pcgspec generate`` (NCCL, graphs, NGRAM on):
    the tokens of the spawned TP=2 engine, which runs the same shards and collectives.
    """
    args = [
        "generate",
        *("--model-path", str(checkpoint), "--tokenizer", str(smollm2_path)),
        *("--dtype", "float32", "--tp-size", "2", "--max-new-tokens", "24", "--ignore-eos"),
        *("--max-total-tokens", "16384", "--cuda-graph-max-bs", "8"),
        *("--piecewise-cuda-graph-max-tokens", "512"),
        *("--speculative-algorithm", "NGRAM", "--speculative-policy", "always", "--json"),
        *("--prompt", "The capital of France is", "--prompt", "one two three one two three"),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    spawned = subprocess.run(
        [sys.executable, "-m", "pcgspec", *args], env=env, capture_output=True, text=True
    )
    assert spawned.returncode == 0, spawned.stderr[-3000:]
    want = [json.loads(line)["token_ids"] for line in spawned.stdout.splitlines()]
    results = finish(torchrun_nodes(args, tmp_path, nodes=1, per_node=2), tmp_path, 600)
    assert [rc for rc, _, _ in results] == [0], results[0][2][-3000:]
    got = [json.loads(line)["token_ids"] for line in results[0][1].splitlines()]
    assert got == want and len(got) == 2


SYMM_MAX_BYTES = 1 << 16


def _symm_rank(rendezvous: Rendezvous, rank: int, results) -> None:  # noqa: ANN001
    """One rank: one-shot all-reduces (eager and replayed from a CUDA graph) equal NCCL's, and
    a message above the limit goes to NCCL."""
    try:
        groups = TPProcessGroups(rendezvous, rank, torch.device("cuda", rank))
        symm = symm_mem.buffer_for(torch.zeros(1, device=groups.device), groups.tp.group_name)
        assert symm is not None, "the one-shot path is off"
        gen = torch.Generator(device=groups.device).manual_seed(rank)
        for shape in ((1, 64), (4, 2048), (64, 2048)):  # the last: 256 KiB, over the limit
            x = torch.randn(shape, generator=gen, device=groups.device, dtype=torch.bfloat16)
            want = x.clone()
            dist.all_reduce(want, group=groups.device_group)
            calls = symm.calls
            torch.testing.assert_close(groups.tp.all_reduce(x), want, rtol=0, atol=0)
            assert (symm.calls > calls) == (x.numel() * 2 <= SYMM_MAX_BYTES), shape
        static = torch.zeros(8, 256, device=groups.device, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = groups.tp.all_reduce(static)
        for step in range(3):
            static.copy_(torch.full_like(static, rank + step))
            graph.replay()
            torch.testing.assert_close(out, torch.full_like(out, 1 + 2 * step), rtol=0, atol=0)
        torch.cuda.synchronize()
        del graph
        groups.destroy()
        results.put("ok")
    except BaseException as e:  # noqa: BLE001 (reported to the test)
        results.put(f"rank {rank}: {type(e).__name__}: {e}")


def test_symm_mem_one_shot_all_reduce_equals_nccl(monkeypatch):
    monkeypatch.setenv("PCGSPEC_TP_SYMM_MEM_MAX_BYTES", str(SYMM_MAX_BYTES))
    ctx = mp.get_context("spawn")
    results, rendezvous = ctx.Queue(), Rendezvous.local(2)
    procs = [ctx.Process(target=_symm_rank, args=(rendezvous, r, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert [results.get(timeout=300) for _ in procs] == ["ok", "ok"]
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def test_tp2_greedy_with_the_one_shot_all_reduce_equals_nccl(checkpoint, smollm2_path, monkeypatch):
    """Through the piecewise, decode and verify graphs (the small buckets one-shot, the large
    ones NCCL): the tokens of the NCCL-only engine (a sum of two is exact either way)."""
    want, nccl = generate(checkpoint, smollm2_path, 2)
    monkeypatch.setenv("PCGSPEC_TP_SYMM_MEM_MAX_BYTES", str(SYMM_MAX_BYTES))
    got, one_shot = generate(checkpoint, smollm2_path, 2)
    assert (nccl["one_shot_calls"], one_shot["one_shot_calls"] > 0) == (0, True)
    assert got == want
