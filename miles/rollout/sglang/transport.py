"""How the sglang client reaches sglang: an in-process ``sglang.Engine``, or a running server over HTTP.

Both take the same requests, named by sglang's HTTP endpoints (``generate``, ``release_memory_occupation``,
``update_weights_from_tensor``, ...) with the endpoint's JSON body; the in-process transport calls the
``sglang.Engine`` method of that name with the body as keywords. Results keep sglang's shapes; failures
sglang reports in them (``(False, message)``, ``{"success": false, ...}``, ``{"error": {"message": ...}}``,
an HTTP error status) raise :class:`SglangCallError` naming the call (:func:`raise_for_failure`).
HTTP uses only the standard library (``http.client``): each call ends by the deadline
``--sglang-request-timeout`` (connect, send and the whole answer), and a redirect is an error naming where it
points, never followed. An answer is untrusted: its size is bounded before it is read (by what the call asked
for: :func:`answer_limit`; a ``Content-Length`` above it is refused unread, and reading stops past it), and its
JSON's nesting before it is parsed (:mod:`miles.untrusted_json`). A read that changes nothing on the server
(``health``, ``server_info``: HTTP GET) is tried again, :data:`READ_RETRIES` times with a doubling pause, when the
server cannot be reached (it may be restarting); a call that changes the server's state is never repeated, and
no call is tried again past its deadline.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
import urllib.parse
from typing import Any, Optional

from miles.untrusted_json import UntrustedJSONError, parse_bounded

logger = logging.getLogger(__name__)

__all__ = ["SglangCallError", "SglangUnreachableError", "raise_for_failure", "InProcessSglang", "HttpSglang", "MAX_RESPONSE_BYTES",
           "answer_limit"]

# A generate answer of a large batch with log-probs is tens of MiB; more than this is not an sglang answer.
MAX_RESPONSE_BYTES = 512 * 1024 * 1024
# Every other answer (server_info, health, memory, weight updates, flush_cache) is a few KiB.
MAX_CONTROL_ANSWER_BYTES = 16 * 1024 * 1024
# A generate answer per request: its fixed fields, and per token (prompt and new) at most an id, a
# (logprob, id, text) triple and the token's text, JSON-escaped.
_ANSWER_BYTES_PER_REQUEST = 64 * 1024
_ANSWER_BYTES_PER_TOKEN = 512
_MAX_ANSWER_DEPTH = 16  # sglang's answers nest 5 deep (a list of outputs, meta_info, log-prob triples)
_MESSAGE_CHARS = 2000
_SERVER_WHERE = "sglang server "  # how HttpSglang's errors name the server: "sglang server http://HOST:PORT"
# What of an error answer is read: enough for its JSON to parse around a long message, which is then cut to
# _MESSAGE_CHARS; a body cut here is shown as the text it is.
_ERROR_BODY_BYTES = 64 * 1024
_READ_CHUNK = 1024 * 1024
# A read is tried this many more times when the server cannot be reached, first after READ_RETRY_PAUSE_S, each
# pause twice the last (1 + 2 + 4 s): long enough for a dropped connection, short of hiding a server that is down.
READ_RETRIES = 3
READ_RETRY_PAUSE_S = 1.0


class SglangCallError(RuntimeError):
    """sglang refused or failed a call: ``call`` (the endpoint) and ``message`` (sglang's words)."""

    def __init__(self, call: str, message: str, where: str = "sglang"):
        self.call = call
        self.message = message
        self.where = where
        super().__init__(f"{where}: {call} failed: {message}")

    def __reduce__(self):  # rebuilt from its parts where Ray hands it to the driver (args hold only the line)
        return type(self), (self.call, self.message, self.where)

    @property
    def from_server(self) -> bool:
        """The call went to a server over HTTP (:class:`HttpSglang`), whose own log holds the rest; not to an
        in-process engine, whose traceback is the place to look."""
        return self.where.startswith(_SERVER_WHERE)


class SglangUnreachableError(SglangCallError):
    """The server did not answer at all: no connection, or the connection broke before the whole answer came
    (the server stopped or restarted). The one failure a read is tried again for."""


def _short(text: Any) -> str:
    text = str(text)
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS] + f"... ({len(text)} characters)"


def answer_limit(endpoint: str, body: Optional[dict]) -> int:
    """The most bytes sglang's answer to this call may hold: for ``generate``, what its requests can produce
    (:data:`_ANSWER_BYTES_PER_REQUEST` each, plus :data:`_ANSWER_BYTES_PER_TOKEN` per prompt token and per
    ``max_new_tokens``), at most :data:`MAX_RESPONSE_BYTES`; for every other call
    :data:`MAX_CONTROL_ANSWER_BYTES`."""
    if endpoint != "generate" or not isinstance(body, dict):
        return MAX_CONTROL_ANSWER_BYTES
    prompts, params = body.get("input_ids") or [], body.get("sampling_params") or []
    tokens = sum(len(ids) for ids in prompts) + sum(int(p.get("max_new_tokens", 0)) for p in params)
    return min(MAX_RESPONSE_BYTES, len(prompts) * _ANSWER_BYTES_PER_REQUEST + tokens * _ANSWER_BYTES_PER_TOKEN)


