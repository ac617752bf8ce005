"""Test processes started with multiprocessing's spawn: each puts its target's result, or its traceback,
on one queue; the test collects them all and fails with every child's traceback.

A child may also report its progress (:func:`progress`: printed at once, flushed, and sent to the parent), so
a run that stops shows where each child was: when a child fails, the others get ``grace`` seconds to finish
(a peer waiting in a collective never will), and when the time is up :func:`collect` fails naming each
unfinished child's last stage, with its Python stacks (every child dumps them on SIGUSR1, faulthandler). A child
that dies without a result (a segfault, a kill) fails the run at once, with the stack faulthandler wrote as it died.
"""

import faulthandler
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback

_STAGE = "_spawned_stage"  # the key of a progress message (a result never has it)


def _stack_file(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"miles-test-stacks-{pid}.txt")


def _put(results, message) -> None:
    """``message`` pickled here, by value: a tensor put as it is travels as shared memory that this process hands
    out when the parent reads it, which fails once this process has exited."""
    results.put(pickle.dumps(message))


def report(target, results, *args):
    """The body of a child: ``target(*args)``'s result on ``results``, or ``{"error": traceback}``."""
    stacks = open(_stack_file(os.getpid()), "w")  # noqa: SIM115 - open for faulthandler while the child lives
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.enable(file=stacks, all_threads=True)  # SIGSEGV / SIGABRT: the stack lands in the same file
    try:
        _put(results, target(*args))
    except BaseException:
        _put(results, {"error": traceback.format_exc()})


def progress(results, who: str, stage: str) -> None:
    """In a child: ``who`` (e.g. ``tp2 rank 1``) reached ``stage``; printed now and remembered by collect."""
    print(f"[{who}] {stage} ({time.strftime('%H:%M:%S')})", flush=True)
    _put(results, {_STAGE: stage, "who": who, "pid": os.getpid()})


def start(ctx, results, *targets_and_args):
    """One started process per ``(target, args)``."""
    procs = [ctx.Process(target=report, args=(target, results, *args)) for target, args in targets_and_args]
    for p in procs:
        p.start()
    return procs


def _stacks(procs) -> str:
    """The Python stacks of the children still alive (SIGUSR1: faulthandler writes them to their file) and of
    those that died (what faulthandler wrote as they did)."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        os.kill(p.pid, signal.SIGUSR1)
    if alive:
        time.sleep(2)
    out = []
    for p in (p for p in procs if p.exitcode != 0):  # alive, or died: a child that returned has no stack to show
        try:
            with open(_stack_file(p.pid)) as f:
                state = "alive" if p.exitcode is None else f"exit code {p.exitcode}"
                out.append(f"--- stacks of pid {p.pid} ({state}):\n{f.read().strip() or '(none written)'}")
        except OSError as e:
            out.append(f"--- stacks of pid {p.pid}: not readable ({e})")
    return "\n".join(out)


def collect(procs, results, timeout: float, grace: float = 20.0) -> list:
    """Every child's result, waiting ``2 * timeout`` in all (``grace`` after a child fails), the children
    joined or killed; an AssertionError carrying the tracebacks of those that failed and, for a run that
    stopped, each unfinished child's last stage and stacks."""
    deadline = time.monotonic() + 2 * timeout
    got, last = [], {}
    try:
        while len(got) < len(procs):
            if any("error" in r for r in got):
                deadline = min(deadline, time.monotonic() + grace)
            try:
                message = pickle.loads(results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic()))))
            except queue.Empty:
                # a child that exited non-zero put no result: its peers would wait in a collective forever
                crashed = [p for p in procs if p.exitcode not in (None, 0)]
                if not crashed and time.monotonic() < deadline:
                    continue
                errors = "\n".join(r["error"] for r in got if "error" in r)
                why = (f"{len(crashed)} child(ren) died without a result (exit codes "
                       f"{[p.exitcode for p in crashed]})" if crashed else
                       f"{len(procs) - len(got)} of {len(procs)} children did not finish (limit {2 * timeout:.0f} s, "
                       f"{grace:.0f} s after a failure)")
                raise AssertionError(f"{why}. Last stage of each child: {_stages(last)}\n{errors}\n"
                                     f"{_stacks(procs)}") from None
            if _STAGE in message:
                last[message["pid"]] = (message["who"], message[_STAGE])
            else:
                got.append(message)
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
            try:
                os.unlink(_stack_file(p.pid))
            except OSError:
                pass
    errors = [r["error"] for r in got if "error" in r]
    assert not errors, f"Last stage of each child: {_stages(last)}\n" + "\n".join(errors)
    return got


def _stages(last: dict) -> str:
    return "; ".join(f"{who}: {stage}" for who, stage in sorted(last.values())) or "none reported"
