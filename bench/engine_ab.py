"""bench.engine over several set-ups in one run, alternated round by round, with ratios.

    # the fused elementwise kernels against the torch reference, on a GPU (bench/gpu.sh fused)
    python -m bench.engine_ab --side fused:--elementwise-kernels=triton \\
        --side unfused:--elementwise-kernels=reference --rounds 2 \\
        --device cuda --dtype bfloat16 --model llama-1b --no-compare --reps 3
    # this checkout against an older one (before/after on the CPU)
    python -m bench.engine_ab --side before@/tmp/kvgate-base --side after --rounds 4 --threads 1

Options that are not engine_ab's own (--side, --rounds, --out) go to every bench.engine run. A
side is NAME[@DIR][:ARGS]: ARGS (shell-split) go to its runs after those common ones; DIR is the
checkout it runs in (default: this one). Each round runs every side once, each as its own
`python -m bench.engine` process with this interpreter, the order rotated every round so that
host noise and warm caches fall on every side alike (bench.engine warms each engine up before
timing). Prints every run's figures, then per figure each side's median over the rounds and its
ratio to the first side; writes all of it as JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.lib.report import write_json

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "engine_ab.json"


@dataclass(frozen=True, slots=True)
class Side:
    name: str
    cwd: Path
    args: tuple[str, ...]


def parse_side(spec: str) -> Side:
    head, _, args = spec.partition(":")
    name, _, where = head.partition("@")
    if not name:
        raise argparse.ArgumentTypeError(f"a side needs a name: {spec!r}")
    cwd = Path(where).resolve() if where else REPO
    if not (cwd / "bench" / "engine.py").is_file():
        raise argparse.ArgumentTypeError(f"no bench/engine.py under {cwd}")
    return Side(name, cwd, tuple(shlex.split(args)))


def rotated(sides: list[Side], round_index: int) -> list[Side]:
    shift = round_index % len(sides)
    return sides[shift:] + sides[:shift]


def run_side(side: Side, common: list[str], out: Path) -> dict[str, float]:
    """One bench.engine run; its figures. Its set-up line (kernels, graphs) is echoed."""
    cmd = [sys.executable, "-m", "bench.engine", *common, *side.args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=side.cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{side.name}: {shlex.join(cmd[1:])} failed:\n{proc.stdout}{proc.stderr}")
    for line in proc.stdout.splitlines():
        if line.startswith(("engine bench:", "decode attention:")):
            print(f"  {side.name}: {line}")
    return json.loads(out.read_text())["figures"]


def medians(runs: list[dict], sides: list[Side]) -> dict[str, dict[str, float]]:
    """side -> figure -> median over the rounds."""
    result: dict[str, dict[str, float]] = {}
    for side in sides:
        mine = [run["figures"] for run in runs if run["side"] == side.name]
        names = [name for name in mine[0] if all(name in figures for figures in mine)]
        result[side.name] = {n: statistics.median(f[n] for f in mine) for n in names}
    return result


def print_summary(table: dict[str, dict[str, float]], sides: list[Side]) -> None:
    base = sides[0].name
    head = "".join(f"{s.name:>14}" for s in sides)
    ratios = "".join(f"{s.name + '/' + base:>18}" for s in sides[1:])
    print(f"\nmedians over the rounds\n{'figure':<34}{head}{ratios}")
    for figure, value in table[base].items():
        cells = "".join(f"{table[s.name].get(figure, float('nan')):>14.1f}" for s in sides)
        shares = "".join(
            f"{table[s.name].get(figure, float('nan')) / value if value else float('nan'):>18.3f}"
            for s in sides[1:]
        )
        print(f"{figure:<34}{cells}{shares}", flush=True)


def main() -> None:
    # Every option that is not engine_ab's goes to each bench.engine run.
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--side", type=parse_side, action="append", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args, common = parser.parse_known_args()
    if "--" in common or "--out" in common:
        parser.error("bench.engine's options go without `--`; --out is engine_ab's own")
    sides: list[Side] = args.side
    if len({s.name for s in sides}) != len(sides) or args.rounds < 1:
        parser.error("sides need distinct names, and --rounds at least 1")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in rotated(sides, r):
                print(f"round {r + 1}/{args.rounds}: {side.name}", flush=True)
                figures = run_side(side, common, Path(tmp) / f"{side.name}-{r}.json")
                for name, value in figures.items():
                    print(f"  {side.name}: {name:<40}{value:>14.1f}", flush=True)
                runs.append({"round": r + 1, "side": side.name, "figures": figures})
    table = medians(runs, sides)
    print_summary(table, sides)
    sides_json = [{"name": s.name, "cwd": str(s.cwd), "args": list(s.args)} for s in sides]
    write_json(
        args.out, {"bench_args": common, "sides": sides_json, "runs": runs, "medians": table}
    )


if __name__ == "__main__":
    main()