def raise_for_failure(call: str, result: Any, where: str = "sglang") -> Any:
    """``result`` when it reports success (or reports nothing), else SglangCallError with sglang's message."""
    if isinstance(result, tuple) and len(result) >= 2 and isinstance(result[0], bool):
        if not result[0]:
            raise SglangCallError(call, _short(result[1]), where)
    elif isinstance(result, dict):
        if isinstance(result.get("error"), dict):
            raise SglangCallError(call, _short(result["error"].get("message", result["error"])), where)
        if result.get("success") is False:
            raise SglangCallError(call, _short(result.get("message", "success=False, no message")), where)
    return result


# The one keyword whose name differs between the HTTP body and sglang.Engine's method.
_ENGINE_KEYWORDS = {"update_weights_from_tensor": {"serialized_named_tensors": "named_tensors"}}


class InProcessSglang:
    """``sglang.Engine(**server_args)`` in this process (sglang imported here, at construction)."""

    def __init__(self, server_args: dict[str, Any]):
        import sglang

        self.where = "sglang engine (in-process)"
        self.version = str(sglang.__version__)
        self.engine = sglang.Engine(**server_args)
        self.tp_size = int(server_args.get("tp_size", 1))
        self.closed = False

    def request(self, endpoint: str, body: Optional[dict] = None) -> Any:
        renames = _ENGINE_KEYWORDS.get(endpoint, {})
        kwargs = {renames.get(k, k): v for k, v in (body or {}).items()}
        try:
            result = getattr(self.engine, endpoint)(**kwargs)
        except Exception as e:  # sglang raises its own types (AssertionError, ValueError, ...)
            raise SglangCallError(endpoint, f"{type(e).__name__}: {_short(e)}", self.where) from e
        return raise_for_failure(endpoint, result, self.where)

    def health(self) -> bool:
        return not self.closed

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine.shutdown()


class HttpSglang:
    """A running sglang server at ``url`` (checked by :func:`miles.rollout.sglang.check_url`). The version and
    tensor-parallel size come from its ``/server_info``. Each call ends within ``timeout_s`` seconds
    (``--sglang-request-timeout``)."""

    def __init__(self, url: str, timeout_s: float):
        from miles.rollout.sglang import check_url

        self.url = check_url(url)
        self.where = f"{_SERVER_WHERE}{self.url}"
        self.timeout_s = timeout_s
        info = self._server_info()
        if "version" not in info or "tp_size" not in info:
            raise SglangCallError("server_info", f"the answer has no version or tp_size (keys: {sorted(info)[:12]})",
                                  self.where)
        self.version = str(info["version"])
        self.tp_size = info["tp_size"]
        self.closed = False

    def _server_info(self) -> dict:
        try:
            info = self._read("server_info")
        except SglangCallError as e:
            if "HTTP 404" not in e.message:
                raise
            info = self._read("get_server_info")  # the older spelling
        if not isinstance(info, dict):
            raise SglangCallError("server_info", f"expected a JSON object, got {type(info).__name__}", self.where)
        return info

    def _send(self, endpoint: str, body: Optional[dict]) -> Any:
        data = None if body is None else json.dumps(body).encode()
        status, location, raw = _exchange(self.url, endpoint, data, self.timeout_s, self.where,
                                          answer_limit(endpoint, body))
        if 300 <= status < 400:
            raise SglangCallError(endpoint, f"HTTP {status}: the server redirects to {_short(location)!r}, and "
                                  "redirects are not followed; pass the server's own address as --sglang-url",
                                  self.where)
        if status >= 400:
            text = raw.decode(errors="replace")
            raise SglangCallError(endpoint, f"HTTP {status}: {_short(_error_text(text))}", self.where)
        text = raw.strip()
        if not text:
            return None
        try:
            return parse_bounded(raw, max_depth=_MAX_ANSWER_DEPTH)
        except UntrustedJSONError as e:
            if text[:1] in (b"[", b"{"):
                raise SglangCallError(endpoint, f"the answer is not JSON miles reads: {e}", self.where) from None
            return raw.decode(errors="replace")  # flush_cache answers in plain text

    def _read(self, endpoint: str) -> Any:
        """A GET, tried again (:data:`READ_RETRIES` times, pausing 1, 2, 4 s) while the server cannot be
        reached; SglangUnreachableError saying how many tries over how long when it never answers."""
        pause, waited = READ_RETRY_PAUSE_S, 0.0
        for attempt in range(READ_RETRIES + 1):
            try:
                return self._send(endpoint, None)
            except SglangUnreachableError as e:
                if attempt == READ_RETRIES:
                    raise SglangUnreachableError(endpoint, f"{e.message} ({READ_RETRIES + 1} tries over "
                                                 f"{waited:g} s of pauses)", self.where) from None
                logger.warning("%s: %s unanswered (%s); trying again in %g s (%d of %d)", self.where, endpoint,
                               e.message, pause, attempt + 1, READ_RETRIES)
                time.sleep(pause)
                waited += pause
                pause *= 2

    def request(self, endpoint: str, body: Optional[dict] = None) -> Any:
        return raise_for_failure(endpoint, self._send(endpoint, body if body is not None else {}), self.where)

    def health(self) -> bool:
        if self.closed:
            return False
        try:
            self._read("health")
        except SglangCallError:
            return False
        return True

    def shutdown(self) -> None:
        self.closed = True  # the server is not ours: it keeps running


