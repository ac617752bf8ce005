"""Downstream code reads the RunConfig's typed fields: no `getattr(args, "<flag>", <default>)` outside
miles/config/ (a default re-declared at the use site hid `--eps-clip 0` becoming 0.2)."""

import dataclasses
import os
import re

from miles.config import CONFIG_GROUPS, RunConfig

MILES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "miles")
GETATTR = re.compile(r"""getattr\(\s*(?:self\.)?\w+\s*,\s*["'](\w+)["']""")


def _config_names() -> set[str]:
    names = {f.name for f in dataclasses.fields(RunConfig)}
    for _, cls in CONFIG_GROUPS:
        names |= {f.name for f in dataclasses.fields(cls)}
    return names


def test_no_getattr_of_config_names_outside_miles_config():
    names = _config_names()
    offenders = []
    for dirpath, _, files in os.walk(MILES):
        if os.path.relpath(dirpath, MILES).split(os.sep)[0] == "config":
            continue
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            with open(path, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    for name in GETATTR.findall(line):
                        if name in names:
                            offenders.append(f"{os.path.relpath(path, MILES)}:{lineno}: {line.strip()}")
    assert offenders == [], "read the RunConfig's typed field instead:\n" + "\n".join(offenders)
