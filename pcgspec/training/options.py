"""``pcgspec train-eagle3`` options: one frozen dataclass (validated, errors name the flag) and
its argparse flags. Imports no torch, so ``pcgspec --help`` stays fast.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

PHASES = ("prompts", "generate", "train")


@dataclass(frozen=True)
class TrainOptions:
    work_dir: str  # prompts.jsonl, data/ (shards + index.json), checkpoints/, train_summary.json
    out: str | None = None  # the exported head folder (needed by the train phase)
    model: str | None = None  # the target; None = the embedded default model
    tokenizer: str | None = None  # None = the target's
    phases: tuple[str, ...] = PHASES
    device: str = "auto"
    seed: int = 0
    # prompts
    num_prompts: int = 4000
    self_prompt_fraction: float = 0.2
    raw_prompt_fraction: float = 0.0
    # generate + capture
    max_tokens: int = 256
    temperature: float = 0.0
    gen_batch_size: int = 128
    mem_fraction_static: float = 0.5
    eval_fraction: float = 0.05
    capture_tokens: int = 8192
    shard_tokens: int = 262144
    # train
    draft_vocab_size: int = 8192
    head_intermediate_size: int | None = None  # None: the target's
    ttt_steps: int = 7
    step_decay: float = 0.8
    epochs: int = 3
    max_steps: int | None = None
    max_train_seconds: float | None = None
    batch_tokens: int = 8192
    compile: bool | None = None  # None: on CUDA
    lr: float = 5e-4
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    eval_every: int = 200
    save_every: int = 500
    log_every: int = 10
    resume: bool = False

    def __post_init__(self) -> None:
        phases = self.phases
        if isinstance(phases, str):
            phases = tuple(p.strip() for p in phases.split(",") if p.strip())
            object.__setattr__(self, "phases", phases)
        if not phases or any(p not in PHASES for p in phases):
            raise bad(
                "phases",
                f"must be a comma-separated subset of {','.join(PHASES)}",
                ",".join(phases),
            )
        if not isinstance(self.work_dir, str) or not self.work_dir:
            raise bad("work_dir", "must be a folder path", self.work_dir)
        if "train" in phases and not self.out:
            raise bad("out", "is required by the train phase (the exported head folder)", self.out)
        for name in (
            "num_prompts",
            "max_tokens",
            "gen_batch_size",
            "capture_tokens",
            "shard_tokens",
            "draft_vocab_size",
            "ttt_steps",
            "epochs",
            "batch_tokens",
            "log_every",
        ):
            _check_int(self, name, 1)
        for name in ("eval_every", "save_every"):
            _check_int(self, name, 0)
        for name in ("max_steps", "head_intermediate_size"):
            if getattr(self, name) is not None:
                _check_int(self, name, 1)
        for name, low, high in (
            ("self_prompt_fraction", 0.0, 1.0),
            ("raw_prompt_fraction", 0.0, 1.0),
            ("eval_fraction", 0.0, 0.5),
            ("warmup_ratio", 0.0, 1.0),
            ("step_decay", 1e-6, 1.0),
            ("mem_fraction_static", 1e-3, 0.999),
        ):
            _check_float(self, name, low, high)
        for name in ("temperature", "weight_decay"):
            _check_float(self, name, 0.0, float("inf"))
        for name in ("lr", "max_grad_norm"):
            _check_float(self, name, 1e-12, float("inf"))
        if self.compile is not None and not isinstance(self.compile, bool):
            raise bad("compile", "must be true, false or None (on CUDA)", self.compile)
        if self.max_train_seconds is not None:
            _check_float(self, "max_train_seconds", 1e-3, float("inf"))
        from pcgspec.config import EngineConfig

        EngineConfig(device=self.device)  # NOTE: checks the device (and CUDA) before any work

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainOptions:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def bad(name: str, why: str, value: Any) -> ValueError:
    return ValueError(f"--{name.replace('_', '-')} {why}, got {value!r}")


def _check_int(opts: TrainOptions, name: str, minimum: int) -> None:
    value = getattr(opts, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise bad(name, f"must be an integer >= {minimum}", value)


def _check_float(opts: TrainOptions, name: str, low: float, high: float) -> None:
    value = getattr(opts, name)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise bad(name, f"must be a number in [{low:g}, {high:g}]", value)


def add_train_eagle3_args(p: argparse.ArgumentParser) -> None:
    d = TrainOptions.__dataclass_fields__
    default = {name: f.default for name, f in d.items()}
    g = p.add_argument_group("run")
    g.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default=None,
        help="the target: HF folder or .gguf (default: the embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the target's)")
    g.add_argument(
        "--out",
        default=None,
        help="folder of the exported head (LlamaForCausalLMEagle3 layout); required "
        "by the train phase",
    )
    g.add_argument(
        "--work-dir",
        required=True,
        help="working folder: prompts.jsonl, data/ (shards, index.json), "
        "checkpoints/, train_summary.json",
    )
    g.add_argument(
        "--phases",
        default=",".join(PHASES),
        help="comma-separated phases to run, in order: prompts (write the prompt "
        "set), generate (responses + hidden-state capture into shards), train "
        "(train, evaluate, export)",
    )
    g.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda[:N]")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts, sampling and training")
    g = p.add_argument_group("prompts")
    g.add_argument(
        "--num-prompts",
        type=int,
        default=default["num_prompts"],
        help="prompts in the set: everyday chat requests (the largest share), "
        "questions and instructions on built-in topics, code, maths, prose",
    )
    g.add_argument(
        "--self-prompt-fraction",
        type=float,
        default=default["self_prompt_fraction"],
        help="share of the prompts the target writes itself about built-in topics "
        "and words of its vocabulary (0 = templates only)",
    )
    g.add_argument(
        "--raw-prompt-fraction",
        type=float,
        default=default["raw_prompt_fraction"],
        help="share of the prompts sent without the chat template (raw completion, "
        "as LLM.generate sends text)",
    )
    g = p.add_argument_group("generate")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=default["max_tokens"],
        help="most response tokens generated per prompt",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=default["temperature"],
        help="sampling temperature of the responses (0 = greedy)",
    )
    g.add_argument(
        "--gen-batch-size",
        type=int,
        default=default["gen_batch_size"],
        help="requests generated at once (max running requests, decode graph size)",
    )
    g.add_argument(
        "--mem-fraction-static",
        type=float,
        default=default["mem_fraction_static"],
        help="CUDA: share of GPU memory the generating engine takes",
    )
    g.add_argument(
        "--eval-fraction",
        type=float,
        default=default["eval_fraction"],
        help="share of the sequences held out for evaluation (estimated accept "
        "length over the whole split and over the first 64 response tokens of "
        "its chat-template sequences)",
    )
    g.add_argument(
        "--capture-tokens",
        type=int,
        default=default["capture_tokens"],
        help="tokens per hidden-state capture pass",
    )
    g.add_argument(
        "--shard-tokens",
        type=int,
        default=default["shard_tokens"],
        help="tokens per data shard (one shard is in memory at a time in training)",
    )
    g = p.add_argument_group("train")
    g.add_argument(
        "--draft-vocab-size",
        type=int,
        default=default["draft_vocab_size"],
        help="draft vocabulary: the N most frequent target tokens of the responses",
    )
    g.add_argument(
        "--head-intermediate-size",
        type=int,
        default=None,
        help="MLP width of the head's decoder layer (default: the target's)",
    )
    g.add_argument(
        "--ttt-steps",
        type=int,
        default=default["ttt_steps"],
        help="training-time-test steps: the head unrolled on its own hidden states",
    )
    g.add_argument(
        "--step-decay",
        type=float,
        default=default["step_decay"],
        help="loss weight of unrolled step i is decay**i (normalized)",
    )
    g.add_argument("--epochs", type=int, default=default["epochs"], help="passes over the data")
    g.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="stop after this many optimizer steps (default: all epochs)",
    )
    g.add_argument(
        "--max-train-seconds",
        type=float,
        default=None,
        help="stop training after this many seconds, then evaluate and export",
    )
    g.add_argument(
        "--batch-tokens",
        type=int,
        default=default["batch_tokens"],
        help="tokens per batch: sequences packed into lines as long as the longest "
        "sequence, batch-tokens // that many lines",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fuse the unrolled steps and the loss with torch.compile (default: on "
        "CUDA, where it about halves a step's time; the first step and the "
        "first evaluation compile, about a minute each)",
    )
    g.add_argument("--lr", type=float, default=default["lr"], help="peak AdamW learning rate")
    g.add_argument(
        "--warmup-ratio",
        type=float,
        default=default["warmup_ratio"],
        help="share of the steps of linear warm-up before the cosine decay",
    )
    g.add_argument(
        "--weight-decay", type=float, default=default["weight_decay"], help="AdamW weight decay"
    )
    g.add_argument(
        "--max-grad-norm",
        type=float,
        default=default["max_grad_norm"],
        help="gradient clipping norm",
    )
    g.add_argument(
        "--eval-every",
        type=int,
        default=default["eval_every"],
        help="evaluate on the held-out split every N steps (0 = only at the end)",
    )
    g.add_argument(
        "--save-every",
        type=int,
        default=default["save_every"],
        help="checkpoint every N steps into WORK_DIR/checkpoints (0 = never)",
    )
    g.add_argument(
        "--log-every",
        type=int,
        default=default["log_every"],
        help="refresh the progress bar's loss and accuracies every N steps",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in WORK_DIR/checkpoints",
    )
