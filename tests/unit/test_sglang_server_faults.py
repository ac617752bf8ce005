"""The HTTP client of an sglang server (--sglang-url) when the server fails: a read that changes nothing (health,
server_info) is tried again, a bounded number of times with a doubling pause, while the server cannot be
reached; a call that changes the server's state (generate, a weight update) is sent once and its failure says
the server dropped it; the error crosses processes (Ray) with its parts. The run-level behaviour of each fault is
tests/e2e/test_sglang_server_faults_e2e.py."""

from __future__ import annotations

import json
import logging
import pickle
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles.rollout.sglang import transport
from miles.rollout.sglang.transport import HttpSglang, SglangCallError, SglangUnreachableError

SERVER_INFO = json.dumps({"version": "0.5.17", "tp_size": 1}).encode()
PAUSE_S = 0.05


@pytest.fixture(autouse=True)
def short_pauses(monkeypatch):
    monkeypatch.setattr(transport, "READ_RETRY_PAUSE_S", PAUSE_S)


class _Server:
    """Answers server_info and health; ``on_post(handler)`` answers every POST. Counts requests per path."""

    def __init__(self, on_post=None, port: int = 0):
        self.hits: dict[str, int] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.hits[self.path] = outer.hits.get(self.path, 0) + 1
                body = SERVER_INFO if self.path == "/server_info" else b""
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                outer.hits[self.path] = outer.hits.get(self.path, 0) + 1
                on_post(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_read_is_tried_again_until_a_restarting_server_answers(caplog):
    port = _free_port()
    started = []
    later = threading.Timer(PAUSE_S * 2, lambda: started.append(_Server(port=port)))  # up before the third try
    later.start()
    try:
        with caplog.at_level(logging.WARNING, logger="miles.rollout.sglang.transport"):
            client = HttpSglang(f"http://127.0.0.1:{port}", timeout_s=5)
    finally:
        later.join()
        for server in started:
            server.close()
    assert (client.version, client.tp_size) == ("0.5.17", 1)
    retries = [r.getMessage() for r in caplog.records]
    assert 1 <= len(retries) <= transport.READ_RETRIES
    assert retries[0].startswith(f"sglang server http://127.0.0.1:{port}: server_info unanswered (cannot reach the "
                                 "server (ConnectionRefusedError")
    assert retries[0].endswith(f"trying again in {PAUSE_S:g} s (1 of {transport.READ_RETRIES})")


def test_a_server_that_never_answers_a_read_fails_after_the_bounded_tries():
    url = f"http://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    with pytest.raises(SglangUnreachableError) as ei:
        HttpSglang(url, timeout_s=5)
    took = time.monotonic() - start
    pauses = PAUSE_S * (2 ** transport.READ_RETRIES - 1)  # 1 + 2 + 4 pauses
    assert pauses <= took < pauses + 2, took
    assert str(ei.value).startswith(f"sglang server {url}: server_info failed: cannot reach the server "
                                    "(ConnectionRefusedError")
    assert str(ei.value).endswith(f"is it running at {url}? ({transport.READ_RETRIES + 1} tries over {pauses:g} s "
                                  "of pauses)")


def test_health_is_tried_again_then_answers_false():
    server = _Server()
    client = HttpSglang(server.url, timeout_s=5)
    assert client.health() and server.hits["/health"] == 1
    server.close()
    assert client.health() is False


def _drop(handler):
    handler.close_connection = True
    handler.connection.shutdown(socket.SHUT_RDWR)  # killed before it answered


@pytest.mark.parametrize("endpoint", ["generate", "update_weights_from_tensor", "begin_weight_update"])
def test_a_call_that_changes_the_server_is_sent_once_and_says_the_server_dropped_it(endpoint):
    server = _Server(on_post=_drop)
    try:
        client = HttpSglang(server.url, timeout_s=5)
        with pytest.raises(SglangUnreachableError) as ei:
            client.request(endpoint, {})
    finally:
        server.close()
    assert server.hits[f"/{endpoint}"] == 1
    assert str(ei.value).startswith(f"sglang server {server.url}: {endpoint} failed: the server dropped the "
                                    "connection before answering in full (")
    assert str(ei.value).endswith("did it stop or restart? Check its log")


@pytest.mark.parametrize("status, body, said", [
    (200, {"success": False, "message": "weights rejected"}, "weights rejected"),
    (400, {"success": False, "message": "y" * 9000}, "HTTP 400: " + "y" * 100),
])
def test_a_refused_update_names_the_server_and_what_it_said_bounded(status, body, said):
    def refuse(handler):
        data = json.dumps(body).encode()
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    server = _Server(on_post=refuse)
    try:
        client = HttpSglang(server.url, timeout_s=5)
        with pytest.raises(SglangCallError) as ei:
            client.request("update_weights_from_tensor", {})
    finally:
        server.close()
    message = str(ei.value)
    assert message.startswith(f"sglang server {server.url}: update_weights_from_tensor failed: {said}")
    assert "\n" not in message and len(message) < 2200 and server.hits["/update_weights_from_tensor"] == 1


@pytest.mark.parametrize("error, from_server", [
    (SglangCallError("generate", "HTTP 400: no", "sglang server http://h:1"), True),
    (SglangUnreachableError("generate", "gone", "sglang server http://h:1"), True),
    (SglangCallError("generate", "AssertionError: no", "sglang engine (in-process)"), False),
])
def test_the_error_crosses_processes_with_its_parts(error, from_server):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert (copy.call, copy.message, copy.where) == (error.call, error.message, error.where)
    assert copy.from_server is from_server  # the run logs no traceback for a server's error, and does for the rest
