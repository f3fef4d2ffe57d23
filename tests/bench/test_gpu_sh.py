"""bench/gpu.sh, checked without a GPU: every mode runs to its end with `python3` and
`nvidia-smi` stubbed (each call logged), and every bench command it would run parses with that
bench's own options, every test file it names exists. A device run is a few scarce minutes: a
renamed flag must fail here, not there."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO

SCRIPT = REPO / "bench" / "gpu.sh"
SEP = "\x1f"
# python3 and nvidia-smi for the script: log the arguments, print nothing (a mode must not
# depend on what its commands print: a `grep` that filters everything out exits 1, and under
# `pipefail` that ended the whole script).
STUB = f"""#!/bin/sh
printf '%s{SEP}' "$(basename "$0")" "$@" >> "$GPU_SH_LOG"
echo >> "$GPU_SH_LOG"
"""
# Runs each logged `python3 -m bench.X ARGS` as far as its argument parser: the parser's own
# errors exit 2, unknown options too; bench.engine_ab's pass-through options (and each side's)
# are bench.engine's, and parsed as such.
PARSE_ONLY = r"""
import argparse, json, runpy, sys

class Parsed(Exception):
    pass

known = argparse.ArgumentParser.parse_known_args

def parse_known_args(self, args=None, namespace=None):
    ns, extras = known(self, args, namespace)
    raise Parsed(ns, extras, sys._getframe(1).f_code.co_name == "parse_args")

argparse.ArgumentParser.parse_known_args = parse_known_args

def check(module, args):
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__")
    except Parsed as p:
        ns, extras, strict = p.args
        if strict and extras:
            return f"{module}: unrecognized arguments: {extras}"
        if module == "bench.engine_ab":
            sides = (check("bench.engine", extras + list(s.args)) for s in ns.side)
            return next(filter(None, sides), None)
        return None
    except SystemExit as e:
        return f"{module} {args}: exited {e.code} while parsing"
    return f"{module}: ran past its argument parser"

failures = [f for m, a in json.load(sys.stdin) if (f := check(m, a))]
print(json.dumps(failures))
"""


def modes() -> list[str]:
    (usage,) = re.findall(r"usage: bash bench/gpu.sh (\S+)\}", SCRIPT.read_text())
    return usage.split("|")


def logged_calls(mode: str, tmp: Path) -> list[list[str]]:
    """The script's calls of python3 and nvidia-smi in `mode`, with ROUTING_ONE=1."""
    stubs = tmp / "bin"
    stubs.mkdir(exist_ok=True)
    for name in ("python3", "nvidia-smi"):
        (stubs / name).write_text(STUB)
        (stubs / name).chmod(0o755)
    log = tmp / f"{mode}.log"
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", GPU_SH_LOG=str(log))
    env |= {"OUT": str(tmp / "out"), "ROUTING_ONE": "1"}
    done = subprocess.run(
        ["bash", str(SCRIPT), mode], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, f"gpu.sh {mode}: {done.stdout}{done.stderr}"
    return [line.split(SEP)[:-1] for line in log.read_text().splitlines()]


def test_every_mode_runs_commands_that_parse(tmp_path: Path) -> None:
    benches: list[tuple[str, list[str]]] = []
    for mode in modes():
        calls = logged_calls(mode, tmp_path)
        assert calls[0][0] == "nvidia-smi", (mode, calls)  # the device is named in every log
        for _, *argv in calls[1:]:
            if argv[:2] == ["-m", "pytest"]:
                named = [a for a in argv if a.startswith("tests/")]
                assert named and all((REPO / a).exists() for a in named), (mode, argv)
            elif argv[:1] == ["-m"] and argv[1].startswith("bench."):
                benches.append((argv[1], argv[2:]))
        assert any(call[1:2] == ["-m"] for call in calls), f"{mode} runs nothing"
    assert {m for m, _ in benches} >= {"bench.engine", "bench.ttft", "bench.engine_ab"}
    checked = subprocess.run(
        [sys.executable, "-c", PARSE_ONLY],
        cwd=REPO,
        input=json.dumps(benches),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stderr[-3000:]
    failures = json.loads(checked.stdout.splitlines()[-1])
    assert not failures, "\n".join(failures) + "\n" + checked.stderr[-3000:]
