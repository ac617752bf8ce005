"""sglang behind the rollout-engine contract (:class:`miles.rollout.contract.RolloutEngine`).

This package's top level is light (no torch, no sglang): the tested versions, and the pure parsing of the
``--sglang-*`` flags that validation and the engine share. The engine itself is
:class:`miles.rollout.sglang.engine.SglangRolloutEngine` (in-process ``sglang.Engine``, or a running
server over HTTP); the weight payloads sglang takes are built by :mod:`miles.rollout.sglang.payloads`
with sglang's own classes, imported when first used.
"""

from __future__ import annotations

import ipaddress
import json
import keyword
import re
import urllib.parse
from typing import Any, Iterable, Optional

__all__ = ["TESTED_SGLANG_VERSION", "TESTED_TORCH_VERSION", "WEIGHT_SESSION_SINCE", "INSTALL_HINT",
           "RESERVED_SERVER_ARGS", "parse_version", "needs_weight_session", "parse_server_args", "check_url",
           "server_address"]

TESTED_SGLANG_VERSION = "0.5.17"
TESTED_TORCH_VERSION = "2.11.0"  # what sglang 0.5.11-0.5.17 pin
# From this version on sglang refuses a weight update outside begin_weight_update/end_weight_update.
WEIGHT_SESSION_SINCE = (0, 5, 21)
INSTALL_HINT = (f"pip install --no-deps sglang=={TESTED_SGLANG_VERSION} into an environment with "
                f"torch=={TESTED_TORCH_VERSION} (CUDA 13); docs/advanced/sglang.md lists the other packages")

# Server arguments that miles sets itself, from its own flags: a pass-through may not set them.
RESERVED_SERVER_ARGS = {
    "model_path": "--hf-checkpoint",
    "tp_size": "--sglang-tp-size",
    "mem_fraction_static": "--sglang-mem-fraction-static",
    "enable_memory_saver": "--colocate",
    "random_seed": "--rollout-seed",
    "base_gpu_id": "the engine's GPU, chosen by Ray",
}

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: Any) -> tuple[int, int, int]:
    """``"0.5.21.post1"`` -> ``(0, 5, 21)``; ValueError naming the text when it does not start with a version."""
    match = _VERSION.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"sglang reported the version {text!r}, which does not read as MAJOR.MINOR[.PATCH]")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def needs_weight_session(version: tuple[int, int, int]) -> bool:
    """Whether this sglang version takes weight updates only between begin/end_weight_update."""
    return tuple(version) >= WEIGHT_SESSION_SINCE


def _server_arg_value(text: str) -> Any:
    """JSON literals become their value (``true``, ``0.7``, ``8``, ``null``, ``[1, 2]``); anything else is a
    string (``triton``, ``fa3``), so backends and paths need no quotes."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_server_args(items: Iterable[str]) -> dict[str, Any]:
    """``["attention_backend=triton", "disable_cuda_graph=true"]`` -> ``{"attention_backend": "triton",
    "disable_cuda_graph": True}``. ValueError naming the item for: no ``=``, a key that is not a Python
    identifier (sglang's ``ServerArgs`` field names; dashes are not accepted), a key given twice, or a key
    miles sets from its own flag (:data:`RESERVED_SERVER_ARGS`)."""
    out: dict[str, Any] = {}
    for item in items:
        if not isinstance(item, str) or "=" not in item:
            raise ValueError(f"--sglang-server-arg {item!r} is not KEY=VALUE (e.g. attention_backend=triton)")
        key, value = item.split("=", 1)
        if not key.isidentifier() or keyword.iskeyword(key):
            raise ValueError(f"--sglang-server-arg {item!r}: the key {key!r} is not an sglang ServerArgs field name "
                             f"(an identifier such as {key.replace('-', '_').strip('_') or 'attention_backend'!r})")
        if key in RESERVED_SERVER_ARGS:
            raise ValueError(f"--sglang-server-arg {item!r}: miles sets {key} from {RESERVED_SERVER_ARGS[key]}; "
                             "use that instead")
        if key in out:
            raise ValueError(f"--sglang-server-arg sets {key} twice; pass each key once")
        out[key] = _server_arg_value(value)
    return out


def _parsed_url(url: Any) -> tuple[Optional[urllib.parse.SplitResult], Optional[str]]:
    """``(parsed, None)`` for the URL of a running sglang server, ``(None, problem)`` otherwise."""
    try:
        parsed = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    except ValueError as e:  # a malformed IPv6 address ("[::1:30000")
        return None, f"it does not parse as a URL ({e})"
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
        return None, "it is not http(s)://HOST[:PORT]"
    if parsed.path not in ("", "/") or parsed.query or parsed.fragment:
        return None, "it has a path, query or fragment (miles adds the endpoint paths itself)"
    if parsed.username or parsed.password:
        return None, "it carries credentials"
    try:
        port = parsed.port  # ValueError for a port that is not a number or beyond 65535
    except ValueError:
        port = 0
    if port == 0:
        return None, "its port is not a number in 1-65535"
    return parsed, None


def check_url(url: str) -> str:
    """The URL of a running sglang server, ``http(s)://host[:port]`` (port 1-65535) with no path, query or
    credentials; it is returned without a trailing slash. ValueError naming the URL and ``--sglang-url``
    otherwise."""
    server_address(url)
    return url.rstrip("/")


_LOOPBACK = "loopback"
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


def server_address(url: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` naming the server a checked URL reaches, so that two spellings of one server
    compare equal: scheme and host in lower case, an IP address in its canonical form, ``localhost``,
    ``127.0.0.1`` and ``::1`` as one loopback, the port as a number (the scheme's default when none is given).
    ValueError as :func:`check_url`."""
    parsed, problem = _parsed_url(url)
    if problem:
        raise ValueError(f"--sglang-url {url!r}: {problem}; pass e.g. http://127.0.0.1:30000")
    host = parsed.hostname.lower()
    try:
        host = ipaddress.ip_address(host).compressed
    except ValueError:
        pass  # a name, not an address
    if host in _LOOPBACK_NAMES:
        host = _LOOPBACK
    return parsed.scheme.lower(), host, parsed.port or _DEFAULT_PORTS[parsed.scheme.lower()]