def _exchange(url: str, endpoint: str, data: Optional[bytes], timeout_s: float, where: str,
              limit: int) -> tuple[int, str, bytes]:
    """One request, ``(status, Location header, body)``, ended by the deadline ``timeout_s`` from now whatever
    the server does: a socket timeout bounds the connect, and a timer cuts the connection at the deadline
    (a server trickling bytes resets every per-read timeout). A body of more than ``limit`` bytes (an error's:
    a short message) is refused: unread when its Content-Length says so, else once reading passes the limit.
    ``http.client`` follows no redirects: a 3xx comes back as its status."""
    parsed = urllib.parse.urlsplit(url)
    connection_class = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parsed.hostname, parsed.port, timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    cut = threading.Event()
    connected: list[socket.socket] = []  # the connection drops its socket once an answer says it will close

    def cut_at_deadline() -> None:
        cut.set()
        for sock in connected:
            try:  # the plain socket's shutdown (also under TLS) wakes a read blocked in another thread
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout_s, cut_at_deadline)
    timer.daemon = True
    timer.start()
    sent = False
    try:
        connection.connect()
        connected.append(connection.sock)
        if cut.is_set():  # the timer fired before the connection had a socket to cut
            raise TimeoutError("connected after the deadline")
        headers = {"Content-Type": "application/json"} if data is not None else {}
        connection.request("GET" if data is None else "POST", f"/{endpoint}", body=data, headers=headers)
        sent = True
        status, location, body, limit = _read_answer(connection.getresponse(), limit, endpoint, where)
    except (OSError, http.client.HTTPException) as e:
        if cut.is_set() or time.monotonic() >= deadline:  # the connect's own timeout ends at the deadline too
            raise _past_deadline(endpoint, timeout_s, where) from None
        raise _unreachable(e, sent, url, endpoint, where) from None
    finally:
        timer.cancel()
        connection.close()
    if cut.is_set():  # the cut may end an answer of unknown length as if it were complete
        raise _past_deadline(endpoint, timeout_s, where)
    if len(body) > limit:
        if status >= 300:
            del body[limit:]  # an error's message, cut
        else:
            raise _too_large(endpoint, f"more than {limit:,} bytes", limit, where)
    return status, location, bytes(body)


def _read_answer(response: http.client.HTTPResponse, limit: int, endpoint: str,
                 where: str) -> tuple[int, str, bytearray, int]:
    """``(status, Location header, body, its limit)``: an error's body is bounded by ``_ERROR_BODY_BYTES``, an
    answer's by ``limit`` (refused unread when its Content-Length says more); one byte past the limit is read so
    the caller sees it was passed."""
    status, location = response.status, response.getheader("Location", "")
    if status >= 300:
        limit = _ERROR_BODY_BYTES
    else:
        _check_declared_length(response.getheader("Content-Length"), limit, endpoint, where)
    body = bytearray()
    while len(body) <= limit:
        chunk = response.read(min(_READ_CHUNK, limit + 1 - len(body)))
        if not chunk:
            break
        body += chunk
    return status, location, body, limit


def _unreachable(e: Exception, sent: bool, url: str, endpoint: str, where: str) -> "SglangUnreachableError":
    if sent:  # the request went out: the server may have acted on it before it went away
        return SglangUnreachableError(endpoint, f"the server dropped the connection before answering in full "
                                      f"({type(e).__name__}: {_short(e)}); did it stop or restart? Check its log",
                                      where)
    return SglangUnreachableError(endpoint, f"cannot reach the server ({type(e).__name__}: {_short(e)}); is it "
                                  f"running at {url}?", where)


def _check_declared_length(declared: Optional[str], limit: int, endpoint: str, where: str) -> None:
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise _too_large(endpoint, f"{int(declared):,} bytes (its Content-Length)", limit, where)


def _too_large(endpoint: str, size: str, limit: int, where: str) -> SglangCallError:
    return SglangCallError(endpoint, f"the answer is {size}, more than the {limit:,} this call may take: refused "
                           "(is --sglang-url an sglang server?)", where)


def _past_deadline(endpoint: str, timeout_s: float, where: str) -> SglangCallError:
    return SglangCallError(endpoint, f"no complete answer within --sglang-request-timeout {timeout_s:g} s (connect, "
                           "send and the whole answer); the call was cut. Raise --sglang-request-timeout if the "
                           "server is busy but well, e.g. for a large generate batch", where)


def _error_text(text: str) -> str:
    """sglang's error body (``{"error": {"message"}}``, ``{"message"}``, ``{"detail"}``) as its message."""
    try:
        body = parse_bounded(text, max_depth=_MAX_ANSWER_DEPTH)
    except UntrustedJSONError:
        return text
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail"):
            if key in body:
                return str(body[key])
    return text
