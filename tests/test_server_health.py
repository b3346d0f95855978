"""/health and /health_generate tell the truth: 503 for good once every step fails (a sticky
device error, or failed steps in a row), 200 through a transient failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

import pcgspec.server.engine_loop as engine_loop
from pcgspec import LLM
from pcgspec.engine.isolation import device_unusable
from pcgspec.server.app import build_app
from pcgspec.server.async_engine import AsyncEngine
from pcgspec.server.state import ServerSettings, ServerState

BODY = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def llm(plain_llm: LLM, monkeypatch) -> LLM:
    monkeypatch.setattr(engine_loop, "Engine", lambda config: plain_llm.engine)
    return plain_llm


def _faulty_forward(llm: LLM, monkeypatch, message: str, times: int | None) -> None:
    """The target's forward raises ``RuntimeError(message)``: ``times`` times, or always."""
    runner = llm.engine.runner
    forward, raised = runner.forward, [0]

    def failing(batch):
        if times is None or raised[0] < times:
            raised[0] += 1
            raise RuntimeError(message)
        return forward(batch)

    monkeypatch.setattr(runner, "forward", failing)


def _serve(llm: LLM, session: Callable[[TestClient], Awaitable[None]]) -> None:
    async def run() -> None:
        engine = AsyncEngine(in_process=True)  # the injected engine
        await engine.start(llm.config)
        state = ServerState.build(engine, llm.config, ServerSettings())
        try:
            async with TestClient(TestServer(build_app(state))) as client:
                await session(client)
        finally:
            await engine.stop()
            state.encoder.shutdown()

    asyncio.run(run())


async def _status(client: TestClient, path: str) -> tuple[int, dict]:
    resp = await client.get(path)
    return resp.status, await resp.json()


async def _complete(client: TestClient) -> int:
    return (await client.post("/v1/completions", json=BODY)).status


def _assert_unavailable(status: int, body: dict) -> None:
    assert status == 503, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "service_unavailable" and "unhealthy" in error["message"], error


def test_failing_steps_turn_health_503_for_good(llm, monkeypatch):
    async def session(client: TestClient) -> None:
        assert (await _status(client, "/health"))[0] == 200
        _faulty_forward(llm, monkeypatch, "injected fault", times=None)
        for failed in range(1, engine_loop.MAX_STEP_ERRORS + 1):
            assert await _complete(client) == 500
            status, body = await _status(client, "/health")
            if failed < engine_loop.MAX_STEP_ERRORS:
                assert status == 200, (failed, body)
        _assert_unavailable(status, body)
        _assert_unavailable(*await _status(client, "/health_generate"))
        monkeypatch.undo()  # the forward works again: health stays 503
        assert await _complete(client) == 200
        _assert_unavailable(*await _status(client, "/health"))
        info = (await _status(client, "/server_info"))[1]["internal_states"][0]
        assert "injected fault" in info["engine_unhealthy"]

    _serve(llm, session)


def test_a_sticky_device_error_turns_health_503_at_once(llm, monkeypatch):
    async def session(client: TestClient) -> None:
        assert (await _status(client, "/health"))[0] == 200
        _faulty_forward(llm, monkeypatch, "CUDA error: device-side assert triggered", times=None)
        assert await _complete(client) == 500
        _assert_unavailable(*await _status(client, "/health"))

    _serve(llm, session)


def test_transient_failures_keep_health_200(llm, monkeypatch):
    """As many failed steps as mark the engine unhealthy in a row, each followed by a step
    that succeeds: a success resets the count.
    """

    async def session(client: TestClient) -> None:
        for _ in range(engine_loop.MAX_STEP_ERRORS):
            _faulty_forward(llm, monkeypatch, "injected fault", times=1)
            assert await _complete(client) == 500
            assert (await _status(client, "/health"))[0] == 200
            assert await _complete(client) == 200
        assert (await _status(client, "/health_generate"))[0] == 200

    _serve(llm, session)


def test_which_errors_mark_the_device_unusable():
    assert device_unusable(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert device_unusable(RuntimeError("CUDA error: device-side assert triggered"))
    assert device_unusable(torch.AcceleratorError("anything"))
    assert not device_unusable(RuntimeError("injected fault"))
    assert not device_unusable(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
