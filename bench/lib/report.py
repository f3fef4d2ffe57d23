"""What every benchmark prints and writes: fixed-width tables, percentiles, the JSON summary."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Col:
    """One table column: the row attribute it shows, its title and width.

    The value is formatted with `spec` and `suffix`, then aligned in `width` (so a suffix such
    as "ms" sits inside the column); `sep` is printed before the column in every line; a None
    value shows as "-"."""

    attr: str
    title: str
    width: int
    spec: str = ""
    suffix: str = ""
    left: bool = False
    sep: str = ""

    def _fit(self, text: str) -> str:
        return f"{self.sep}{text:{'<' if self.left else '>'}{self.width}}"

    def head(self) -> str:
        return self._fit(self.title)

    def cell(self, row: object) -> str:
        value = getattr(row, self.attr)
        return self._fit("-" if value is None else f"{value:{self.spec}}{self.suffix}")


def col(
    title: str, width: int, spec: str = "", suffix: str = "", *, left: bool = False, sep: str = ""
) -> Any:
    """A row dataclass's field that is also a table column (see `Col`), in field order."""
    shown = dict(title=title, width=width, spec=spec, suffix=suffix, left=left, sep=sep)
    return field(metadata={"col": shown})


def columns(row_type: type) -> tuple[Col, ...]:
    """The columns a row dataclass declares with `col`; its other fields go only to the JSON."""
    return tuple(Col(f.name, **f.metadata["col"]) for f in fields(row_type) if "col" in f.metadata)


def print_table(rows: Sequence[object], cols: Sequence[Col], header: bool = True) -> None:
    """Print `rows` (flushed line by line, so long runs show progress), the titles first."""
    if header:
        print("".join(c.head() for c in cols))
    for r in rows:
        print("".join(c.cell(r) for c in cols), flush=True)


def percentile(xs: list[float], q: float) -> float:
    """The nearest-rank `q` quantile (0..1) of `xs`; 0.0 for no samples."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def args_dict(args: argparse.Namespace) -> dict[str, str]:
    """The command line as JSON-safe strings, to record beside the results."""
    return {k: str(v) for k, v in vars(args).items()}


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")
