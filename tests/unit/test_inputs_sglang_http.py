"""The HTTP client of a running sglang server (--sglang-url) against misbehaving servers on 127.0.0.1: each call
ends by --sglang-request-timeout whatever the server sends (a trickle of bytes resets every per-read timeout),
a redirect is refused naming where it points and never followed, an answer larger than the call may take or
nested too deeply is refused in one line naming the server, and the flags are validated (one server spelled two
ways is one server) and reach the client. Also the message of an output without a meta_info dict."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles.config import ArgumentError, parse_args
from miles.preflight import Environment, validate_args
from miles.rollout.sglang.engine import samples_from_outputs
from miles.rollout.sglang.transport import HttpSglang, SglangCallError

SERVER_INFO = json.dumps({"version": "0.5.17", "tp_size": 1}).encode()
TRICKLE_S = 0.2  # one byte every TRICKLE_S, far below any per-read timeout
DEADLINE_S = 1.0
SLACK_S = 1.5


class _Server:
    """``handle(handler)`` answers every request, on a free port of 127.0.0.1, in threads; ``hits`` counts
    the requests."""

    def __init__(self, handle):
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.hits += 1
                try:
                    handle(self)
                except OSError:  # the client cut the connection
                    pass

            do_POST = do_GET

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def serve():
    servers = []

    def start(handle) -> _Server:
        servers.append(_Server(handle))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _trickle(wfile, data: bytes) -> None:
    for i in range(len(data)):
        wfile.write(data[i:i + 1])
        wfile.flush()
        time.sleep(TRICKLE_S)


def _trickle_body(handler, with_length: bool) -> None:
    body = SERVER_INFO + b" " * 30  # complete after ~7 s: an uncut client would get a valid answer
    handler.send_response(200)
    if with_length:
        handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.flush()
    _trickle(handler.wfile, body)
    handler.close_connection = True


def _trickle_headers(handler) -> None:
    head = b"HTTP/1.0 200 OK\r\nX-Slow: " + b"x" * 35 + b"\r\nContent-Length: %d\r\n\r\n" % len(SERVER_INFO)
    _trickle(handler.wfile, head)
    handler.wfile.write(SERVER_INFO)
    handler.close_connection = True


@pytest.mark.parametrize("handle", [lambda h: _trickle_body(h, with_length=True),
                                    lambda h: _trickle_body(h, with_length=False),
                                    _trickle_headers],
                         ids=["body-with-length", "body-until-close", "headers"])
def test_a_trickling_server_is_cut_at_the_deadline(serve, handle):
    server = serve(handle)
    start = time.monotonic()
    with pytest.raises(SglangCallError) as ei:
        HttpSglang(server.url, timeout_s=DEADLINE_S)
    took = time.monotonic() - start
    assert took < DEADLINE_S + SLACK_S, f"the call took {took:.1f} s with a {DEADLINE_S} s deadline"
    message = str(ei.value)
    assert f"sglang server {server.url}: server_info failed: no complete answer within --sglang-request-timeout 1 s" \
        in message and "Raise --sglang-request-timeout" in message


def test_a_redirect_is_refused_and_not_followed(serve):
    elsewhere = serve(lambda h: (h.send_response(200), h.send_header("Content-Length", str(len(SERVER_INFO))),
                                 h.end_headers(), h.wfile.write(SERVER_INFO)))
    target = f"{elsewhere.url}/server_info"

    def redirect(handler):
        handler.send_response(302)
        handler.send_header("Location", target)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    server = serve(redirect)
    with pytest.raises(SglangCallError) as ei:
        HttpSglang(server.url, timeout_s=5)
    assert f"server_info failed: HTTP 302: the server redirects to '{target}', and redirects are not followed" \
        in str(ei.value)
    assert server.hits == 1 and elsewhere.hits == 0


def test_a_well_behaved_answer_still_arrives(serve):
    server = serve(lambda h: (h.send_response(200), h.send_header("Content-Length", str(len(SERVER_INFO))),
                              h.end_headers(), h.wfile.write(SERVER_INFO)))
    client = HttpSglang(server.url, timeout_s=DEADLINE_S)
    assert (client.version, client.tp_size) == ("0.5.17", 1)


# ---- the flag --------------------------------------------------------------------------------------------


def _args(tmp_path, *argv):  # the tiny model: the server has its own, and the rules below come first
    return ["--rollout-engine", "sglang", "--tiny-model", "--colocate",
            "--stream-optimizer-state-to-disk", "--offload-train-target", "disk",
            "--metrics-file", str(tmp_path / "m.jsonl"), *argv]


def _env(tmp_path):
    return Environment(cuda_available=lambda: False, has_module=lambda m: m == "sglang",
                       scratch_root=str(tmp_path / "scratch"), run_id="test")


def test_the_request_timeout_reaches_the_http_client(tmp_path, serve, monkeypatch):
    from miles.rollout.sglang import engine as engine_module

    server = serve(lambda h: None)
    config = validate_args(parse_args(_args(tmp_path, "--sglang-url", server.url, "--sglang-request-timeout", "2.5")),
                           _env(tmp_path))
    assert config.rollout.sglang_request_timeout == 2.5
    built = {}

    class Recording:
        def __init__(self, url, timeout_s):
            built.update(url=url, timeout_s=timeout_s)
            self.version, self.tp_size, self.where = "0.5.17", 1, "recorded"

    monkeypatch.setattr(engine_module, "HttpSglang", Recording)
    engine_module.SglangRolloutEngine.from_config(config)
    assert built == {"url": server.url, "timeout_s": 2.5}
    assert parse_args([]).sglang_request_timeout == 3600


@pytest.mark.parametrize("argv, message", [
    (["--sglang-url", "http://h:1", "--sglang-request-timeout", "0"],
     "--sglang-request-timeout must be a finite number of seconds > 0 (got 0.0)."),
    (["--sglang-url", "http://h:1", "--sglang-request-timeout", "nan"],
     "--sglang-request-timeout must be a finite number of seconds > 0 (got nan)."),
    (["--sglang-request-timeout", "30"], "--sglang-request-timeout has no effect without --sglang-url"),
])
def test_the_request_timeout_is_validated(tmp_path, argv, message):
    with pytest.raises(ArgumentError) as ei:
        validate_args(parse_args(_args(tmp_path, *argv)), _env(tmp_path))
    assert str(ei.value).startswith(message) and "\n" not in str(ei.value)


def test_the_request_timeout_without_sglang_has_no_effect(tmp_path):
    with pytest.raises(ArgumentError, match="--sglang-request-timeout has no effect: --rollout-engine is embedded"):
        validate_args(parse_args(["--sglang-request-timeout", "30", "--metrics-file", str(tmp_path / "m.jsonl")]),
                      _env(tmp_path))


# ---- 14c: an output without a meta_info dict -------------------------------------------------------------


@pytest.mark.parametrize("output, shape", [
    ({"text": "a", "output_ids": [1]}, "a dict with keys [output_ids, text], no meta_info"),
    ({"text": "a", "meta_info": [1]}, "a dict with keys [meta_info, text], meta_info a list"),
    ("oops", "a str"),
    ({f"k{i:02d}": 0 for i in range(20)}, "a dict with keys [k00, k01, k02, k03, k04, k05, k06, k07, k08, k09, k10, "
                                          "k11, ... (20 keys)], no meta_info"),
])
def test_an_output_without_meta_info_says_what_it_has(output, shape):
    with pytest.raises(SglangCallError) as ei:
        samples_from_outputs([output], [[1]], 1, return_logprob=False, weight_version=0)
    assert str(ei.value) == f"sglang: generate failed: output 0: expected a dict with a meta_info dict; got {shape}"


def test_each_rollout_engine_drives_its_own_server(tmp_path, monkeypatch):
    from miles.rollout.sglang import engine as engine_module

    urls = ["http://node0:30000", "http://node1:30000"]
    config = validate_args(parse_args(_args(tmp_path, "--sglang-url", urls[0], "--sglang-url", urls[1],
                                            "--num-rollout-engines", "2", "--num-train-ranks", "2")), _env(tmp_path))
    built = []

    class Recording:
        def __init__(self, url, timeout_s):
            built.append(url)
            self.version, self.tp_size, self.where = "0.5.17", 1, url

    monkeypatch.setattr(engine_module, "HttpSglang", Recording)
    for engine_id in (1, 0):
        engine_module.SglangRolloutEngine.from_config(config, engine_id)
    assert built == [urls[1], urls[0]]


# ---- untrusted answers: their size and their nesting ------------------------------------------------------


def _answer(body: bytes, declared=None, on_generate: bytes = None):
    """A server answering ``server_info`` with SERVER_INFO, and every other call (or every call, without
    ``on_generate``) with ``body``; ``declared``: the Content-Length it states (None: none, ended by close)."""
    def handle(handler):
        data = on_generate if on_generate is not None and handler.path == "/generate" else body
        if on_generate is not None and handler.path == "/server_info":
            data = SERVER_INFO
        handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        handler.send_response(200)
        if declared is not None:
            handler.send_header("Content-Length", str(declared))
        handler.end_headers()
        handler.wfile.write(data)
        handler.close_connection = True
    return handle


def test_an_answer_that_declares_more_than_the_call_may_take_is_refused_unread(serve):
    server = serve(_answer(b"{}", declared=300 << 20))
    start = time.monotonic()
    with pytest.raises(SglangCallError) as ei:
        HttpSglang(server.url, timeout_s=30)
    assert time.monotonic() - start < 5
    assert str(ei.value) == (f"sglang server {server.url}: server_info failed: the answer is 314,572,800 bytes (its "
                             "Content-Length), more than the 16,777,216 this call may take: refused (is --sglang-url "
                             "an sglang server?)")


def test_an_answer_without_a_length_is_cut_at_the_limit(serve):
    server = serve(_answer(b" " * (17 << 20)))
    with pytest.raises(SglangCallError) as ei:
        HttpSglang(server.url, timeout_s=30)
    assert str(ei.value).startswith(f"sglang server {server.url}: server_info failed: the answer is more than "
                                    "16,777,216 bytes, more than the 16,777,216 this call may take: refused")


def test_a_generate_answer_is_bounded_by_what_the_call_asked_for(serve):
    from miles.rollout.sglang.transport import answer_limit

    one = {"text": "a", "output_ids": [5], "meta_info": {"finish_reason": {"type": "stop"}}}
    small = {"input_ids": [[1, 2]], "sampling_params": [{"max_new_tokens": 8}]}
    limit = answer_limit("generate", small)
    assert limit == 64 * 1024 + 10 * 512 and answer_limit("server_info", None) == 16 << 20
    huge = {"input_ids": [[1]] * 10**6, "sampling_params": [{"max_new_tokens": 10**5}] * 10**6}
    assert answer_limit("generate", huge) == 512 << 20  # the cap whatever the batch
    padded = json.dumps([one]).encode() + b" " * limit
    client = HttpSglang(serve(_answer(b"", on_generate=padded, declared=None)).url, timeout_s=30)
    with pytest.raises(SglangCallError, match=f"generate failed: the answer is more than {limit:,} bytes"):
        client.request("generate", small)
    fits = HttpSglang(serve(_answer(b"", on_generate=json.dumps([one]).encode())).url, timeout_s=30)
    assert fits.request("generate", small) == [one]


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000,
                                  b'{"version": "0.5.17", "tp_size": 1, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"])
def test_a_deeply_nested_answer_is_refused_in_one_line(serve, body):
    server = serve(_answer(body, declared=len(body)))
    with pytest.raises(SglangCallError) as ei:
        HttpSglang(server.url, timeout_s=30)
    message = str(ei.value)
    assert message.startswith(f"sglang server {server.url}: server_info failed: the answer is not JSON miles reads: "
                              "nested ") and "levels deep, more than the 16 it may have" in message, message


def test_a_deeply_nested_error_body_is_shown_as_text(serve):
    nested = b"[" * 3000 + b"]" * 3000

    def error(handler):
        handler.send_response(500)
        handler.send_header("Content-Length", str(len(nested)))
        handler.end_headers()
        handler.wfile.write(nested)

    with pytest.raises(SglangCallError, match=r"server_info failed: HTTP 500: \[\[\["):
        HttpSglang(serve(error).url, timeout_s=30)


# ---- --sglang-url: one server, however spelled; a port in 1-65535; the flag named ------------------------------


@pytest.mark.parametrize("urls", [
    ("http://localhost:30000", "http://127.0.0.1:30000"),
    ("http://127.0.0.1:30000", "http://[::1]:30000"),
    ("HTTP://node0:30000", "http://node0:30000"),
    ("http://NODE0:30000", "http://node0:30000/"),
    ("http://node0:030000", "http://node0:30000"),
    ("http://node0", "http://node0:80"),
])
def test_one_server_spelled_two_ways_is_named_once(tmp_path, urls):
    def argv(*pair):
        return _args(tmp_path, "--sglang-url", pair[0], "--sglang-url", pair[1], "--num-rollout-engines", "2",
                     "--num-train-ranks", "2")

    with pytest.raises(ArgumentError) as ei:
        validate_args(parse_args(argv(*urls)), _env(tmp_path))
    assert str(ei.value).startswith(f"--sglang-url names the server {urls[0]} more than once ({urls[0]}, {urls[1]}): "
                                    "two rollout engines would drive one server. Fix: name each server once.")
    other_port = urls[1].rstrip("/").rsplit(":", 1)[0] + ":30001"  # two servers on one host are two
    assert validate_args(parse_args(argv(urls[0], other_port)), _env(tmp_path)).rollout.sglang_url == (urls[0],
                                                                                                      other_port)


@pytest.mark.parametrize("url, problem", [
    ("http://h:0", "its port is not a number in 1-65535"),
    ("http://[::1:30000", "it does not parse as a URL (Invalid IPv6 URL)"),
])
def test_a_url_that_names_no_server_is_refused_naming_the_url_flag(tmp_path, url, problem):
    with pytest.raises(ArgumentError) as ei:
        validate_args(parse_args(_args(tmp_path, "--sglang-url", url)), _env(tmp_path))
    assert str(ei.value) == (f"--sglang-url {url!r}: {problem}; pass e.g. http://127.0.0.1:30000. Fix: fix "
                             "--sglang-url as the message says.")
    assert ei.value.flags == ("--sglang-url",)
