"""The Ray cluster a run uses: a private single-node cluster of its own, or the cluster ``RAY_ADDRESS`` names,
reached within :data:`CONNECT_TIMEOUT_S`.

A plain ``ray.init()`` joins the latest cluster a ``ray start`` left on the machine (Ray records it in
``<temp dir>/ray/ray_current_cluster``), even a dead one, whose address Ray then retries without end. A run
without ``RAY_ADDRESS`` therefore starts its own cluster (Ray's ``address="local"``), whatever else runs on the
machine; one with ``RAY_ADDRESS`` first checks that the cluster's GCS port answers, and stops with one line
naming the address when it does not."""

from __future__ import annotations

import logging
import socket
import time
from typing import Optional
from urllib.parse import urlsplit

import ray

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 15.0  # a head that is still starting gets this long to open its port
_RETRY_S = 0.5
# Ray's own INFO lines ("Started a local Ray instance") carry a second timestamp format: warnings only
_RAY_LOG_LEVEL = logging.WARNING


class ClusterError(RuntimeError):
    """The cluster RAY_ADDRESS names cannot be reached (one line: the address, why, and what to do)."""


def start_private() -> None:
    """A new single-node cluster for this run only, bound to loopback, without a dashboard."""
    logger.info("starting a private Ray cluster for this run (RAY_ADDRESS runs it on an existing cluster instead)")
    ray.init(address="local", include_dashboard=False, log_to_driver=True, logging_level=_RAY_LOG_LEVEL)


def join(address: str) -> None:
    """Connect to the cluster at ``address`` (``RAY_ADDRESS``: ``host:port``, ``ray://host:port``, or ``auto``
    for the latest ``ray start`` on this machine). Raises :class:`ClusterError` when its GCS port does not
    answer within :data:`CONNECT_TIMEOUT_S` or Ray refuses the address."""
    fix = ("start the cluster there (`ray start --head --port=PORT` on its head node), correct RAY_ADDRESS, or unset "
           "it to run on a private single-node cluster")
    try:
        host, port = _endpoint(address)
    except (ValueError, ConnectionError) as e:
        raise ClusterError(f"RAY_ADDRESS={address}: {_first_line(e)}; {fix}") from None
    problem = _unreachable(host, port, CONNECT_TIMEOUT_S)
    if problem is not None:
        raise ClusterError(f"RAY_ADDRESS={address}: no Ray cluster answers at {host}:{port} within "
                           f"{CONNECT_TIMEOUT_S:.0f} s ({problem}); {fix}")
    logger.info("joining the Ray cluster at %s", address)
    try:
        ray.init(address=address, log_to_driver=True, logging_level=_RAY_LOG_LEVEL)
    except (ValueError, ConnectionError) as e:
        raise ClusterError(f"RAY_ADDRESS={address}: {_first_line(e)}; {fix}") from None


def _endpoint(address: str) -> tuple[str, int]:
    """The host and port Ray connects to for ``address``."""
    if "://" not in address:
        # Ray's own reading of the address (``auto`` and the recorded latest cluster, host names), so that the
        # port checked is the one ray.init dials; ray is pinned (pyproject.toml) to the version this matches
        from ray._private.services import canonicalize_bootstrap_address

        address = canonicalize_bootstrap_address(address) or ""
    parts = urlsplit(address if "://" in address else f"//{address}")
    if not parts.hostname or parts.port is None:
        raise ValueError("not a host:port address")
    return parts.hostname, parts.port


def _unreachable(host: str, port: int, timeout_s: float) -> Optional[str]:
    """None when a TCP connection to ``host:port`` opens within ``timeout_s``, else the last error."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(left, _RETRY_S)):
                return None
        except OSError as e:
            if time.monotonic() + _RETRY_S >= deadline:
                return e.strerror or str(e) or type(e).__name__
        time.sleep(_RETRY_S)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
