"""Tensor parallelism under ``torchrun`` on CPU: two single-process "nodes" on localhost meet
through a c10d rendezvous; rank 0 runs ``pcgspec generate`` / ``pcgspec serve`` and the other
rank the worker loop. Greedy text equals one process's; tp_size must match the job's size.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch
from server_process import free_port

from pcgspec import LLM, SamplingParams
from pcgspec.cli import main
from pcgspec.config import EngineConfig
from pcgspec.envs import torchrun_env

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["hello", "the cat sat"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer Llama with SmolLM2's vocabulary (text prompts tokenize into it)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(mean=1.0 if name.endswith("norm.weight") else 0.0, std=0.2)
    path = tmp_path_factory.mktemp("tiny-llama-torchrun")
    model.save_pretrained(path)
    return path


def engine_flags(tiny_path: Path, smollm2_path: Path) -> list[str]:
    return [
        "--model-path",
        str(tiny_path),
        "--tokenizer",
        str(smollm2_path),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-total-tokens",
        "256",
        "--context-length",
        "128",
    ]


def torchrun_nodes(
    args: list[str], logs: Path, nodes: int = 2, per_node: int = 1, static: bool = False
) -> list[subprocess.Popen]:
    """``nodes`` torchrun processes of ``per_node`` processes each, meeting at a c10d
    rendezvous (``static``: torchrun's default one, node 0 holding rank 0); node ``i`` writes
    ``logs/i.out`` and ``logs/i.err``.
    """
    port = free_port()
    meet = (
        ("--master-addr", "localhost", "--master-port", str(port))
        if static
        else ("--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}")
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run"),
                *("--nnodes", str(nodes), "--node-rank", str(i), "--nproc-per-node", str(per_node)),
                *meet,
                *("-m", "pcgspec", *args),
            ],
            env=env,
            stdout=(logs / f"{i}.out").open("w"),
            stderr=(logs / f"{i}.err").open("w"),
        )
        for i in range(nodes)
    ]


def finish(
    procs: list[subprocess.Popen], logs: Path, timeout: float = 180
) -> list[tuple[int, str, str]]:
    """Each node's exit code, stdout and stderr (killed when not done within ``timeout``, and
    then every node's stderr tail in the failure, to say which one hung where)."""
    try:
        codes = [p.wait(timeout) for p in procs]
    except subprocess.TimeoutExpired as timed_out:
        tails = {i: (logs / f"{i}.err").read_text()[-3000:] for i in range(len(procs))}
        raise AssertionError(f"{timed_out}; stderr of each node: {tails}") from timed_out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [
        (rc, (logs / f"{i}.out").read_text(), (logs / f"{i}.err").read_text())
        for i, rc in enumerate(codes)
    ]


def test_torchrun_two_nodes_generate_the_text_of_one_process(
    tiny_path, smollm2_path, tmp_path, capsys
) -> None:
    """``pcgspec generate`` (LLM inside) with NGRAM speculation: the one rank that prints
    (rank 0, wherever the rendezvous put it) prints the tokens of the same command run in this
    process; both exit 0.
    """
    args = [
        "generate",
        *engine_flags(tiny_path, smollm2_path),
        *("--max-new-tokens", "10", "--ignore-eos", "--json"),
        *("--speculative-algorithm", "NGRAM", "--speculative-num-steps", "3"),
        *("--speculative-policy", "always"),
        *(a for p in PROMPTS for a in ("--prompt", p)),
    ]
    assert main(args) == 0
    want = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    results = finish(torchrun_nodes([*args, "--tp-size", "2"], tmp_path), tmp_path)
    assert [rc for rc, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    printed = [out for _, out, _ in results if out.strip()]
    assert len(printed) == 1, "exactly one rank (rank 0) prints"
    got = [json.loads(line)["token_ids"] for line in printed[0].splitlines()]
    assert got == want and len(got) == len(PROMPTS)
    assert any("started by torchrun" in err for _, _, err in results)
    assert any("rank 1 of 2 serving steps" in err for _, _, err in results)


def test_torchrun_two_nodes_serve_the_text_of_one_process(
    tiny_path, smollm2_path, tmp_path
) -> None:
    """``pcgspec serve`` on both nodes (static rendezvous): node 0's rank 0 serves HTTP, node
    1's rank is its worker; a SIGTERM to rank 0's server stops the worker too, and both
    torchruns exit 0.
    """
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(tokenizer=str(smollm2_path), device="cpu", dtype="float32", max_total_tokens=256)
    want = LLM(str(tiny_path), **kw).generate(PROMPTS[1], params, use_tqdm=False)[0]
    port = free_port()
    args = ["serve", *engine_flags(tiny_path, smollm2_path), "--tp-size", "2", "--port", str(port)]
    procs = torchrun_nodes(args, tmp_path, static=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, procs)
        body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(
            f"{url}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            text = json.load(response)["choices"][0]["text"]
        assert text == want.outputs[0].text
        server = _rank0_pid(procs)
        assert server in [c.pid for c in psutil.Process(procs[0].pid).children()]
        os.kill(server, signal.SIGTERM)
    finally:
        results = finish(procs, tmp_path, timeout=60)
    assert [rc for rc, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]


def _wait_healthy(url: str, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a torchrun process exited"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("the server did not become healthy")


def _rank0_pid(procs: list[subprocess.Popen]) -> int:
    """The process torchrun started with RANK=0 (the server; its engine is a child of it)."""
    for proc in procs:
        for child in psutil.Process(proc.pid).children():
            if child.environ().get("RANK") == "0":
                return child.pid
    raise LookupError("no RANK=0 process under the torchrun processes")


def test_tp_size_must_equal_the_torchrun_job_size(monkeypatch) -> None:
    assert torchrun_env() is None
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_RANK", "0")
    env = torchrun_env()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 2, 0, 1)
    with pytest.raises(ValueError, match=r"tp_size \(4\) must equal torchrun's WORLD_SIZE \(2\)"):
        EngineConfig(device="cpu", tp_size=4)
    EngineConfig(device="cpu", tp_size=2)
    EngineConfig(device="cpu", tp_size=1)  # an engine of its own on every rank
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK must be a non-negative integer"):
        torchrun_env()
