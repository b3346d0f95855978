"""Tensor parallelism on CPU: gloo processes spawned by pcgspec itself. Sharded layers load the
right slices; TP=2 logits (piecewise pieces with the all-reduce inside) and greedy tokens (NGRAM
speculation on) equal TP=1 in float32; bad head counts raise; a killed worker makes the engine
fail fast and leaves no process behind.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_models import tiny_hf_model

from pcgspec import LLM, SamplingParams
from pcgspec.config import EngineConfig
from pcgspec.distributed.group import TPGroup
from pcgspec.distributed.launcher import TPGroupFailed
from pcgspec.models.llama import LlamaForCausalLM
from pcgspec.models.loader import load_config
from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch
from pcgspec.runners.forward_batch import ForwardMode
from pcgspec.runners.model_runner import ModelRunner

PAGE = 4
# Token-id prompts that repeat themselves, so prompt lookup (NGRAM) drafts.
PROMPTS = [[5, 9, 17, 33, 5, 9, 17, 33, 5, 9], [100, 101, 102, 103, 104, 100, 101, 102], [7] * 6]


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tiny-llama-tp")
    tiny_hf_model("LlamaConfig").save_pretrained(path)  # 4 heads, 2 KV heads, vocab 256
    return path


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tiny-qwen3-tp")
    tiny_hf_model("Qwen3Config", head_dim=16, tie_word_embeddings=True).save_pretrained(path)
    return path


def fake_group(rank: int, size: int) -> TPGroup:
    return TPGroup(rank, size, None if size == 1 else "unused")


def shard_of(path, rank: int, size: int) -> LlamaForCausalLM:
    """Rank ``rank``'s shard, loaded without a process group (no forward runs)."""
    from pcgspec.models.loader import load_model

    return load_model(path, torch.float32, "cpu", fake_group(rank, size))


def test_shards_are_the_checkpoint_slices(qwen3_path) -> None:
    """TP=4 over 2 KV heads: q and the MLP split four ways, k/v replicated on rank pairs, the
    row-parallel inputs split, the (tied) vocabulary split by rows; KV heads per rank 1.
    """
    full = shard_of(qwen3_path, 0, 1)
    shards = [shard_of(qwen3_path, r, 4) for r in range(4)]
    attn = [s.model.layers[1].self_attn for s in shards]
    whole = full.model.layers[1].self_attn
    q, k, _ = whole.qkv_proj.weight.split(whole.split_sizes)
    assert all(s.num_heads == 1 and s.num_kv_heads == 1 for s in shards)
    torch.testing.assert_close(torch.cat([a.qkv_proj.weight[:16] for a in attn]), q, rtol=0, atol=0)
    for r, a in enumerate(attn):  # KV head r // 2 on rank r
        torch.testing.assert_close(
            a.qkv_proj.weight[16:32], k[16 * (r // 2) : 16 * (r // 2 + 1)], rtol=0, atol=0
        )
    o = torch.cat([a.o_proj.weight for a in attn], dim=1)
    torch.testing.assert_close(o, whole.o_proj.weight, rtol=0, atol=0)
    down = torch.cat([s.model.layers[0].mlp.down_proj.weight for s in shards], dim=1)
    torch.testing.assert_close(down, full.model.layers[0].mlp.down_proj.weight, rtol=0, atol=0)
    embed = torch.cat([s.model.embed_tokens.weight for s in shards])
    torch.testing.assert_close(embed, full.model.embed_tokens.weight, rtol=0, atol=0)
    assert all(s.lm_head is s.model.embed_tokens for s in shards)


def test_head_counts_that_do_not_divide_raise(llama_path) -> None:
    config = load_config(llama_path)  # 4 heads, 2 KV heads, intermediate 128
    with torch.device("meta"), pytest.raises(ValueError, match=r"num_attention_heads \(4\).*3"):
        LlamaForCausalLM(config, fake_group(0, 3))
    config.num_attention_heads, config.num_key_value_heads = 6, 3
    with torch.device("meta"), pytest.raises(ValueError, match=r"num_key_value_heads \(3\).*2"):
        LlamaForCausalLM(config, fake_group(0, 2))
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\).*3"):  # before any spawn
        ModelRunner(runner_config(llama_path, 3), llama_path)
    assert not multiprocessing.active_children()
    with pytest.raises(ValueError, match="tp_size must be a positive integer"):
        EngineConfig(tp_size=0)


def runner_config(path, tp: int) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        dtype="float32",
        device="cpu",
        page_size=PAGE,
        max_total_tokens=512,
        piecewise_cuda_graph_max_tokens=32,
        tp_size=tp,
    )


