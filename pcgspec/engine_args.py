"""Command-line flags for ``EngineConfig``: one flag per field (SGLang's names), each with help.

Imports no torch, so ``pcgspec --help`` answers at once.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from pcgspec.config import EngineConfig
from pcgspec.speculative.config import DEFAULT_TREE, POLICIES, SUPPORTED_ALGORITHMS

# EngineConfig field -> flag, where SGLang's name differs from the field name.
FLAG_NAMES = {"model": "--model-path", "tokenizer": "--tokenizer-path"}
_TYPES = {"int": int, "float": float, "str": str}
_CASE = {"speculative_algorithm": str.upper, "log_level": str.lower}
_CPU_PIECEWISE = "on CPU only with PCGSPEC_CPU_PIECEWISE=1"

# field -> (help, choices or None). "CUDA only" / "CPU only": the flag does nothing elsewhere.
_TREE_DEPTH, _TREE_TOPK, _TREE_NODES = DEFAULT_TREE["EAGLE3"]  # the help states them

ENGINE_HELP: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "model": (
        "Hugging Face folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
        None,
    ),
    "tokenizer": ("tokenizer folder (default: the model's)", None),
    "dtype": (
        "weights and activations; auto = float32 on CPU, bfloat16 on CUDA (aliases: fp32, "
        "bf16, fp16, half)",
        None,
    ),
    "device": ("auto (CUDA when available), cpu, cuda or cuda:N", None),
    "context_length": (
        "longest sequence, prompt plus output (default: the model's max_position_embeddings)",
        None,
    ),
    "page_size": ("tokens per KV-cache page", None),
    "mem_fraction_static": (
        "CUDA only: share of GPU memory for weights, KV cache and graphs",
        None,
    ),
    "cpu_kv_cache_bytes": (
        "CPU only: bytes of the KV cache (default: what --max-running-requests "
        "sequences of --context-length tokens use, at most 256 MiB; 'generate' "
        "sizes it to its prompts)",
        None,
    ),
    "cpu_threads": (
        "CPU only: torch threads of the engine (of each rank with --tp-size), set "
        "when it starts (default: OMP_NUM_THREADS if set, else the physical cores "
        "the machine's load leaves idle, at most 16)",
        None,
    ),
    "max_total_tokens": (
        "cap on the KV pool in tokens (default: what the memory budget holds)",
        None,
    ),
    "max_running_requests": ("most sequences running at once", None),
    "chunked_prefill_size": (
        "largest prefill chunk of one request; -1 disables chunking "
        "(default: 2048 on CUDA, 1024 on CPU)",
        None,
    ),
    "max_prefill_tokens": ("token budget of one prefill step", None),
    "attention_backend": (
        "attention kernels (default: triton on CUDA, torch elsewhere)",
        ("torch", "triton"),
    ),
    "disable_piecewise_cuda_graph": (
        f"run extend (prefill) batches eagerly; the piecewise path runs {_CPU_PIECEWISE}",
        None,
    ),
    "piecewise_cuda_graph_max_tokens": (
        "largest piecewise bucket in tokens (default: the "
        f"chunked-prefill size); CUDA, or {_CPU_PIECEWISE}",
        None,
    ),
    "piecewise_cuda_graph_tokens": (
        f"explicit piecewise buckets, comma-separated (e.g. 4,8,16); CUDA, or {_CPU_PIECEWISE}",
        None,
    ),
    "piecewise_cuda_graph_compiler": (
        "how each piece is compiled (default: inductor on CUDA, eager elsewhere)",
        ("eager", "inductor"),
    ),
    "aux_hidden_state_layers": (
        "comma-separated layers whose inputs EAGLE3 reads (default: the "
        "draft checkpoint's, else 2, L/2 and L-3)",
        None,
    ),
    "disable_cuda_graph": ("CUDA only: run decode batches without CUDA graphs", None),
    "disable_radix_cache": (
        "no prefix caching: every request prefills its whole prompt "
        "(default: cached prefixes of whole KV pages are reused)",
        None,
    ),
    "cuda_graph_max_bs": (
        "CUDA only: largest decode batch captured as a graph (default 128; "
        "larger batches decode through the piecewise runner)",
        None,
    ),
    "extend_cuda_graph_max_tokens": (
        "CUDA only, one GPU: extend batches (prefills, chunks, mixed steps) up to this many "
        "tokens replay one CUDA graph of the whole decoder, attention included (default 256; "
        "0: none, the piecewise graphs serve them)",
        None,
    ),
    "disable_overlap_schedule": (
        "step synchronously: no scheduling of step N+1 while the GPU "
        "runs step N (default: overlap on CUDA, off on CPU; with "
        "speculative decoding the plain steps overlap)",
        None,
    ),
    "random_seed": ("seed of the seeds given to requests that set none", None),
    "tp_size": (
        "tensor parallelism: ranks the model is split across, one process each (GPUs "
        "cuda:0..N-1 from --device on CUDA, gloo processes on CPU)",
        None,
    ),
    "log_level": (
        "log level (default: PCGSPEC_LOG_LEVEL, else info)",
        ("debug", "info", "warning", "error"),
    ),
    "speculative_algorithm": ("speculative decoding (default: none)", SUPPORTED_ALGORITHMS),
    "speculative_num_steps": (
        "k: the draft depth, drafts per request and step (default: 4 for NGRAM, "
        f"{_TREE_DEPTH} for EAGLE3's default tree, else 3)",
        None,
    ),
    "speculative_num_draft_tokens": (
        "tokens the target verifies per request: k+1 for a chain, the tree's nodes with "
        f"--speculative-eagle-topk > 1 (default: {_TREE_NODES} for EAGLE3's default tree, "
        "else num_steps + 1)",
        None,
    ),
    "speculative_eagle_topk": (
        "draft branches per depth; 1 = chain drafting, > 1 = tree drafting, EAGLE3/NEXTN "
        "(default: EAGLE3 given none of the three shape options drafts a "
        f"{_TREE_DEPTH}/{_TREE_TOPK}/{_TREE_NODES} tree, else 1)",
        None,
    ),
    "speculative_draft_model_path": (
        "draft model folder (STANDALONE, EAGLE3; EAGLE3 default: "
        "the head shipped for the default model; NEXTN default: "
        "the target's own MTP layers)",
        None,
    ),
    "speculative_ngram_min_match_window_size": (
        "NGRAM: shortest suffix looked up (default: 1)",
        None,
    ),
    "speculative_ngram_max_match_window_size": (
        "NGRAM: longest suffix looked up (default: 12)",
        None,
    ),
    "speculative_policy": (
        "auto: a plain decode step where the measured step times and accept "
        "lengths say speculation does not pay; always: speculate every step "
        "(default: auto)",
        POLICIES,
    ),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to every help line with a real default that does not name one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field, so the two never drift apart."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        flag = FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-"))
        kind = str(f.type).split(" |")[0]
        default = None if f.default is MISSING else f.default
        help_text, choices = ENGINE_HELP[f.name]
        if kind == "bool":
            group.add_argument(
                flag, dest=f.name, action="store_true", default=default, help=help_text
            )
        elif kind.startswith("tuple"):
            group.add_argument(flag, dest=f.name, type=str, default=default, help=help_text)
        else:
            convert = _CASE.get(f.name, _TYPES[kind])
            group.add_argument(
                flag, dest=f.name, type=convert, default=default, choices=choices, help=help_text
            )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})
