"""``pcgspec train-eagle3``: prompts -> generate (+ capture) -> train -> export, each phase
timed, the numbers in ``train_summary.json``.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pcgspec.config import EngineConfig
from pcgspec.training.data import draft_vocabulary, read_index, split_sizes
from pcgspec.training.options import TrainOptions
from pcgspec.training.prompts import PROMPTS_FILE, build_prompts, load_prompts, save_prompts

if TYPE_CHECKING:
    from pcgspec.llm import LLM

logger = logging.getLogger("pcgspec")
SUMMARY_FILE = "train_summary.json"


def run(opts: TrainOptions) -> dict:
    """Run the phases of ``opts``; returns (and writes) the summary."""
    work = Path(opts.work_dir).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    data_dir, times = work / "data", {}
    summary: dict = {"options": {k: v for k, v in vars(opts).items()}, "times_s": times}
    llm: LLM | None = None

    def engine() -> LLM:
        nonlocal llm
        if llm is None:
            start = time.perf_counter()
            llm = generation_llm(opts)
            times["engine_start"] = time.perf_counter() - start
        return llm

    if "prompts" in opts.phases:
        start = time.perf_counter()
        prompts = build_prompts(
            opts.num_prompts, opts.self_prompt_fraction, opts.seed, engine, opts.raw_prompt_fraction
        )
        save_prompts(work / PROMPTS_FILE, prompts)
        times["prompts"] = time.perf_counter() - start
    if "generate" in opts.phases:
        from pcgspec.training.generate import write_dataset

        prompts = load_prompts(work / PROMPTS_FILE)
        phase = write_dataset(
            engine(),
            prompts,
            data_dir,
            max_tokens=opts.max_tokens,
            temperature=opts.temperature,
            seed=opts.seed,
            eval_fraction=opts.eval_fraction,
            pass_tokens=opts.capture_tokens,
            shard_tokens=opts.shard_tokens,
        )
        times.update({k.removesuffix("_s"): v for k, v in phase.items()})
    if llm is not None:
        del llm  # NOTE: frees the engine's KV cache before training
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if "train" in opts.phases:
        summary["train"] = train_head(opts, data_dir, work / "checkpoints")
        times["train"] = summary["train"].pop("train_s")
    if data_dir.joinpath("index.json").is_file():
        summary["data"] = split_sizes(read_index(data_dir))
        summary["data"]["bytes"] = sum(f.stat().st_size for f in data_dir.iterdir())
    _write_summary(summary, work, opts)
    return summary


def generation_llm(opts: TrainOptions) -> LLM:
    """The target as an engine that also captures the EAGLE3 aux layers' inputs. Decode runs
    in CUDA graphs; prefill eagerly (NOTE: the piecewise compile would cost more start-up time
    than it saves on a few thousand prompts).
    """
    from pcgspec.llm import LLM
    from pcgspec.models.eagle3 import default_aux_layers
    from pcgspec.models.loader import load_config, resolve_model_dir

    layers = load_config(resolve_model_dir(opts.model)).num_hidden_layers
    return LLM(
        opts.model,
        tokenizer=opts.tokenizer,
        device=opts.device,
        random_seed=opts.seed,
        aux_hidden_state_layers=default_aux_layers(layers),
        max_running_requests=opts.gen_batch_size,
        cuda_graph_max_bs=opts.gen_batch_size,
        mem_fraction_static=opts.mem_fraction_static,
        disable_piecewise_cuda_graph=True,
    )


def train_head(opts: TrainOptions, data_dir: Path, ckpt_dir: Path) -> dict:
    """Train on ``data_dir`` and export the head to ``opts.out``; the run's numbers."""
    from pcgspec.models.loader import load_model
    from pcgspec.training.model import build_trainable_head, export_head
    from pcgspec.training.trainer import Trainer

    index = read_index(data_dir)
    meta = index["metadata"]
    device = EngineConfig(device=opts.device).torch_device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_model(meta["target"], dtype, device)
    if target.hidden_size != meta["hidden_size"] or target.vocab_size != meta["vocab_size"]:
        raise ValueError(f"{meta['target']} is not the target {data_dir} was captured from")
    draft_ids = draft_vocabulary(data_dir, index, opts.draft_vocab_size, target.vocab_size)
    head = build_trainable_head(
        target, draft_ids, meta["aux_hidden_state_layers"], opts.seed, opts.head_intermediate_size
    )
    trainer = Trainer(head, opts, data_dir, index, ckpt_dir)
    if opts.resume:
        trainer.resume()
    else:
        for stale in ckpt_dir.glob("step-*.pt"):  # NOTE: a fresh run starts its checkpoints over
            stale.unlink()
    result = trainer.train()
    if opts.save_every:
        trainer.save()
    out = export_head(head, Path(opts.out).expanduser())
    result["head_bytes"] = (out / "model.safetensors").stat().st_size
    result["draft_vocab_size"] = len(draft_ids)
    result["out"] = str(out)
    return result


def _write_summary(summary: dict, work: Path, opts: TrainOptions) -> None:
    text = json.dumps(summary, indent=1, default=str) + "\n"
    (work / SUMMARY_FILE).write_text(text)
    if opts.out and Path(opts.out).expanduser().is_dir():
        (Path(opts.out).expanduser() / SUMMARY_FILE).write_text(text)
    line = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in summary["times_s"].items())
    print(f"phase times: {line}")
    data = summary.get("data")
    if data:
        print(
            f"data: {data['train']['sequences']} train / {data['eval']['sequences']} held-out "
            f"sequences, {data['train']['response_tokens']} train response tokens, "
            f"{data['bytes'] / 2**30:.2f} GiB"
        )
    final = (summary.get("train") or {}).get("final_eval")
    if final:
        from pcgspec.training.trainer import CHAT_EVAL_TOKENS

        _print_eval("held-out", final)
        window = f"held-out, chat template, first {CHAT_EVAL_TOKENS} response tokens:"
        _print_eval(window, final.get("chat64"))
    print(f"summary: {work / SUMMARY_FILE}")


def _print_eval(name: str, result: dict | None) -> None:
    if not result:
        print(f"{name} no such sequences")
        return
    accuracy = "/".join(f"{a:.2f}" for a in result["accuracy"])
    by_k = " ".join(f"k={k}: {a:.2f}" for k, a in enumerate(result["accept_length_by_k"], 1))
    print(f"{name} accuracy per step {accuracy}; estimated accept length {by_k}")
