"""What every handler of one server shares: settings, the async engine, the tokenizer, metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from pcgspec.config import EngineConfig
from pcgspec.models.loader import load_tokenizer
from pcgspec.server.async_engine import AsyncEngine
from pcgspec.server.metrics import ServerMetrics
from pcgspec.server.protocol import GenerationRequest, Limits
from pcgspec.server.token_bytes import TokenBytes
from pcgspec.server.tokenize import PromptEncoder


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None  # Bearer key checked on /v1/*; None = open
    served_model_name: str | None = None  # None: the model folder's name
    max_request_bytes: int = 4 << 20  # larger bodies get 413
    graceful_shutdown_timeout: float = 5.0  # seconds SIGTERM waits for requests, then aborts
    keep_alive_timeout: float = 30.0  # seconds an idle connection (or one yet to send) stays
    read_timeout: float = 30.0  # seconds a request body may take to arrive (then 408)
    max_connections: int = 1024  # open connections; more are answered 503 and closed
    max_connections_per_peer: int = 512  # open connections of one remote address
    header_timeout: float = 5.0  # seconds a new connection has to send its first request head
    allowed_hosts: tuple[str, ...] = ()  # Host names a loopback server also answers; "*": any
    allowed_origins: tuple[str, ...] = ()  # origins given CORS headers; "*": any
    engine_in_process: bool = False  # the engine loop on a thread, not a process of its own

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes!r}")
        if not self.graceful_shutdown_timeout >= 0:
            raise ValueError(
                f"graceful_shutdown_timeout must be >= 0, got {self.graceful_shutdown_timeout!r}"
            )
        for name in ("keep_alive_timeout", "read_timeout", "header_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_connections", "max_connections_per_peer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given")


@dataclass(eq=False)
class ServerState:
    engine: AsyncEngine
    config: EngineConfig
    settings: ServerSettings
    limits: Limits
    tokenizer: Any  # the server's own copy
    metrics: ServerMetrics
    started: float = field(default_factory=time.time)
    draining: bool = False
    encoder: PromptEncoder = field(init=False)
    token_bytes: TokenBytes = field(init=False)

    def __post_init__(self) -> None:
        self.encoder = PromptEncoder(self.tokenizer, self.limits.max_model_len)
        self.token_bytes = TokenBytes(self.tokenizer)

    @classmethod
    def build(
        cls, engine: AsyncEngine, config: EngineConfig, settings: ServerSettings
    ) -> ServerState:
        info = engine.info
        assert info is not None, "start the engine first"
        name = settings.served_model_name or Path(info.model_dir).name
        limits = Limits(name, info.vocab_size, min(info.context_length, info.kv_tokens))
        metrics = ServerMetrics(name, lambda: engine.snapshot)
        engine.metrics = metrics
        tokenizer = load_tokenizer(config.tokenizer or info.model_dir)
        return cls(engine, config, settings, limits, tokenizer, metrics)

    async def encode(self, req: GenerationRequest) -> list[list[int]]:
        """Token ids per prompt (chat: the rendered template), off the event loop."""
        return await self.encoder.encode(req)


STATE: web.AppKey[ServerState] = web.AppKey("pcgspec_state", ServerState)
