"""A stream whose client takes no data is let go after --stream-write-timeout: its requests are
cancelled, their blocks freed and its connection dropped, while other clients are served."""

from __future__ import annotations

import json
import os
import re
import socket
import time

import httpx

from tests.reliability.conftest import MODEL, start_server, stop_server


def _cancelled(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    m = re.search(r'^veloxquant_requests_finished_total\{reason="cancelled"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_client_that_never_reads_is_cancelled_and_dropped(tmp_path, default_model_dir):
    os.environ["VQ_TEST_MODEL_CACHE"] = str(default_model_dir.parent)
    srv = start_server(
        tmp_path, "--n-blocks", "8000", "--stream-write-timeout", "2",
        "--stream-interval-ms", "0",
    )  # fmt: skip
    host, port = srv.base_url.removeprefix("http://").split(":")
    body = json.dumps({
        "model": MODEL, "prompt": "tell me everything", "max_tokens": 2000, "n": 8,
        "temperature": 0, "logprobs": 5, "stream": True,
    }).encode()  # fmt: skip
    sock = socket.socket()
    # A small window; the server's kernel still takes a few MB, so the stream makes more (8
    # greedy choices of 2,000 tokens with logprobs: ~6 MB) before its sends block.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        before = _cancelled(srv.base_url)
        deadline = time.monotonic() + 120
        while _cancelled(srv.base_url) < before + 8:  # every choice of the stream
            assert time.monotonic() < deadline, "the stalled stream was never cancelled"
            r = httpx.post(
                f"{srv.base_url}/v1/completions",
                json={"model": MODEL, "prompt": "others are served", "max_tokens": 4},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            time.sleep(0.5)
        # the connection was dropped: what is left to read ends, it does not hang
        sock.settimeout(10)
        with_data = True
        while with_data:
            with_data = bool(sock.recv(1 << 20))
    finally:
        sock.close()
    srv.wait_pool_free()
    assert "took no data" in srv.log()
    assert stop_server(srv) == 0, srv.log()
