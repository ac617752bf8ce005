"""A store's lifetime beyond its own memory: what it holds (StoreResources: I/O threads, staging, file
descriptors, directory and lock), released by close(), by a finalizer when a store is dropped unclosed, and
at interpreter exit for every store still open (LIVE_STORES); and the one-live-store-per-directory rule."""

from __future__ import annotations

import atexit
import logging
import threading
import weakref

from .errors import StoreConfigError
from .io.stager import Stager, on_a_worker_thread

logger = logging.getLogger("miles_plugins.optimizers.streaming.store")  # the store's own log lines


class StoreResources:
    """What a store holds beyond its memory: the I/O engine's threads and staging, its files'
    descriptors, its directory and lock. Kept apart from the store (and never pointing at it), so that
    a finalizer can release them once the store is unreachable."""

    def __init__(self, stager: Stager):
        self.stager = stager
        self.files = []  # every bucket file created, in order
        self.directory_lock = None  # None until the directory is locked

    def release(self) -> None:
        self.stager.wait_all(raise_errors=False)  # write-behind in flight ends before its files close
        for file in self.files:  # removed next: dirty host images are not written
            self.stager.close_file(file, write_back=False)
        if self.directory_lock is not None:
            self.stager.remove_directory(self.directory_lock)
        self.stager.close()


def release_dropped_store(resources: StoreResources, relative_dir: str) -> None:
    """The finalizer of a store garbage-collected without close(). A collection may run on one of the
    engine's own threads, which cannot wait for or stop themselves: the release then runs on a thread
    of its own."""
    logger.warning("optimizer-state store %s was dropped without close(): removing its files and stopping its "
                   "I/O threads now; call store.close() when done with it", relative_dir)
    if on_a_worker_thread():
        threading.Thread(target=resources.release, name="miles-store-release", daemon=True).start()
    else:
        resources.release()


def call_if_alive(method_ref: "weakref.WeakMethod"):
    """A callback that runs the method only while its object lives: the stager holds it without keeping the
    store alive (a dropped store must reach its finalizer)."""
    def call() -> None:
        method = method_ref()
        if method is not None:
            method()
    return call


LIVE_STORES: weakref.WeakSet = weakref.WeakSet()  # every open store of this process (close() leaves it)


@atexit.register
def close_live_stores() -> None:
    for store in list(LIVE_STORES):
        store.close()


def refuse_shared_directory(path: str) -> None:
    """Two live stores in one directory would wipe each other's files: refuse the second, before any
    file is touched. The binding chooses the identity; stream_optimizer_state(..., instance=k) sets it."""
    for other in list(LIVE_STORES):
        if other.path == path:
            raise StoreConfigError(
                f"another open store of this process already works in {path} (identity {other.identity}): "
                "close it first, or give this optimizer another identity (stream_optimizer_state(..., instance=k))")
