"""The unknown-flag hint of ``miles train``: a truncated flag that starts several flags names the main one
(the one the others extend, else the first declared, which leads its group) and lists them all."""

from __future__ import annotations

import pytest

from miles.config import parse_args
from miles.arg_parser import unknown_arguments_message
from miles.config.arguments import build_parser

KNOWN = build_parser().option_strings()


def hint(token: str) -> str:
    message = unknown_arguments_message([token], KNOWN)
    assert message.startswith(f"unrecognized arguments: {token} (") and message.endswith(")")
    return message[len(f"unrecognized arguments: {token} ("):-1]


def test_a_truncated_streaming_flag_suggests_the_flag_that_turns_streaming_on(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--stream-optimizer-state"])
    err = capsys.readouterr().err
    assert "--stream-optimizer-state: did you mean --stream-optimizer-state-to-disk? --stream-optimizer-state " \
           "starts several flags: --stream-optimizer-state-to-disk, --stream-optimizer-state-moment-dtype" in err
    assert "--stream-optimizer-state-verify" in err  # listed, not suggested


def test_the_flag_the_others_extend_is_the_main_one():
    assert hint("--sav").startswith("--sav: did you mean --save? --sav starts several flags: --save, ")
    assert hint("--offload").startswith("--offload: did you mean --offload-train? ")


def test_every_completion_is_listed_with_the_count_past_eight():
    listed = hint("--stream-optimizer-state").split("starts several flags: ")[1].split(", ")
    assert listed == [f for f in KNOWN if f.startswith("--stream-optimizer-state")]
    fake = [f"--x-{i}" for i in range(10)]
    assert unknown_arguments_message(["--x"], fake).endswith("--x-7, ... (10 in all))")


def test_one_completion_or_a_misspelling_gets_one_suggestion():
    assert hint("--eps-cl") == "--eps-cl: did you mean --eps-clip?"
    assert hint("--eps-clp") == "--eps-clp: did you mean --eps-clip?"
    assert hint("--stream-optimizer-state-chunkmb=4") == \
        "--stream-optimizer-state-chunkmb: did you mean --stream-optimizer-state-chunk-mb?"
