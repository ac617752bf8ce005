"""How the sglang client reaches sglang: an in-process ``sglang.Engine``, or a running server over HTTP.

Both take the same requests, named by sglang's HTTP endpoints (``generate``, ``release_memory_occupation``,
``update_weights_from_tensor``, ...) with the endpoint's JSON body; the in-process transport calls the
``sglang.Engine`` method of that name with the body as keywords. Results keep sglang's shapes; failures
sglang reports in them (``(False, message)``, ``{"success": false, ...}``, ``{"error": {"message": ...}}``,
an HTTP error status) raise :class:`SglangCallError` naming the call (:func:`raise_for_failure`).
HTTP uses only the standard library (``urllib``).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Optional

__all__ = ["SglangCallError", "raise_for_failure", "InProcessSglang", "HttpSglang", "MAX_RESPONSE_BYTES"]

# A generate answer of a large batch with log-probs is tens of MiB; more than this is not an sglang answer.
MAX_RESPONSE_BYTES = 512 * 1024 * 1024
_MESSAGE_CHARS = 2000


class SglangCallError(RuntimeError):
    """sglang refused or failed a call: ``call`` (the endpoint) and ``message`` (sglang's words)."""

    def __init__(self, call: str, message: str, where: str = "sglang"):
        self.call = call
        self.message = message
        super().__init__(f"{where}: {call} failed: {message}")


def _short(text: Any) -> str:
    text = str(text)
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS] + f"... ({len(text)} characters)"


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
    tensor-parallel size come from its ``/server_info``."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        from miles.rollout.sglang import check_url

        self.url = check_url(url)
        self.where = f"sglang server {self.url}"
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
            info = self._send("server_info", None)
        except SglangCallError as e:
            if "HTTP 404" not in e.message:
                raise
            info = self._send("get_server_info", None)  # the older spelling
        if not isinstance(info, dict):
            raise SglangCallError("server_info", f"expected a JSON object, got {type(info).__name__}", self.where)
        return info

    def _send(self, endpoint: str, body: Optional[dict]) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}/{endpoint}", data=data, method="GET" if data is None else "POST",
                                         headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as e:
            text = e.read(_MESSAGE_CHARS * 4).decode(errors="replace")
            raise SglangCallError(endpoint, f"HTTP {e.code}: {_short(_error_text(text))}", self.where) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise SglangCallError(endpoint, f"cannot reach the server ({reason}); is it running at {self.url}?",
                                  self.where) from None
        if len(raw) > MAX_RESPONSE_BYTES:
            raise SglangCallError(endpoint, f"the answer exceeds {MAX_RESPONSE_BYTES} bytes: refused", self.where)
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")  # flush_cache answers in plain text

    def request(self, endpoint: str, body: Optional[dict] = None) -> Any:
        return raise_for_failure(endpoint, self._send(endpoint, body if body is not None else {}), self.where)

    def health(self) -> bool:
        if self.closed:
            return False
        try:
            self._send("health", None)
        except SglangCallError:
            return False
        return True

    def shutdown(self) -> None:
        self.closed = True  # the server is not ours: it keeps running


def _error_text(text: str) -> str:
    """sglang's error body (``{"error": {"message"}}``, ``{"message"}``, ``{"detail"}``) as its message."""
    try:
        body = json.loads(text)
    except ValueError:
        return text
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail"):
            if key in body:
                return str(body[key])
    return text
