"""A real ``python -m pcgspec serve`` process on 127.0.0.1 and a free port, for server tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

API_KEY = "sk-pcgspec-test"
MODEL = "SmolLM2-135M-Instruct"
# float32 on CPU, a small context and KV pool so the tests stay quick and the pool is watched.
DEFAULT_ARGS = (
    "--dtype",
    "float32",
    "--device",
    "cpu",
    "--context-length",
    "512",
    "--cpu-kv-cache-bytes",
    str(256 << 20),
    "--max-running-requests",
    "64",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_launch_flags(log_dir: Path) -> list[str]:
    """``bench_serving.py`` flags that launch a CPU server of the default arguments on a free
    port with the test key, logging to ``log_dir``."""
    return [
        "--launch",
        "--base-url",
        f"http://127.0.0.1:{free_port()}",
        "--api-key",
        API_KEY,
        "--server-args",
        " ".join(DEFAULT_ARGS),
        "--server-log",
        str(log_dir / "server.log"),
    ]


class ServerProcess:
    """``api_key``: passed as ``--api-key``, or through ``PCGSPEC_API_KEY`` with ``key_in_env``."""

    def __init__(
        self, *extra_args: str, api_key: str | None = API_KEY, key_in_env: bool = False
    ) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.log = Path(tempfile.mkstemp(prefix="pcgspec-serve-", suffix=".log")[1])
        args = [
            sys.executable,
            "-m",
            "pcgspec",
            "serve",
            "--port",
            str(self.port),
            *DEFAULT_ARGS,
            *extra_args,
        ]
        env = {**os.environ, "PCGSPEC_LOG_LEVEL": "INFO"}
        env.pop("PCGSPEC_API_KEY", None)
        if api_key is not None and key_in_env:
            env["PCGSPEC_API_KEY"] = api_key
        elif api_key is not None:
            args += ["--api-key", api_key]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_healthy(self, timeout: float = 240.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.get("/health")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy after {timeout} s:\n{self.log_tail()}")

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """(status, parsed JSON or text) of one request; never raises on an HTTP status."""
        req = urllib.request.Request(
            self.base_url + path, data=body, method=method, headers=headers or {}
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def _auth(self, key: str | None) -> dict[str, str]:
        key = self.api_key if key == "default" else key
        return {} if key is None else {"Authorization": f"Bearer {key}"}

    def get(self, path: str, key: str | None = "default") -> tuple[int, Any]:
        return self.request("GET", path, headers=self._auth(key))

    def post(
        self,
        path: str,
        body: bytes | dict[str, Any],
        key: str | None = "default",
    ) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **self._auth(key)}
        return self.request("POST", path, data, headers)

    def internal_state(self) -> dict[str, Any]:
        status, info = self.get("/server_info")
        assert status == 200, info
        return info["internal_states"][0]

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """The internal state once no request is open and no KV page is held."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.internal_state()
            idle = (
                state["num_open_requests"] == 0
                and state["num_running"] == 0
                and state["num_waiting"] == 0
                and state["kv"]["used_pages"] == 0
            )
            if idle or time.monotonic() > deadline:
                return state
            time.sleep(0.1)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit code (killed, and the test failed, after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.unlink(missing_ok=True)
