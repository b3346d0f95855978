"""`pcgspec serve` limits as a hostile client meets them: a connection cap and idle timeouts,
slow and undecodable bodies, malformed requests, huge prompts, a KV pool smaller than the
context, partial UTF-8 tokens in logprobs, and the API key (from the environment) on every
route that reveals or runs something. One server process; 2.5 min on the 2-core machine while
other test runs kept it busy (load 8).
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_process import API_KEY, ServerProcess

from pcgspec.server.admission import RESERVE

MODEL = "test-org/SmolLM2"  # a served name with a slash
MAX_CONNECTIONS = 16
KV_TOKENS = 256  # --max-total-tokens: less than the 512-token context
CJK = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(
        "--served-model-name",
        MODEL,
        "--disable-piecewise-cuda-graph",
        "--max-total-tokens",
        str(KV_TOKENS),
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--keep-alive-timeout",
        "30",
        "--header-timeout",
        "2",
        "--read-timeout",
        "2",
        key_in_env=True,
    )
    try:
        yield proc.wait_healthy()
    finally:
        proc.close()


def _answers(socks: list[socket.socket], count: int) -> list[bytes | None]:
    """What each socket reads once ``count`` of them are readable (None: nothing, still open);
    the loop is a guard against hanging, it ends as soon as the count is reached."""
    ready: list[socket.socket] = []
    for _ in range(1200):
        ready = select.select(socks, [], [], 0)[0]
        if len(ready) >= count:
            break
        time.sleep(0.05)
    return [s.recv(64) if s in ready else None for s in socks]


def test_connections_over_the_cap_get_503_and_idle_ones_are_closed(server):
    opened = MAX_CONNECTIONS + RESERVE + 8
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(opened)]
    try:
        first = _answers(socks, 8)
        refused = [a for a in first if a is not None]
        assert len(refused) == 8
        assert all(a.startswith(b"HTTP/1.1 503") for a in refused)
        idle = [s for s, a in zip(socks, first) if a is None]
        assert _answers(idle, len(idle)) == [b""] * len(idle)  # closed by the head timeout
    finally:
        for s in socks:
            s.close()
    assert server.get("/health")[0] == 200


def _raw(server: ServerProcess, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as s:
        s.sendall(data)
        return s.recv(4096)


def test_a_body_slower_than_the_read_timeout_gets_408(server):
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {API_KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    answer = _raw(server, head.encode() + b'{"prompt": ')
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer


def test_malformed_requests_get_400_and_leave_no_traceback(server):
    bad = b"GET /health HTTP/1.1\r\nHost: x\r\nthis line has no colon\r\n\r\n"
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _raw(server, bad), range(40)))
    assert all(a.split(b"\r\n")[0].endswith(b" 400 Bad Request") for a in answers), answers[0]
    assert all(b'"code": "malformed_request"' in a for a in answers), answers[0]
    gzip = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    gzip["Authorization"] = f"Bearer {API_KEY}"
    status, body = server.request("POST", "/v1/completions", b'{"prompt": "hi"}', gzip)
    assert status == 400 and body["error"]["code"] == "invalid_body"
    gzip["Content-Encoding"] = "compress"
    status, body = server.request("POST", "/v1/completions", b'{"prompt": "hi"}', gzip)
    assert status == 415 and "'compress'" in body["error"]["message"], body
    assert server.get("/health")[0] == 200
    log = server.log.read_text()
    assert "Traceback" not in log and " ERROR " not in log, server.log_tail()
    assert 1 <= log.count("malformed request") < 10  # rate-limited


def test_the_key_from_the_environment_guards_v1_server_info_and_health_generate(server):
    for path in ("/v1/models", "/server_info", "/health_generate"):
        assert server.get(path, key=None)[0] == 401, path
        assert server.get(path, key="sk-wrong")[0] == 401, path
        assert server.get(path)[0] == 200, path
    assert server.get("/health", key=None)[0] == 200
    assert server.get("/metrics", key=None)[0] == 200
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.putrequest("GET", "/v1/models")
    conn.putheader("Authorization", b"Bearer \xff\xfe")  # not UTF-8
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 401 and json.loads(resp.read())["error"]["code"] == "invalid_api_key"
    conn.close()


def test_models_report_the_kv_limit_and_take_ids_with_a_slash(server):
    status, models = server.get("/v1/models")
    assert status == 200 and models["data"][0]["max_model_len"] == KV_TOKENS
    status, card = server.get(f"/v1/models/{MODEL}")
    assert status == 200 and card["id"] == MODEL
    assert server.get("/v1/models/test-org/other")[0] == 404


def test_prompt_and_max_tokens_over_the_kv_pool_are_refused_up_front(server):
    prompt = [1000] * 200
    status, out = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 100})
    assert status == 400 and out["error"]["param"] == "max_tokens", out
    assert f"{KV_TOKENS} tokens" in out["error"]["message"] and "300" in out["error"]["message"]
    body = {"prompt": [1000] * (KV_TOKENS - 4), "max_tokens": 4, "ignore_eos": True}
    status, out = server.post("/v1/completions", body)  # exactly fills the pool: runs in full
    assert status == 200 and out["usage"]["completion_tokens"] == 4
    assert out["choices"][0]["finish_reason"] == "length"


def test_huge_prompts_are_refused_before_tokenizing(server):
    huge = {"prompt": "hello world " * 330_000, "max_tokens": 2}  # 3.96 MB, under the body limit
    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(server.post, "/v1/completions", huge) for _ in range(4)]
        small = pool.submit(server.post, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        results = [f.result() for f in futures]
        assert small.result()[0] == 200
    for status, out in results:
        assert status == 400 and "characters" in out["error"]["message"], out


def test_logprobs_of_partial_utf8_tokens(server):
    messages = [{"role": "user", "content": "Translate to Chinese: I love my cat."}]
    body = {"messages": messages, "logprobs": True, "top_logprobs": 20, **CJK}
    status, out = server.post("/v1/chat/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    content = choice["logprobs"]["content"]
    joined, text = bytes(b for c in content for b in c["bytes"]), choice["message"]["content"]
    assert text and joined.startswith(text.encode()) and len(joined) - len(text.encode()) < 4
    assert any(c["token"].startswith("bytes:") for c in content)  # the case under test
    assert all(len({t["token"] for t in c["top_logprobs"]}) == 20 for c in content)
    body = {"prompt": "中文：我爱我的猫。英文：I love my cat. 中文：你好", "logprobs": 20, **CJK}
    status, out = server.post("/v1/completions", body)
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    assert all(len(top) == 20 for top in lp["top_logprobs"])
    assert all(t in top for t, top in zip(lp["tokens"], lp["top_logprobs"]))  # greedy: top-1
    assert any(t.startswith("bytes:") for t in lp["tokens"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
