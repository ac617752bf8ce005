"""Test processes started with multiprocessing's spawn: each puts its target's result, or its traceback,
on one queue; the test collects them all and fails with every child's traceback."""

import traceback


def report(target, results, *args):
    """The body of a child: ``target(*args)``'s result on ``results``, or ``{"error": traceback}``."""
    try:
        results.put(target(*args))
    except BaseException:
        results.put({"error": traceback.format_exc()})


def start(ctx, results, *targets_and_args):
    """One started process per ``(target, args)``."""
    procs = [ctx.Process(target=report, args=(target, results, *args)) for target, args in targets_and_args]
    for p in procs:
        p.start()
    return procs


def collect(procs, results, timeout: float) -> list:
    """Every child's result (waiting up to ``2 * timeout`` for each), the children joined or killed; an
    AssertionError carrying the tracebacks of those that failed."""
    try:
        got = [results.get(timeout=timeout * 2) for _ in procs]
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in got if "error" in r]
    assert not errors, "\n".join(errors)
    return got
