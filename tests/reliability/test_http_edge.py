"""HTTP framing, limits and authentication on a real server process, over raw sockets where a
client library would not send what an attacker can."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

import httpx
import pytest

from tests.reliability.conftest import (
    ADMIN,
    API_KEY,
    MODEL,
    assert_error,
    good_completion,
    start_server,
    stop_server,
)

AUTH = f"Authorization: Bearer {API_KEY}\r\n".encode()


def exchange(server, data: bytes, *, wait: float = 5.0) -> tuple[bytes, float]:
    """Send ``data`` on a fresh connection; everything the server sends until it closes (or
    ``wait`` passes), and how long that took."""
    host, port = server.base_url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        with contextlib.suppress(OSError):  # it answered and stopped reading (a large head)
            s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return out, time.monotonic() - started


def parse(raw: bytes) -> httpx.Response:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = [tuple(line.split(": ", 1)) for line in lines[1:]]
    return httpx.Response(status, headers=headers, content=body)


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n%s\r\n%s" % (path.encode(), len(body), extra, body)
    )


def post_chunked(path: str, parts: list[bytes], extra: bytes = b"") -> bytes:
    """An authenticated JSON POST whose body is sent in ``parts`` (chunked encoding)."""
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in parts)
    return (
        b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n%s"
        b"Transfer-Encoding: chunked\r\n%s\r\n%s0\r\n\r\n" % (path.encode(), AUTH, extra, chunks)
    )


@pytest.fixture(autouse=True)
def still_serving(edge_server):
    yield
    r = good_completion(edge_server.base_url)
    assert r.status_code == 200, r.text
    edge_server.wait_pool_free()


@pytest.mark.parametrize("size", [9000, 100_000, 4_000_000])
def test_oversized_headers_are_431(edge_server, size):
    raw, _ = exchange(edge_server, b"GET /health HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * size)
    assert_error(parse(raw), 431, code="headers_too_large")


def test_many_headers_over_the_limit_are_431(edge_server):
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 90) for i in range(120))
    raw, _ = exchange(edge_server, b"GET /health HTTP/1.1\r\nHost: t\r\n" + headers + b"\r\n")
    assert_error(parse(raw), 431)


@pytest.mark.parametrize(
    "partial", [b"G", b"GET /health HTTP/1.1\r\n", b"GET /health HTTP/1.1\r\nHost: t\r\nX-A: b"]
)
def test_unfinished_headers_get_408_within_the_header_timeout(edge_server, partial):
    raw, took = exchange(edge_server, partial)
    assert_error(parse(raw), 408, code="request_timeout")
    assert took < 4  # --header-timeout 1


def test_trickled_headers_are_cut_at_the_deadline_not_per_byte(edge_server):
    host, port = edge_server.base_url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        out = b""
        for _ in range(40):  # one header byte every 0.1 s would hold it forever per-byte
            try:
                s.sendall(b"X")
            except OSError:
                break
            time.sleep(0.1)
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                out += s.recv(65536)
            s.setblocking(True)
            if out:
                break
    assert out.startswith(b"HTTP/1.1 408"), out[:80]
    assert time.monotonic() - started < 4


def test_unfinished_body_gets_408_within_the_body_timeout(edge_server):
    data = post("/v1/completions", b'{"model": "x"', AUTH).replace(
        b"Content-Length: 13", b"Content-Length: 100"
    )
    raw, took = exchange(edge_server, data)
    assert_error(parse(raw), 408, code="request_timeout")
    assert took < 4


def test_idle_connections_are_closed(edge_server):
    raw, took = exchange(edge_server, b"")
    assert raw == b"" and took < 4  # --keep-alive-timeout 1: closed, not held
    host, port = edge_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:  # after a response too
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        started, out = time.monotonic(), b""
        while chunk := s.recv(65536):
            out += chunk
        assert out.startswith(b"HTTP/1.1 200") and time.monotonic() - started < 4


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_bodies_over_the_limit_are_413(edge_server, declared):
    body = json.dumps({"model": "m", "prompt": "x" * 5000}).encode()
    if declared:
        data = post("/v1/completions", body, AUTH)
    else:
        data = post_chunked("/v1/completions", [body[:3000], body[3000:]])
    raw, _ = exchange(edge_server, data)
    assert_error(parse(raw), 413, code="body_too_large")


def test_a_chunked_body_under_the_limit_is_served(edge_server):
    body = json.dumps({"model": "veloxquant-tiny-llama", "prompt": "hi", "max_tokens": 2}).encode()
    data = post_chunked("/v1/completions", [body[:10], body[10:]], b"Connection: close\r\n")
    raw, _ = exchange(edge_server, data)
    r = parse(raw)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "data",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET /\x00health HTTP/1.1\r\n\r\n",
    ],
    ids=["garbage", "version", "bad-length", "length-and-chunked", "nul-in-path"],
)
def test_malformed_http_is_400_and_closed(edge_server, data):
    raw, _ = exchange(edge_server, data)
    assert raw.startswith(b"HTTP/1.1 400"), raw[:120]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/admin/pool/shrink"])
@pytest.mark.parametrize("body", [b"{{{", b"", b'{"model": 1}'])
def test_authentication_comes_before_the_body(edge_server, path, body):
    raw, _ = exchange(edge_server, post(path, body, b"Connection: close\r\n"))
    r = parse(raw)
    assert_error(r, 401, code="invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(
    ("path", "header"),
    [
        ("/v1/completions", "Bearer wrong-key-xx"),
        ("/v1/completions", f"Basic {API_KEY}"),
        ("/v1/completions", "Bearer"),
        ("/v1/models", ""),
        ("/admin/pool", f"Bearer {API_KEY}"),  # the API key is not the admin key
        ("/admin/pool", b"Bearer \xe9\xe9\xe9\xe9\xe9\xe9\xe9\xe9"),
    ],
)
def test_wrong_or_missing_keys_are_401(edge_server, path, header):
    headers = {"Authorization": header} if header else {}
    r = httpx.request(
        "GET" if "pool" in path or "models" in path else "POST",
        f"{edge_server.base_url}{path}",
        headers=headers,
        content=b"{}",
        timeout=10,
    )
    assert_error(r, 401)


def test_a_broken_body_with_the_right_key_is_400(edge_server):
    r = httpx.post(
        f"{edge_server.base_url}/admin/pool/shrink",
        content=b"{{{",
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=10,
    )
    assert_error(r, 400)


def test_connections_over_the_cap_get_503_and_the_rest_are_served(edge_server):
    """Past --max-connections (16 here) only health and metrics are answered, on the few
    connections kept for them; past those too, everything is 503. (Idle connections close
    after a second here: each phase opens its own.)"""
    host, port = edge_server.base_url.removeprefix("http://").split(":")

    def get(path: bytes) -> httpx.Response:
        raw, _ = exchange(
            edge_server, b"GET %s HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n" % path
        )
        return parse(raw)

    for extra, answers in ((0, 200), (8, 503)):
        held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(16 + extra)]
        try:
            assert_error(get(b"/v1/models"), 503, code="too_many_connections")
            for path in (b"/health", b"/ready", b"/metrics"):
                r = get(path)
                assert r.status_code == answers, (path, r.text[:300])
        finally:
            for s in held:
                s.close()
        time.sleep(0.2)
    assert httpx.get(f"{edge_server.base_url}/health", timeout=10).status_code == 200


def test_one_client_cannot_hold_the_connections_of_the_others(tmp_path, default_model_dir):
    """A client address over --max-connections-per-client gets 503 for its extra connections;
    another address (127.0.0.2: loopback is all of 127/8 on Linux) is still served, and a
    --trusted-proxies address is held only to the global cap."""
    os.environ["VQ_TEST_MODEL_CACHE"] = str(default_model_dir.parent)
    srv = start_server(
        tmp_path, "--n-blocks", "4000", "--max-connections", "64",
        "--max-connections-per-client", "6", "--keep-alive-timeout", "30",
        "--trusted-proxies", '["127.0.0.3"]',
    )  # fmt: skip
    host, port = srv.base_url.removeprefix("http://").split(":")

    def connect(source: str) -> socket.socket:
        return socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))

    def ask(sock: socket.socket) -> httpx.Response:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return parse(b"".join(chunks))

    held = [connect("127.0.0.1") for _ in range(6)]
    try:
        assert_error(ask(connect("127.0.0.1")), 503, code="too_many_connections")
        assert ask(connect("127.0.0.2")).status_code == 200
        held += [connect("127.0.0.3") for _ in range(10)]  # a trusted proxy: not per client
        assert ask(connect("127.0.0.3")).status_code == 200
    finally:
        for s in held:
            s.close()
        srv.wait_pool_free()
        assert stop_server(srv) == 0, srv.log()


def test_unknown_paths_and_methods(edge_server):
    assert_error(httpx.get(f"{edge_server.base_url}/v2/nothing", timeout=10), 404)
    r = httpx.get(
        f"{edge_server.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=10,
    )
    assert_error(r, 405)


def test_json_sent_as_a_form_like_curl_d_is_read_as_json(edge_server):
    body = b'{"model": "veloxquant-tiny-llama", "prompt": "hi", "max_tokens": 2}'
    data = (
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n" + AUTH
        + b"Content-Type: application/x-www-form-urlencoded\r\nConnection: close\r\n"
        + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )  # fmt: skip
    raw, _ = exchange(edge_server, data)
    assert parse(raw).status_code == 200, raw[:300]


def test_an_unparsable_request_is_a_400_in_openai_shape(edge_server):
    """uvicorn answers a request its parser cannot read in plain text; here it is JSON."""
    raw, _ = exchange(edge_server, b"GET /health HTTP/1.1\r\nHost: t\r\nBad Header\r\n\r\n")
    err = assert_error(parse(raw), 400, code="invalid_request")
    assert err["message"].startswith("invalid HTTP request")


def test_the_openapi_schema_is_not_served(edge_server):
    """It would list the /admin routes to anyone, with or without a key."""
    assert_error(httpx.get(f"{edge_server.base_url}/openapi.json", timeout=10), 404)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_half_closed_client_gets_its_answer(edge_server, stream):
    """A client may shut its sending side after a complete request (``SHUT_WR``, as
    ``curl --no-keepalive`` and some proxies do): that is not a disconnect. It gets the whole
    answer, then the server closes."""
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 6,
                       "temperature": 0, "stream": stream}).encode()  # fmt: skip
    host, port = edge_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(post("/v1/completions", body, AUTH))
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):  # until the server closes
            out += chunk
    r = parse(out)
    assert r.status_code == 200, out[:300]
    if stream:
        assert b"data: [DONE]" in out
    else:
        assert json.loads(r.content)["usage"]["completion_tokens"] == 6
