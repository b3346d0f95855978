"""CPU smoke tests of the benchmark scripts and the random-weight models they run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from script_modules import SCRIPTS, load_script

from pcgspec.models.layers.norm import RMSNorm
from pcgspec.models.random_weights import SHAPES, random_model, shape_config


def test_random_model_unknown_shape_lists_known():
    with pytest.raises(ValueError, match="llama-3.2-1b.*qwen3-8b.*smollm2-135m"):
        random_model("llama-9000", torch.float32, "cpu")


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shape_configs_build_on_meta(shape):
    """Every named shape builds (on meta: no memory) with the advertised sizes."""
    from pcgspec.models.registry import model_class

    config = shape_config(shape)
    with torch.device("meta"):
        model = model_class(config)(config)
    embed = model.model.embed_tokens.weight
    assert embed.shape == (config.vocab_size, config.hidden_size)
    assert (model.lm_head is model.model.embed_tokens) == config.tie_word_embeddings
    assert model.num_layers == config.num_hidden_layers


def test_random_model_is_seeded_and_initialized():
    a = random_model("tiny", torch.float32, "cpu", seed=1)
    b = random_model("tiny", torch.float32, "cpu", seed=1)
    c = random_model("tiny", torch.float32, "cpu", seed=2)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(
        a.model.layers[0].mlp.down_proj.weight, c.model.layers[0].mlp.down_proj.weight
    )
    for module in a.modules():
        if isinstance(module, RMSNorm):
            assert torch.all(module.weight == 1)
    std = a.model.layers[0].self_attn.qkv_proj.weight.std().item()
    assert 0.015 < std < 0.025
    inv_freq = a.model.rotary_emb.inv_freq
    assert torch.allclose(inv_freq, 1.0 / 10000.0 ** (torch.arange(0, 16, 2) / 16))


def test_bench_ttft_writes_json(tmp_path, monkeypatch):
    # NOTE: --compile-cache-dir sets these for the process; monkeypatch restores them after.
    monkeypatch.setenv("PCGSPEC_CACHE_DIR", str(tmp_path / "unused"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "unused"))
    bench = load_script("bench_ttft")
    out = tmp_path / "ttft.json"
    result = bench.main(
        [
            "--random-weights",
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--lengths",
            "8,16",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--modes",
            "eager,piecewise,extend,bound",
            "--bound-backend",
            "eager",
            "--bound-lengths",
            "16",
            "--peer",
            "hf",
            "--piecewise-cuda-graph-max-tokens",
            "16",
            "--cold-start",
            "--compile-cache-dir",
            str(tmp_path / "cache"),
            "--out",
            str(out),
        ]
    )
    written = json.loads(out.read_text())
    assert written["rows"] == json.loads(json.dumps(result["rows"]))
    for key in (
        "date",
        "device",
        "torch",
        "command",
        "model",
        "dtype",
        "settings",
        "cold_start",
        "piecewise_stats",
        "extend_stats",
        "rows",
    ):
        assert key in written, key
    assert written["settings"]["modes"] == ["eager", "piecewise", "extend", "bound", "hf"]
    assert [row["length"] for row in written["rows"]] == [8, 16]
    for row in written["rows"]:
        modes = ["eager", "piecewise", "extend", "hf"] + (["bound"] if row["length"] == 16 else [])
        assert sorted(m for m in row if m not in ("length", "ratios")) == sorted(modes)
        for mode in modes:
            assert 0 < row[mode]["median_ms"] <= row[mode]["p90_ms"]
            # Same weights, float32: every mode computes eager's logits.
            assert row[mode].get("rel_err_vs_eager", 0.0) < 1e-4
        assert math.isclose(
            row["ratios"]["piecewise/eager"],
            row["piecewise"]["median_ms"] / row["eager"]["median_ms"],
        )
    assert written["cold_start"]["load_s"] > 0
    assert written["cold_start"]["piecewise_runner_s"] > 0
    assert written["cold_start"]["piecewise_runner_warm_cache_s"] > 0
    for name in ("piecewise_stats", "extend_stats"):  # extend mode never reached the pieces
        stats = written[name]
        assert stats["runs"] == 2 * (1 + 2), name  # 2 lengths x (warm-up + repeats)
        assert not any(stats["fallbacks"].values()), name


def test_bench_ttft_sliding_windows(tmp_path, monkeypatch):
    """Gemma 3's layout (a 4-token window, shorter than the prompts): piecewise and the
    whole-graph bound compute eager's logits, windows included."""
    monkeypatch.setenv("PCGSPEC_CACHE_DIR", str(tmp_path / "cache"))
    bench = load_script("bench_ttft")
    out = tmp_path / "ttft.json"
    result = bench.main(
        [
            "--random-weights",
            "--shape",
            "tiny-gemma3",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--lengths",
            "8,16",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--bound-backend",
            "eager",
            "--bound-lengths",
            "8,16",
            "--piecewise-cuda-graph-max-tokens",
            "16",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["model"] == "tiny-gemma3"
    for row in result["rows"]:
        for mode in ("piecewise", "bound"):
            assert row[mode]["rel_err_vs_eager"] < 1e-4, (row["length"], mode)
        assert row["ratios"]["piecewise/bound"] > 0


def test_bench_spec_writes_json(tmp_path, cut_smollm2_path, monkeypatch):
    # NOTE: the rows, not the piecewise path (traced twice, one per engine): prefill eager; nor
    # the model's text: a --model folder, SmolLM2 cut to its first layers (conftest)
    monkeypatch.setenv("PCGSPEC_CPU_PIECEWISE", "0")
    bench = load_script("bench_spec")
    out = tmp_path / "spec.json"
    result = bench.main(
        [
            "--model",
            str(cut_smollm2_path),
            "--methods",
            "NGRAM",
            "--batch-sizes",
            "2,4",
            "--max-tokens",
            "6",
            "--repeats",
            "1",
            "--prompts",
            "general",
            "--out",
            str(out),
        ]
    )
    written = json.loads(out.read_text())
    assert written["rows"] == json.loads(json.dumps(result["rows"]))
    for key in ("date", "device", "torch", "command", "model", "num_steps", "policy"):
        assert key in written, key
    rows = {(r["batch"], r["method"]): r for r in written["rows"]}
    assert sorted(rows) == [(2, "NGRAM"), (2, "none"), (4, "NGRAM"), (4, "none")]
    for batch in (2, 4):
        plain, ngram = rows[(batch, "none")], rows[(batch, "NGRAM")]
        assert plain["batches"] == ngram["batches"] == 4 // batch  # 4 general prompts covered
        assert plain["speedup"] == 1.0 and plain["tok_s"] > 0 and plain["decode_step_ms"] > 0
        assert math.isclose(ngram["speedup"], ngram["tok_s"] / plain["tok_s"])
        for key in ("spec_step_ms", "synced_step_ms", "draft_ms", "verify_ms"):
            assert ngram[key] > 0, key
        assert math.isclose(
            ngram["host_ms"], ngram["synced_step_ms"] - ngram["draft_ms"] - ngram["verify_ms"]
        )
        for row in (plain, ngram):  # the host's parts of a decode step, plain ones included
            assert row["launch_ms"] > 0 and row["wait_ms"] >= 0 and row["read_ms"] > 0
            assert math.isclose(row["host_step_ms"], row["launch_ms"] + row["read_ms"])
        assert math.isclose(
            ngram["host_step_vs_plain"], ngram["host_step_ms"] / plain["host_step_ms"]
        )
        assert ngram["speculative_steps"] + ngram["policy_plain_steps"] > 0
    from pcgspec.engine.overlap import LaunchedStep  # the patches are gone
    from pcgspec.speculative.worker import LaunchedSpecStep

    assert LaunchedSpecStep.read.__qualname__ == "LaunchedSpecStep.read"
    assert LaunchedStep.read.__qualname__ == "LaunchedStep.read"
    assert LaunchedStep.wait.__qualname__ == "LaunchedStep.wait"


def test_bench_spec_in_flight_load(tmp_path, smollm2_path, monkeypatch):
    """--in-flight: a batch size is the requests in flight of a load given at once (the served
    benchmark's chat requests here), so 12 requests at most 4 running need at least 3 prefill
    steps per generation; rows count the kinds of steps. The schedulers' limits come back."""
    monkeypatch.setenv("PCGSPEC_CPU_PIECEWISE", "0")
    bench = load_script("bench_spec")
    out = tmp_path / "in_flight.json"

    def run(policy: str) -> dict:
        args = ["--random-weights", "tiny", "--methods", "NGRAM", "--prompts", "served-chat"]
        args += ["--in-flight", "--load-requests", "12", "--batch-sizes", "4", "--max-tokens"]
        return bench.main([*args, "6", "--repeats", "1", "--policy", policy, "--out", str(out)])

    # NOTE: whether the auto policy probes speculation within the timed generation of a load
    # where it never pays depends on the step times; always speculating, it must be counted
    always = run("always")
    assert "speculative" in {k for r in always["rows"] for k in r["step_kinds"]}
    result = run("auto")
    assert json.loads(out.read_text())["load"] == "12 requests, batch = in flight"
    for row in result["rows"]:
        assert row["prompts"] == "served-chat"
        assert (row["batch"], row["batches"], row["requests"]) == (4, 1, 12)
        kinds = row["step_kinds"]
        assert kinds["prefill"]["steps"] >= 3, kinds  # one generation timed: 12 / 4 admissions
        assert all(k["ms_per_call"] > 0 for k in kinds.values())
    (ngram,) = [r for r in result["rows"] if r["method"] == "NGRAM"]
    choices = ngram["policy_choices"]  # the policy's choices of the timed generation
    assert choices and set(choices) <= {1, 2, 4}
    chosen = sum(c["speculative"] + c["plain"] for c in choices.values())
    decode = sum(
        ngram["step_kinds"].get(k, {"steps": 0})["steps"] for k in ("decode", "speculative")
    )
    assert 0 < chosen <= decode  # NOTE: near max_tokens a step falls back without a choice

    from types import SimpleNamespace

    from pcgspec.engine.kv_pool import PagePool
    from pcgspec.engine.scheduler import Scheduler

    scheduler = Scheduler(PagePool(8), 4, 256, 1024)
    engines = {"none": SimpleNamespace(engine=SimpleNamespace(scheduler=scheduler))}
    with bench.running_at_most(engines, 64):
        assert (scheduler.max_running_requests, scheduler.admission_group) == (64, 4)
    assert (scheduler.max_running_requests, scheduler.admission_group) == (256, 16)


ACCEPT_FILE = "bench/results/accept_standalone_qwen2.5-coder-0.5b-1.5b_cpu_2026-11-28.json"


def test_bench_spec_standalone_random_pair_estimate(tmp_path, smollm2_path, monkeypatch):
    """A random-weight target and a random-weight STANDALONE draft of another shape (Gemma 3's
    layout, sliding windows included): the step times and the speedup estimate at the accept
    lengths of a measure_accept.py file."""
    monkeypatch.setenv("PCGSPEC_CPU_PIECEWISE", "0")
    bench = load_script("bench_spec")
    out = tmp_path / "pair.json"
    accept = Path(__file__).resolve().parent.parent / ACCEPT_FILE
    result = bench.main(
        [
            "--random-weights",
            "tiny",
            "--standalone-draft-shape",
            "tiny-gemma3",
            "--methods",
            "STANDALONE",
            "--policy",
            "always",
            "--batch-sizes",
            "1",
            "--prompts",
            "general",
            "--max-tokens",
            "6",
            "--repeats",
            "1",
            "--cuda-graph-max-bs",
            "4",
            "--accept-lengths",
            str(accept),
            "--out",
            str(out),
        ]
    )
    written = json.loads(out.read_text())
    assert written["standalone_draft"] == "tiny-gemma3 (random weights)"
    estimate = written["estimate"]
    assert estimate["accept_lengths"] == {"code": 4.2449, "chat": 3.0301}
    assert "accept_length * t_plain / t_spec_step" in estimate["how"]
    (row,) = estimate["rows"]
    rows = {r["method"]: r for r in result["rows"]}
    assert row["plain_step_ms"] == rows["none"]["decode_step_ms"] > 0
    assert row["spec_step_ms"] == rows["STANDALONE"]["spec_step_ms"] > 0
    for name, length in estimate["accept_lengths"].items():
        want = length * row["plain_step_ms"] / row["spec_step_ms"]
        assert math.isclose(row["speedup"][name], want)
    with pytest.raises(ValueError, match="measure_accept.py output"):
        bench.speed_estimate(result["rows"], out)


def test_profile_spec_step_writes_json(tmp_path, smollm2_path):
    profile = load_script("profile_spec_step")
    out = tmp_path / "profile.json"
    result = profile.main(
        [
            "--shape",
            "tiny",
            "--methods",
            "NGRAM",
            "--batch-sizes",
            "1,2",
            "--max-tokens",
            "8",
            "--repeats",
            "1",
            "--out",
            str(out),
            "--cprofile",
            str(tmp_path / "cprofile"),
            "--host-stages",
        ]
    )
    written = json.loads(out.read_text())
    assert written["rows"] == json.loads(json.dumps(result["rows"]))
    rows = {(r["engine"], r["batch"]): r for r in written["rows"]}
    assert sorted(rows) == [("NGRAM", 1), ("NGRAM", 2), ("none", 1), ("none", 2)]
    for (engine, batch), row in rows.items():
        assert row["decode_steps"] > 0 and row["step_ms_median"] > 0
        plain = rows[("none", batch)]["step_ms_median"]
        assert math.isclose(row["step_vs_plain_step"], row["step_ms_median"] / plain)
        assert row["gpu_busy_ms_per_step"] is None and row["kernel_launches"] is None  # CPU
        assert row["gpu_top_us_per_step"] is None
        assert (row["spec"].get("verify_steps", 0) > 0) == (engine == "NGRAM")
        stages = row["host_stages_us_per_step"]  # per engine step, dearest first
        assert stages["Engine.step"]["calls"] == 1.0 and next(iter(stages)) == "Engine.step"
        assert ("SpecWorker.launch" in stages) == (engine == "NGRAM")
        assert 0 < stages["ModelRunner.forward"]["us"] < stages["Engine.step"]["us"]
    from pcgspec.engine.engine import Engine

    assert Engine.step.__qualname__ == "Engine.step"  # the stages' wrappers are gone
    assert not hasattr(Engine.step, "__wrapped__")
    assert sorted(p.name for p in (tmp_path / "cprofile").iterdir()) == [
        "NGRAM_1.prof",
        "NGRAM_2.prof",
        "none_1.prof",
        "none_2.prof",
    ]


def test_profile_spec_step_at_two_tp_sizes(tmp_path, smollm2_path, monkeypatch):
    """--tp-sizes 1,2: every engine at both sizes (EAGLE3 drafting on rank 0 at TP=2); each row
    over plain decoding at its own size, and a TP=2 row over the same engine at TP=1."""
    # NOTE: the decode steps, not the piecewise path (traced per engine, per rank): prefill eager
    monkeypatch.setenv("PCGSPEC_CPU_PIECEWISE", "0")
    profile = load_script("profile_spec_step")
    argv = ["--shape", "tiny", "--methods", "EAGLE3", "--batch-sizes", "1", "--max-tokens", "6"]
    result = profile.main([*argv, "--repeats", "1", "--tp-sizes", "1,2", "--num-steps", "2"])
    rows = {(r["tp"], r["engine"]): r for r in result["rows"]}
    assert sorted(rows) == [(1, "EAGLE3"), (1, "none"), (2, "EAGLE3"), (2, "none")]
    assert result["tp_sizes"] == [1, 2]
    for (tp, engine), row in rows.items():
        ms = row["step_ms_median"]
        assert math.isclose(row["step_vs_plain_step"], ms / rows[(tp, "none")]["step_ms_median"])
        assert (row["spec"].get("verify_steps", 0) > 0) == (engine == "EAGLE3")
        if tp == 1:
            assert "step_vs_tp1" not in row
        else:
            assert math.isclose(row["step_vs_tp1"], ms / rows[(1, engine)]["step_ms_median"])
    with pytest.raises(SystemExit):
        profile.main([*argv, "--tp-sizes", "2,2"])


def test_profile_spec_step_without_plain_engines_writes_after_each(
    tmp_path, smollm2_path, monkeypatch
):
    """--no-plain: the methods' engines only (no step_vs_plain_step); --out holds the rows of
    every engine done so far (``complete`` false until the last)."""
    profile = load_script("profile_spec_step")
    out, written = tmp_path / "p.json", []
    write = profile._result

    def recording(args, rows, complete):
        result = write(args, rows, complete)
        written.append(json.loads(out.read_text()))
        return result

    monkeypatch.setattr(profile, "_result", recording)
    argv = ["--shape", "tiny", "--methods", "EAGLE3,NGRAM", "--batch-sizes", "1"]
    argv += ["--max-tokens", "6", "--repeats", "1", "--num-steps", "2", "--no-plain"]
    result = profile.main([*argv, "--out", str(out)])
    assert [r["engine"] for r in result["rows"]] == ["EAGLE3", "NGRAM"]
    assert all(r["step_vs_plain_step"] is None for r in result["rows"])
    assert [(w["complete"], len(w["rows"])) for w in written] == [(False, 1), (False, 2), (True, 2)]
    assert written[-1]["rows"] == json.loads(json.dumps(result["rows"]))


def test_profile_spec_step_ranks_gpu_activities_by_time():
    """The dearest GPU activities by name, microseconds per engine step; host events aside."""
    profile = load_script("profile_spec_step")

    def event(name, start, end, cuda=True):
        kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        return SimpleNamespace(
            name=name, device_type=kind, time_range=SimpleNamespace(start=start, end=end)
        )

    events = [event("gemm", 0, 30), event("attn", 30, 40), event("gemm", 40, 50)]
    events.append(event("cudaLaunchKernel", 0, 500, cuda=False))
    assert profile._top_activities(events, steps=2, top=1) == {"gemm": 20.0}
    assert profile._top_activities(events, steps=2) == {"gemm": 20.0, "attn": 5.0}
    events.append(event("attn", 50, 51))
    events.append(event("attn", 51, 52))
    assert profile._top_counts(events, steps=2) == {"attn": 1.5, "gemm": 1.0}


def test_profile_spec_step_profiles_a_tree_beside_the_chain(tmp_path, smollm2_path, monkeypatch):
    """``EAGLE3:D/K/N`` is an EAGLE3 engine drafting a tree of that shape, profiled beside the
    chain; a malformed tree is refused before any engine starts."""
    monkeypatch.setenv("PCGSPEC_CPU_PIECEWISE", "0")  # NOTE: the decode steps: prefill eager
    profile = load_script("profile_spec_step")
    argv = ["--shape", "tiny", "--batch-sizes", "1", "--max-tokens", "6", "--repeats", "1"]
    result = profile.main([*argv, "--methods", "EAGLE3,EAGLE3:2/2/4", "--num-steps", "3"])
    rows = {r["engine"]: r for r in result["rows"]}
    assert sorted(rows) == ["EAGLE3", "EAGLE3:2/2/4", "none"]
    for name, depth in (("EAGLE3", 3), ("EAGLE3:2/2/4", 2)):  # the tree's depth, not k's
        assert rows[name]["spec"]["verify_steps"] > 0
        assert len(rows[name]["spec"]["accepted_per_position"]) == depth
    assert profile.tree_kwargs("5/4/16") == {
        "speculative_num_steps": 5,
        "speculative_eagle_topk": 4,
        "speculative_num_draft_tokens": 16,
    }
    with pytest.raises(SystemExit):
        profile.main([*argv, "--methods", "EAGLE3:5/4"])


def test_profile_spec_step_in_flight_splits_host_stages_by_kind(tmp_path, smollm2_path):
    """--in-flight: a load of --load-requests prompts, at most B running; the host stages of
    every step and of each kind of step apart, whose steps add up."""
    profile = load_script("profile_spec_step")
    argv = ["--shape", "tiny", "--methods", "NGRAM", "--batch-sizes", "2", "--max-tokens", "6"]
    argv += ["--repeats", "1", "--in-flight", "--load-requests", "5", "--host-stages"]
    result = profile.main([*argv, "--prompts", "served-chat", "--out", str(tmp_path / "p.json")])
    assert result["load"] == "5 requests, batch = in flight"
    for row in result["rows"]:
        kinds = row["host_stages_by_kind"]
        spec = "speculative" if row["engine"] == "NGRAM" else "decode"
        assert spec in kinds and ("mixed" in kinds or "prefill" in kinds), sorted(kinds)
        assert set(kinds) <= {
            "prefill",
            "mixed",
            "decode",
            "speculative",
            "first_tokens",
            "read_only",
        }
        # every request was prefilled; B=2 at most ran at once, so some joined running ones
        assert sum(kinds[k]["steps"] for k in ("prefill", "mixed") if k in kinds) >= 3
        assert ("SpecWorker.launch" in kinds[spec]["stages"]) == (row["engine"] == "NGRAM")
        assert "SpecWorker.launch" not in kinds.get("mixed", {"stages": {}})["stages"]
        every = row["host_stages_us_per_step"]["Engine.step"]
        steps = sum(k["steps"] for k in kinds.values())
        us = sum(k["steps"] * k["stages"]["Engine.step"]["us"] for k in kinds.values())
        assert every["calls"] == 1.0 and math.isclose(every["us"] * steps, us, rel_tol=0.01)


TP_SMOKE = "--device cpu --shape tiny --prefill-tokens 64 --context 64 --whole-tokens 16,32"
TP_SMOKE += " --warmup 1 --repeats 2"


@pytest.fixture(scope="module")
def tp_stopped(tmp_path_factory) -> tuple[dict, dict[int, dict]]:
    """bench_tp's smoke run stopped in its SPMD part (a time limit, a failure): what it wrote,
    and its engine parts' results by TP size, each from its fresh process (reused below)."""
    out, parts = tmp_path_factory.mktemp("tp") / "tp.json", {}
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(SCRIPTS))  # its imports, here and in the spawned ranks
        bench = load_script("bench_tp")
        run = bench.run

        def recorded(target, args, tp):  # noqa: ANN001, ANN202
            parts[tp] = run(target, args, tp)
            return parts[tp]

        def stopped(args):  # noqa: ANN001, ANN202
            raise TimeoutError("stopped in the SPMD part")

        patch.setattr(bench, "run", recorded)
        patch.setattr(bench, "run_spmd", stopped)
        with pytest.raises(TimeoutError):
            bench.main([*TP_SMOKE.split(), "--out", str(out)])
    return json.loads(out.read_text()), parts


def test_bench_tp_writes_json(tmp_path, monkeypatch, tp_stopped):
    """TP=1 and TP=2 engines (the stopped run's, above), then the SPMD part (whole vs
    piecewise, decode without the broadcast), each in fresh processes over gloo; ratios and
    diagnostics from their medians."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    bench = load_script("bench_tp")
    parts = tp_stopped[1]
    monkeypatch.setattr(bench, "run", lambda target, args, tp: parts[tp])
    out = tmp_path / "tp.json"
    result = bench.main([*TP_SMOKE.split(), "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["complete"]
    assert written["ratios"] == pytest.approx(result["ratios"])
    single, split = written["runs"]
    assert (single["tp"], split["tp"]) == (1, 2)
    assert written["ratios"]["decode_bs32"] == pytest.approx(
        split["decode_bs32"]["median_ms"] / single["decode_bs32"]["median_ms"]
    )
    assert written["met"].keys() == written["targets"].keys() == bench.TARGETS[2].keys()
    assert [r["tokens"] for r in written["whole_vs_piecewise"]] == [16, 32]
    spmd = written["decode_bs1_spmd"]["median_ms"]
    assert spmd > 0 and written["diagnostics"] == pytest.approx(
        {
            "decode_spmd": spmd / single["decode_bs1"]["median_ms"],
            "decode_over_spmd": split["decode_bs1"]["median_ms"] / spmd,
        }
    )
    assert set(written["met"]) == set(written["targets"]) == set(written["ratios"])


def test_random_weights_folder_serves_with_the_tokenizer(tmp_path, smollm2_path):
    """bench_serving's --random-weights folder: written once, then reused; the shape with the
    default tokenizer's files and vocabulary; our greedy tokens equal transformers' on it."""
    from oracle import assert_greedy_match, greedy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pcgspec import LLM

    bench = load_script("bench_serving")
    with pytest.raises(SystemExit):
        bench.parse_args(["--random-weights", "tiny"])  # needs --launch
    args = bench.parse_args(
        ["--launch", "--random-weights", "tiny", "--random-weights-dir", str(tmp_path / "tiny")]
    )
    folder = bench.random_weights_dir(args)
    weights = folder / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert bench.random_weights_dir(args) == folder and weights.stat().st_mtime_ns == written
    assert not (tmp_path / "tiny.partial").exists()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer) == 49152 != SHAPES["tiny"][1]["vocab_size"]
    assert config["hidden_size"] == SHAPES["tiny"][1]["hidden_size"]
    copied = folder / "tokenizer.json"
    assert copied.read_bytes() == (smollm2_path / "tokenizer.json").read_bytes()
    prompt = tokenizer.encode("The capital of France is")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0]
    out = LLM(str(folder), dtype="float32", device="cpu").generate(
        {"prompt_token_ids": prompt}, greedy(6), use_tqdm=False
    )[0]
    assert_greedy_match(hf, prompt, out.token_ids, ref[len(prompt) :].tolist())


def test_model_runner_rejects_a_model_of_another_dtype():
    from pcgspec.config import EngineConfig
    from pcgspec.runners.model_runner import ModelRunner

    config = EngineConfig(
        device="cpu", dtype="float32", disable_piecewise_cuda_graph=True, max_total_tokens=64
    )
    with pytest.raises(ValueError, match="bfloat16"):
        ModelRunner(config, model=random_model("tiny", torch.bfloat16, "cpu"))
    runner = ModelRunner(config, model=random_model("tiny", torch.float32, "cpu"))
    assert runner.kv_cache.num_slots == 64


def test_bench_engine_writes_json(tmp_path):
    bench = load_script("bench_engine")
    out = tmp_path / "engine.json"
    result = bench.main(
        [
            "--models",
            "tiny",
            "--batch-sizes",
            "1,3",
            "--context",
            "20",
            "--steps",
            "4",
            "--repeats",
            "2",
            "--graph-repeats",
            "3",
            "--warmup",
            "2",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    written = json.loads(out.read_text())
    assert written["rows"] == json.loads(json.dumps(result["rows"]))
    for key in ("date", "device", "torch", "command", "model", "context", "steps", "rows"):
        assert key in written, key
    assert [(r["model"], r["batch"]) for r in written["rows"]] == [("tiny", 1), ("tiny", 3)]
    for row in written["rows"]:
        for schedule in ("overlap", "sync"):
            step = row[f"{schedule}_ms"]
            assert step > 0 and math.isclose(row[f"{schedule}_vs_graph"], row["graph_ms"] / step)
            parts = row["parts_ms"][schedule]
            assert parts["forward"] > 0 and parts["schedule"] > 0 and parts["build"] > 0
            assert math.isclose(sum(parts[k] for k in bench.PARTS), parts["step"])


def test_bench_extend_prefix_writes_json(tmp_path):
    """Every variant of each case is timed and computes whole's output (float32, interpreter)."""
    bench = load_script("bench_extend_prefix")
    out = tmp_path / "extend.json"
    bench.main(
        [
            "--shapes",
            "tiny",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--requests",
            "1,2",
            "--prefix",
            "40",
            "--new",
            "3",
            "--splits",
            "2,3",
            "--page-size",
            "4",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--launches",
            "1",
            "--out",
            str(out),
        ]
    )
    written = json.loads(out.read_text())
    assert written["command"].startswith("scripts/bench_extend_prefix.py --shapes tiny")
    assert [(r["requests"], r["prefix"]) for r in written["rows"]] == [(1, 40), (2, 40)]
    for row in written["rows"]:
        assert {n: row[n]["splits"] for n in ("auto", "whole", "splits_2", "splits_3")} == {
            "auto": 1,
            "whole": 1,
            "splits_2": 2,
            "splits_3": 3,
        }
        assert all(
            row[n]["host_us"] > 0 and row[n]["vs_whole"] > 0
            for n in ("auto", "whole", "splits_2", "splits_3")
        )
        assert row["max_abs_diff_vs_whole"] < 1e-5


def test_bench_spec_runs_tree_drafting(tmp_path, cut_smollm2_path, monkeypatch):
    """``--eagle-topk`` / ``--num-draft-tokens`` shape every EAGLE3 engine's tree, a method
    ``EAGLE3:D/K/N`` one engine's (beside the others in the same run); rows name their shapes
    and report accept lengths. Untrained heads, on SmolLM2 cut to its first layers."""
    monkeypatch.setenv("PCGSPEC_CPU_PIECEWISE", "0")
    bench = load_script("bench_spec")
    out = tmp_path / "tree.json"
    args = ["--model", str(cut_smollm2_path), "--methods", "EAGLE3:untrained,EAGLE3:2/3/6"]
    args += ["--num-steps", "3", "--eagle-topk", "2", "--num-draft-tokens", "5"]
    args += ["--batch-sizes", "4", "--max-tokens", "6", "--repeats", "1", "--prompts", "general"]
    result = bench.main(
        [*args, "--out", str(out), "--policy", "always", "--eagle3-draft-vocab", "1024"]
    )
    assert (result["eagle_topk"], result["num_draft_tokens"]) == (2, 5)
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["EAGLE3:untrained"]["draft_shape"] == "3/2/5"
    assert rows["EAGLE3:2/3/6"]["draft_shape"] == "2/3/6"
    for method in ("EAGLE3:untrained", "EAGLE3:2/3/6"):
        assert rows[method]["avg_accept_length"] >= 1.0 and rows[method]["speculative_steps"] > 0
    with pytest.raises(SystemExit):
        bench.main([*args[:3], "EAGLE3:2/3", "--out", str(out)])


def test_check_spec_ties_finds_float32_equal(tmp_path, monkeypatch):
    """In float32 the shipped head's chain and tree give plain decoding's tokens: no divergence
    to explain, and the JSON says so."""
    monkeypatch.setenv("PCGSPEC_CPU_PIECEWISE", "0")  # NOTE: the outputs, not the piecewise path
    check = load_script("check_spec_ties")
    out = tmp_path / "ties.json"
    argv = ["--dtype", "float32", "--num-requests", "2", "--max-tokens", "12", "--out", str(out)]
    report = check.main(argv)
    assert set(report["results"]) == {"chain", "tree"}
    rows = [row for rows in report["results"].values() for row in rows]
    assert len(rows) == 4 and all(row == {"equal": True, "tokens": 12} for row in rows)
    assert json.loads(out.read_text())["dtype"] == "float32"


def test_check_spec_ties_scores_a_served_text_check(tmp_path):
    """``--served``: each configuration's texts against the first configuration's, per dataset;
    equal texts say so, a departure names the first differing token of the re-tokenized texts
    and the model's top two at the plain prefix."""
    from transformers import AutoTokenizer

    from pcgspec.models.default_model import default_model_path

    check = load_script("check_spec_ties")
    base = ["The capital of France is Paris.", "Water boils at 100 degrees."]
    other = [base[0], "Water boils at one hundred degrees."]
    served = tmp_path / "served.json"
    served.write_text(
        json.dumps({"text_check": {"chat": {"plain": {"texts": base}, "eagle3": {"texts": other}}}})
    )
    out = tmp_path / "ties.json"
    report = check.main(["--served", str(served), "--dtype", "float32", "--out", str(out)])
    equal, departed = report["results"]["eagle3"]["chat"]
    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    assert equal == {"equal": True, "tokens": len(tok.encode(base[0], add_special_tokens=False))}
    want, got = (tok.encode(t, add_special_tokens=False) for t in (base[1], other[1]))
    at = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
    assert (departed["at"], departed["plain"], departed["speculative"]) == (at, want[at], got[at])
    assert len(departed["top2"]) == 2 and departed["top2_gap"] >= 0
    assert json.loads(out.read_text())["served"] == str(served)


def test_bench_tp_keeps_the_engine_parts_of_a_run_stopped_in_the_spmd_part(tp_stopped):
    """The engine parts' ratios are written before the slow SPMD part starts: a run stopped
    in it (a time limit, a failure) still leaves them, marked incomplete."""
    written = tp_stopped[0]
    assert not written["complete"] and written["diagnostics"] == {}
    assert [run["tp"] for run in written["runs"]] == [1, 2]
    assert set(written["ratios"]) == {"startup", "decode", "decode_bs32", "prefill"}
    assert written["met"].keys() == written["targets"].keys() == written["ratios"].keys()
