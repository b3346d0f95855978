"""What every handler of one server shares: settings, the async engine, the tokenizer, metrics."""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pcgspec.config import EngineConfig
from pcgspec.models.loader import load_tokenizer
from pcgspec.server.async_engine import AsyncEngine
from pcgspec.server.metrics import ServerMetrics
from pcgspec.server.protocol import ApiError, GenerationRequest, Limits


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None  # Bearer key checked on /v1/*; None = open
    served_model_name: str | None = None  # None: the model folder's name
    max_request_bytes: int = 4 << 20  # larger bodies get 413
    graceful_shutdown_timeout: float = 5.0  # seconds SIGTERM waits for requests, then aborts

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes!r}")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError(
                f"graceful_shutdown_timeout must be >= 0, got {self.graceful_shutdown_timeout!r}"
            )
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given")


@dataclass(eq=False)
class ServerState:
    engine: AsyncEngine
    config: EngineConfig
    settings: ServerSettings
    limits: Limits
    tokenizer: Any  # the server's own copy: the engine thread's is never shared
    metrics: ServerMetrics
    started: float = field(default_factory=time.time)
    draining: bool = False
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="pcgspec-tokenize")
    )

    @classmethod
    def build(
        cls, engine: AsyncEngine, config: EngineConfig, settings: ServerSettings
    ) -> ServerState:
        core = engine.engine
        assert core is not None, "start the engine first"
        name = settings.served_model_name or core.model_dir.name
        limits = Limits(name, core.runner.vocab_size, core.context_length)
        metrics = ServerMetrics(name, lambda: engine.snapshot)
        engine.metrics = metrics
        tokenizer = load_tokenizer(config.tokenizer or core.model_dir)
        return cls(engine, config, settings, limits, tokenizer, metrics)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one state per server, lives as long
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def encode(self, req: GenerationRequest) -> list[list[int]]:
        """Token ids per prompt (chat: the rendered template), off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._encode, req)

    def _encode(self, req: GenerationRequest) -> list[list[int]]:
        tok = self.tokenizer
        if not req.chat:
            return [p if isinstance(p, list) else tok.encode(p) for p in req.prompts]
        try:
            text = tok.apply_chat_template(
                list(req.messages), add_generation_prompt=True, tokenize=False
            )
        except Exception as e:  # jinja errors, e.g. a template that forbids a role order
            raise ApiError(
                400, f"the chat template rejected the messages: {e}", param="messages"
            ) from None
        # NOTE: the template already holds the special tokens it wants.
        return [tok.encode(text, add_special_tokens=False)]


STATE: web.AppKey[ServerState] = web.AppKey("pcgspec_state", ServerState)