@torch.inference_mode()
def runner_logits(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of a two-request prefill (piecewise), an eager prefill over 40 tokens (past
    the largest bucket) and a decode step after both.
    """
    chunks = [SeqChunk(list(range(1, 20)), 0, range(5)), SeqChunk([5, 6, 7], 0, [6])]
    device = runner.device
    batches = [
        build_forward_batch(ForwardMode.EXTEND, chunks, PAGE, device),
        build_forward_batch(
            ForwardMode.EXTEND, [SeqChunk(list(range(40)), 0, range(10, 20))], PAGE, device
        ),
        build_forward_batch(
            ForwardMode.DECODE,
            [SeqChunk([9], 19, range(5)), SeqChunk([3], 40, range(10, 21))],
            PAGE,
            device,
        ),
    ]
    # NOTE: cloned: a graph's logits are overwritten by the next decode or extend graph's replay
    return [runner.forward(b).logits.clone() for b in batches]


@pytest.mark.parametrize("model", ["llama_path", "qwen3_path"])
def test_tp2_logits_equal_tp1_with_the_all_reduce_inside_the_pieces(model, request) -> None:
    """Llama (untied LM head) and Qwen3 (q/k norms, tied vocab-parallel embedding)."""
    path = request.getfixturevalue(model)
    expected = runner_logits(ModelRunner(runner_config(path, 1), path))
    runner = ModelRunner(runner_config(path, 2), path)
    try:
        assert runner.kv_cache.spec.num_kv_heads == 1 and runner.model.num_heads == 2
        split = runner.piecewise.backend.split
        assert split.num_split_points == runner.model.num_layers  # the cut is at attention only
        targets = [str(n.target) for p in split.compute_pieces for n in p.graph_module.graph.nodes]
        assert sum("pcgspec.all_reduce" in t for t in targets) == 1 + 2 * runner.model.num_layers
        got = runner_logits(runner)
        stats = runner.piecewise.stats()
        assert (stats["runs"], stats["fallbacks"]["too_many_tokens"]) == (2, 1)
    finally:
        runner.shutdown()
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_tp2_greedy_tokens_equal_tp1_with_ngram_then_a_killed_worker_fails_cleanly(
    llama_path, smollm2_path
) -> None:
    """One TP=2 engine (a spawn costs seconds): NGRAM-speculative greedy tokens equal TP=1's;
    then a worker is killed: the next step raises within seconds, later ones too, and no
    worker process is left.
    """
    kw = dict(
        tokenizer=str(smollm2_path),
        dtype="float32",
        device="cpu",
        page_size=PAGE,
        max_total_tokens=512,
        disable_piecewise_cuda_graph=True,
        speculative_algorithm="NGRAM",
        speculative_num_steps=3,
        speculative_policy="always",
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = [
        o.outputs[0].token_ids
        for o in LLM(str(llama_path), **kw).generate(prompts, params, use_tqdm=False)
    ]
    llm = LLM(str(llama_path), tp_size=2, **kw)
    procs = llm.engine.runner.tp_driver.procs
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.spec_stats()["verify_steps"] > 0
        assert got == expected
        os.kill(procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TPGroupFailed, match="tensor-parallel group is down"):
            llm.generate(prompts[0], params, use_tqdm=False)
        assert time.monotonic() - start < 30
        with pytest.raises(TPGroupFailed):  # and stays down
            llm.generate(prompts[1], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert all(not p.is_alive() for p in procs)


def test_workers_leave_when_rank0_is_sigtermed(llama_path) -> None:
    """Rank 0 in a process of its own, killed by SIGTERM (no exit handlers run): its workers
    notice their parent is gone and exit.
    """
    code = (
        "import sys; from pathlib import Path; from pcgspec.config import EngineConfig; "
        "from pcgspec.runners.model_runner import ModelRunner; "
        f"p = Path({str(llama_path)!r}); "
        "r = ModelRunner(EngineConfig(model=str(p), device='cpu', dtype='float32', tp_size=2, "
        "max_total_tokens=64, disable_piecewise_cuda_graph=True), p); "
        "print(*[w.pid for w in r.tp_driver.procs], flush=True); sys.stdin.read()"
    )
    rank0 = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    workers = [int(pid) for pid in rank0.stdout.readline().split()]
    assert workers and all(_running(pid) for pid in workers)
    rank0.send_signal(signal.SIGTERM)
    rank0.wait(30)
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_running(pid) for pid in workers)


def test_an_llm_left_running_shuts_its_group_down_at_exit(llama_path, smollm2_path) -> None:
    """A script that never calls ``shutdown``: at exit the LLM stops its workers and tears its
    groups down (``TPDriver.shutdown``, which on CUDA releases the graphs first), rather than
    leaving the groups to interpreter teardown."""
    code = (
        "import pcgspec.distributed.launcher as launcher; from pcgspec import LLM; "
        "shutdown = launcher.TPDriver.shutdown; "
        "launcher.TPDriver.shutdown = lambda d: (print('shutdown', flush=True), shutdown(d)); "
        f"llm = LLM({str(llama_path)!r}, tokenizer={str(smollm2_path)!r}, device='cpu', "
        "dtype='float32', tp_size=2, max_total_tokens=64, disable_piecewise_cuda_graph=True, "
        "log_level='warning'); "
        "print(*[w.pid for w in llm.engine.runner.tp_driver.procs], flush=True); "
        "llm.generate({'prompt_token_ids': [1, 2, 3]}, use_tqdm=False)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    pids, said = done.stdout.splitlines()
    assert said == "shutdown"
    assert not any(_running(int(pid)) for pid in pids.split())


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan's zombie is reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_server_serves_tp2(llama_path, smollm2_path) -> None:
    """`pcgspec serve --tp-size 2`: the engine process starts its worker (so it may not be a
    daemon) and the greedy text equals TP=1's."""
    from server_process import ServerProcess

    prompt, params = PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(
        tokenizer=str(smollm2_path),
        dtype="float32",
        device="cpu",
        page_size=PAGE,
        max_total_tokens=512,
        disable_piecewise_cuda_graph=True,
    )
    want = (
        LLM(str(llama_path), **kw)
        .generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    server = ServerProcess(
        "--model-path",
        str(llama_path),
        "--tokenizer",
        str(smollm2_path),
        "--tp-size",
        "2",
        "--page-size",
        str(PAGE),
        "--max-total-tokens",
        "512",
        "--context-length",
        "128",
        "--disable-piecewise-cuda-graph",
    )
    try:
        server.wait_healthy()
        status, out = server.post(
            "/v1/completions",
            {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        )
        assert status == 200, out
        assert out["choices"][0]["text"] == want
        assert server.terminate() == 0
    finally:
        server.close()
