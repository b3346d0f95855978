"""Engine configuration: one frozen dataclass, validated, with SGLang's option names."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pcgspec import envs
from pcgspec.compile.buckets import capture_buckets
from pcgspec.speculative.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

# NOTE: torch is imported where a value needs it, so `pcgspec --help` starts without it.
_DTYPES = ("float32", "bfloat16", "float16")
CPU_KV_CACHE_DEFAULT_BYTES = 256 << 20
DEFAULT_EXTEND_GRAPH_MAX_TOKENS = 256
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # "org/name", as the hub names them
_UNSET = {
    "model": "no model for the embedded default (SmolLM2-135M-Instruct)",
    "tokenizer": "no tokenizer for the model's own",
    "speculative_draft_model_path": "no path for the algorithm's default draft",
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from. ``None`` means "pick the default for the device"."""

    model: str | None = None  # HF folder or .gguf file; None = the embedded default model
    tokenizer: str | None = None
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    context_length: int | None = None
    page_size: int = 16
    mem_fraction_static: float = 0.85  # CUDA: share of GPU memory for weights + KV + graphs
    cpu_kv_cache_bytes: int | None = None  # CPU: byte budget of the KV cache (cpu_kv_budget)
    cpu_threads: int | None = None  # CPU: torch threads per process (engine/cpu_threads.py)
    max_total_tokens: int | None = None  # caps the KV pool (SGLang's --max-total-tokens)
    max_running_requests: int = 256
    chunked_prefill_size: int | None = None  # 2048 on CUDA, 1024 on CPU; -1 disables chunking
    max_prefill_tokens: int = 16384  # token budget of one prefill step
    attention_backend: str | None = None  # "triton" on CUDA, "torch" elsewhere
    disable_piecewise_cuda_graph: bool = False  # run extend batches eagerly
    piecewise_cuda_graph_max_tokens: int | None = None  # largest bucket; default chunked size
    piecewise_cuda_graph_tokens: tuple[int, ...] | None = None  # explicit bucket list
    piecewise_cuda_graph_compiler: str | None = None  # "inductor" on CUDA, "eager" elsewhere
    aux_hidden_state_layers: tuple[int, ...] | None = None  # FULL capture: these layers' inputs
    disable_cuda_graph: bool = False  # run decode batches without CUDA graphs
    disable_radix_cache: bool = False  # no prefix caching (engine/radix_cache.py)
    cuda_graph_max_bs: int = 128  # largest decode batch captured; larger ones run piecewise
    extend_cuda_graph_max_tokens: int | None = None  # whole-decoder extend graphs; 0: none
    disable_overlap_schedule: bool | None = None  # None: overlap on CUDA, off elsewhere
    random_seed: int = 0
    tp_size: int = 1  # tensor-parallel ranks: GPUs on CUDA, gloo processes on CPU
    log_level: str | None = None
    # Speculative decoding (SGLang's names); None = SpeculativeConfig's default.
    speculative_algorithm: str | None = None  # EAGLE3, NEXTN, STANDALONE or NGRAM
    speculative_num_steps: int | None = None  # k drafts per request and step
    speculative_num_draft_tokens: int | None = None  # k+1, or the tree nodes with topk > 1
    speculative_eagle_topk: int | None = None  # > 1: tree drafting (EAGLE3, NEXTN)
    speculative_draft_model_path: str | None = None
    speculative_ngram_min_match_window_size: int | None = None
    speculative_ngram_max_match_window_size: int | None = None
    speculative_policy: str | None = None  # auto (default) | always

    def __post_init__(self) -> None:
        self._validate()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        for name in kwargs:
            if name not in known:
                raise ValueError(
                    f"unknown engine option {name!r}; known: {', '.join(sorted(known))}"
                )
        return cls(**kwargs)

    def _validate(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in (
            "context_length",
            "page_size",
            "max_total_tokens",
            "max_running_requests",
            "max_prefill_tokens",
            "cpu_kv_cache_bytes",
            "cpu_threads",
            "piecewise_cuda_graph_max_tokens",
            "cuda_graph_max_bs",
            "tp_size",
        ):
            positive(name)
        if self.dtype != "auto" and _DTYPE_ALIASES.get(self.dtype, self.dtype) not in _DTYPES:
            raise ValueError(
                f"dtype must be auto or one of {', '.join(_DTYPES)}, got {self.dtype!r}"
            )
        self._check_device()
        for name in ("model", "tokenizer", "speculative_draft_model_path"):
            check_not_hub_id(name, getattr(self, name))
        extend = self.extend_cuda_graph_max_tokens
        if extend is not None and (not isinstance(extend, int) or extend < 0):
            raise ValueError(
                f"extend_cuda_graph_max_tokens must be a non-negative integer, got {extend!r}"
            )
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static!r}"
            )
        size = self.chunked_prefill_size
        if size is not None and size != -1 and (not isinstance(size, int) or size < 1):
            raise ValueError(f"chunked_prefill_size must be -1 or >= 1, got {size!r}")
        self._int_tuple_field("piecewise_cuda_graph_tokens", minimum=1)
        self._int_tuple_field("aux_hidden_state_layers", minimum=0)
        if self.piecewise_cuda_graph_compiler not in (None, "eager", "inductor"):
            raise ValueError(
                "piecewise_cuda_graph_compiler must be eager or inductor, got "
                f"{self.piecewise_cuda_graph_compiler!r}"
            )
        if not isinstance(self.disable_overlap_schedule, (bool, type(None))):
            raise ValueError(
                "disable_overlap_schedule must be a bool or None, got "
                f"{self.disable_overlap_schedule!r}"
            )
        if self.attention_backend not in (None, "torch", "triton"):
            raise ValueError(
                f"attention_backend must be torch or triton, got {self.attention_backend!r}"
            )
        spec = self.speculative_config  # validates the speculative_* fields
        if spec is not None:
            spec.draft_model_path(self.model)  # EAGLE3 without a path: the shipped head exists
        self._check_tp()

    def _check_tp(self) -> None:
        if self.tp_size == 1:
            return
        env = envs.torchrun_env()
        if env is not None and env.world_size != self.tp_size:
            raise ValueError(
                f"tp_size ({self.tp_size}) must equal torchrun's WORLD_SIZE ({env.world_size}): "
                "every process torchrun starts is one tensor-parallel rank"
            )
        if self.device != "cpu":
            import torch

            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            first = 0 if self.device == "auto" else (torch.device(self.device).index or 0)
            local = self.tp_size if env is None else env.local_world_size
            if count and first + local > count:
                raise ValueError(
                    f"tp_size {self.tp_size} from {self.device} needs "
                    f"{first + local} CUDA devices on this host, there are {count}"
                )

    def _check_device(self) -> None:
        if not isinstance(self.device, str) or not re.fullmatch(
            r"auto|cpu|cuda(:\d+)?", self.device
        ):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ValueError(
                    f"device is {self.device!r} but CUDA is not available (torch "
                    f"{torch.__version__}, CUDA build {torch.version.cuda}); "
                    "use --device cpu or auto"
                )
            index = torch.device(self.device).index
            if index is not None and index >= torch.cuda.device_count():
                raise ValueError(
                    f"device is {self.device!r} but there are only "
                    f"{torch.cuda.device_count()} CUDA devices"
                )

    def _int_tuple_field(self, name: str, minimum: int) -> None:
        """Accept ``"4,8,16"`` or a list for a tuple-of-ints field; store the tuple."""
        value = getattr(self, name)
        if value is None:
            return
        if isinstance(value, (list, str)):
            value = _int_tuple(name, value)
            object.__setattr__(self, name, value)
        if not value or any(not isinstance(v, int) or v < minimum for v in value):
            raise ValueError(f"{name} must be integers >= {minimum}, got {value!r}")

    # Resolved values -------------------------------------------------------------------------

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        """The speculative_* fields as a validated ``SpeculativeConfig``; None = no speculation."""
        if self.speculative_algorithm is None:
            names = [f.name for f in fields(self) if f.name.startswith("speculative_")]
            stray = [n for n in names if getattr(self, n) is not None]
            if stray:
                raise ValueError(f"{', '.join(stray)} set without speculative_algorithm")
            return None
        kwargs = {f.name: getattr(self, f.name) for f in fields(SpeculativeConfig)}
        return SpeculativeConfig(**{k: v for k, v in kwargs.items() if v is not None})

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return getattr(torch, _DTYPE_ALIASES.get(self.dtype, self.dtype))

    def cpu_kv_budget(self, context_length: int, bytes_per_token: int) -> int:
        """Bytes of the KV cache on the CPU: ``cpu_kv_cache_bytes`` when given, else what
        ``max_running_requests`` sequences of ``context_length`` tokens can use, at most
        ``CPU_KV_CACHE_DEFAULT_BYTES`` (``max_total_tokens`` caps the pool after this).
        """
        if self.cpu_kv_cache_bytes is not None:
            return self.cpu_kv_cache_bytes
        usable = self.max_running_requests * context_length * bytes_per_token
        return min(usable, CPU_KV_CACHE_DEFAULT_BYTES)

    @property
    def use_piecewise(self) -> bool:
        """Whether piecewise graphs serve extend batches: on CUDA unless disabled. On CPU no
        graph is captured and the trace costs seconds at start-up, so the pieces run only with
        ``PCGSPEC_CPU_PIECEWISE=1`` (the tests set it to run the CUDA path's logic on CPU).
        """
        if self.disable_piecewise_cuda_graph:
            return False
        return self.torch_device.type == "cuda" or envs.cpu_piecewise()

    @property
    def use_overlap_schedule(self) -> bool:
        """Whether the host schedules and launches step N+1 while the device runs step N
        (engine/overlap.py): on CUDA unless disabled, off elsewhere unless
        ``disable_overlap_schedule=False``. Speculative steps overlap too (speculative/worker.py).
        """
        if self.disable_overlap_schedule is not None:
            return not self.disable_overlap_schedule
        return self.torch_device.type == "cuda"

    @property
    def resolved_attention_backend(self) -> str:
        if self.attention_backend is not None:
            return self.attention_backend
        return "triton" if self.torch_device.type == "cuda" else "torch"

    @property
    def resolved_chunked_prefill_size(self) -> int | None:
        """Largest prefill chunk of one request; None = no chunking."""
        if self.chunked_prefill_size == -1:
            return None
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        return 2048 if self.torch_device.type == "cuda" else 1024

    @property
    def resolved_piecewise_max_tokens(self) -> int:
        """The largest piecewise bucket: the flag, else the chunked-prefill size."""
        if self.piecewise_cuda_graph_max_tokens is not None:
            return self.piecewise_cuda_graph_max_tokens
        return min(self.resolved_chunked_prefill_size or 4096, self.max_prefill_tokens)

    @property
    def resolved_extend_graph_max_tokens(self) -> int:
        """The largest extend-graph bucket (0: none): the flag, else 256 tokens, within the
        piecewise buckets' range (an explicit bucket list must hold one at or below it); on CUDA
        with CUDA graphs, piecewise graphs and the Triton attention backend on, one rank (under
        tensor parallelism the piecewise graphs serve every extend batch: extend graphs have not
        been run on several GPUs).
        """
        cuda = self.torch_device.type == "cuda"
        off = self.disable_cuda_graph or self.disable_piecewise_cuda_graph or self.tp_size > 1
        if not cuda or off or self.resolved_attention_backend != "triton":
            return 0
        flag = self.extend_cuda_graph_max_tokens
        limit = min(
            DEFAULT_EXTEND_GRAPH_MAX_TOKENS if flag is None else flag,
            self.resolved_piecewise_max_tokens,
        )
        if limit < 1 or not capture_buckets(limit, self.piecewise_cuda_graph_tokens):
            return 0
        return limit

    @property
    def resolved_piecewise_compiler(self) -> str:
        if self.piecewise_cuda_graph_compiler is not None:
            return self.piecewise_cuda_graph_compiler
        return "inductor" if self.torch_device.type == "cuda" else "eager"


def check_not_hub_id(name: str, value: object) -> None:
    """Refuse a Hugging Face hub id ("org/name") that is not also a local path: pcgspec loads
    local folders and files only.
    """
    if not isinstance(value, str) or not _HUB_ID.fullmatch(value) or Path(value).exists():
        return
    raise ValueError(
        f"{name} {value!r} is not a local folder or file, and downloads from the Hugging Face "
        "hub are not available in pcgspec: pass a local folder with config.json and "
        f"*.safetensors (e.g. what `huggingface-cli download {value} --local-dir DIR` writes), "
        f"a .gguf file, or {_UNSET.get(name, 'none for the default')}"
    )


def _int_tuple(name: str, value: list[object] | str) -> tuple[int, ...]:
    """``"4,8,16"`` or ``[4, 8, 16]`` as a tuple of ints; bad entries raise ValueError."""
    items = value.split(",") if isinstance(value, str) else value
    try:
        return tuple(int(x) for x in items)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be integers, got {value!r}") from None
