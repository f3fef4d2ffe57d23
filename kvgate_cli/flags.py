"""Command-line flags built from config dataclass fields, for `python -m gateway` and `-m worker`.

A config field declared with `option(default, "help")` is also a flag: its name (`max_queue` ->
`--max-queue`), type, choices, parser and default all come from the field, so each default is
written once, in the dataclass. A field with `metadata=flag_group(title)` holds a nested config
whose fields become flags too. argparse only ever sees the flags given (the rest keep the
dataclass defaults), a bad value is a usage error, and `--help` shows every default."""

from __future__ import annotations

import argparse
import math
import re
import types
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Union, get_args, get_origin, get_type_hints

_FLAG = "flag"
_GROUP = "flag_group"

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True, slots=True)
class Flag:
    """How one config field appears on the command line (held in the field's metadata)."""

    help: str
    name: str | None = None  # default: --field-name, or --no-field-name for a True bool
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # default: the field's type
    show: Callable[[Any], str] | None = None  # how the default reads in --help
    default_text: str | None = None  # what a None (computed) default means
    metavar: str | None = None


def option(default: Any = MISSING, help: str = "", *, secret: bool = False, **flag: Any) -> Any:
    """A dataclass field that is also a flag; no default makes the flag required.

    A `secret` field is left out of the config's repr, so logging a config never shows it.
    """
    return field(default=default, repr=not secret, metadata={_FLAG: Flag(help, **flag)})


def flag_group(title: str) -> dict[str, str]:
    """Field metadata: the field holds a nested config whose fields are flags, under `title`."""
    return {_GROUP: title}


# ---- human-friendly values ---------------------------------------------------------------------

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS |= {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)
_PIXELS = re.compile(r"^\s*(\d+)\s*[x*]\s*(\d+)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from "33554432", "32MiB", "32 MiB", "1.5GiB" or "20MB" (KiB = 1024, KB = 1000)."""
    m = _SIZE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 32MiB, 20MB, 1048576)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def format_size(n: int) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit[:2].lower()]
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def parse_pixels(text: str) -> int:
    """A pixel count from "16777216" or "4096x4096"."""
    m = _PIXELS.match(text)
    if m is not None:
        return int(m.group(1)) * int(m.group(2))
    if text.strip().isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"not a pixel count: {text!r} (e.g. 4096x4096)")


def format_pixels(n: int) -> str:
    side = math.isqrt(n)
    return f"{side}x{side}" if side * side == n else str(n)


# ---- fields -> flags ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FlagSpec:
    """One flag, derived from one (possibly nested) config field."""

    path: tuple[str, ...]  # field names from the top config down
    option: str
    flag: Flag
    kind: type | str  # the value type, or "on"/"off" (booleans), "list" (tuple[str, ...])
    default: Any
    group: str | None

    @property
    def dest(self) -> str:
        return "__".join(self.path)

    @property
    def required(self) -> bool:
        return self.default is MISSING

    def default_text(self) -> str:
        f = self.flag
        if self.required:
            return "required"
        if self.kind in ("on", "off"):
            return "off"
        if f.default_text is not None:
            return f.default_text
        if self.default is None or self.default == ():
            return "none"
        return f.show(self.default) if f.show is not None else str(self.default)

    def usage(self) -> str:
        """The flag as the docs write it: `--port N`, `--policy {a,b}`, `--no-remote-images`."""
        metavar = self.metavar()
        return self.option if metavar is None else f"{self.option} {metavar}"

    def metavar(self) -> str | None:
        f = self.flag
        if self.kind in ("on", "off"):
            return None
        if f.metavar is not None:
            return f.metavar
        if f.choices is not None:
            return "{" + ",".join(f.choices) + "}"
        return {int: "N", float: "X", str: "TEXT", "list": "TEXT[,TEXT]"}[self.kind]


def flag_specs(
    cls: type, path: tuple[str, ...] = (), group: str | None = None
) -> Iterator[FlagSpec]:
    """Every flag of config dataclass `cls` and its flag groups, in field order."""
    hints = get_type_hints(cls)
    for f in fields(cls):
        if _GROUP in f.metadata:
            yield from flag_specs(hints[f.name], (*path, f.name), f.metadata[_GROUP])
            continue
        flag = f.metadata.get(_FLAG)
        if flag is None:
            continue
        kind = _kind(hints[f.name], f.default)
        if flag.name is not None:
            name = flag.name
        else:
            name = ("--no-" if kind == "off" else "--") + f.name.replace("_", "-")
        yield FlagSpec((*path, f.name), name, flag, kind, f.default, group)


def _kind(hint: Any, default: Any) -> type | str:
    if get_origin(hint) in (Union, types.UnionType):
        (hint,) = [a for a in get_args(hint) if a is not type(None)]
    if hint is bool:
        return "off" if default is True else "on"
    if get_origin(hint) is tuple:
        return "list"
    if hint in (int, float, str):
        return hint
    raise TypeError(f"no flag for a field of type {hint!r}")


def add_flags(parser: argparse.ArgumentParser, *configs: type) -> None:
    """Add the flags of each config dataclass to `parser`, a group per flag group."""
    specs = [s for cls in configs for s in flag_specs(cls)]
    groups: dict[str | None, Any] = {None: parser}
    for s in specs:
        if s.group not in groups:
            groups[s.group] = parser.add_argument_group(s.group)
        help_text = f"{s.flag.help} (default: {s.default_text()})".replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": s.dest, "help": help_text}
        if s.kind == "on":
            kwargs["action"] = "store_true"
        elif s.kind == "off":
            kwargs["action"] = "store_false"
        else:
            kwargs["metavar"] = s.metavar()
            kwargs["choices"] = s.flag.choices
            kwargs["type"] = s.flag.parse or (str if s.kind == "list" else s.kind)
            if s.kind == "list":  # repeated, and several values after one flag (vLLM's form)
                kwargs["action"] = "extend"
                kwargs["nargs"] = "+"
        if s.required:
            kwargs["required"] = True
        else:
            kwargs["default"] = argparse.SUPPRESS  # absent flags keep the dataclass default
        groups[s.group].add_argument(s.option, **kwargs)
        if s.kind in ("on", "off"):
            _add_bool_aliases(parser, groups[s.group], s)


def _add_bool_aliases(parser: argparse.ArgumentParser, group: Any, s: FlagSpec) -> None:
    """vLLM's spellings of a boolean flag, both of them (`--enable-lora`, `--no-enable-lora`),
    where the flag's own name is another: hidden from --help, each sets its value."""
    name = s.path[-1].replace("_", "-")
    for alias, value in ((f"--{name}", True), (f"--no-{name}", False)):
        if alias not in parser._option_string_actions:
            group.add_argument(
                alias,
                dest=s.dest,
                action="store_const",
                const=value,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )


def split_list(arg: str) -> list[str]:
    """One value of a list flag as its entries: comma-separated, except a JSON object (the form
    vLLM also takes for some list flags: `--lora-modules '{"name": "a", "path": "/p"}'`)."""
    arg = arg.strip()
    if arg.startswith("{"):
        return [arg]
    return [e.strip() for e in arg.split(",") if e.strip()]


def given(args: argparse.Namespace, *path: str) -> bool:
    return hasattr(args, "__".join(path))


def config_from_flags(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """Build config `cls` from the flags that were given; `overrides` win over them."""
    return _build(cls, args, (), overrides)


def _build(cls: type, args: argparse.Namespace, path: tuple[str, ...], overrides: dict) -> Any:
    hints = get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        dest = "__".join((*path, f.name))
        if _GROUP in f.metadata:
            kwargs[f.name] = _build(hints[f.name], args, (*path, f.name), {})
        elif _FLAG in f.metadata and hasattr(args, dest):
            value = getattr(args, dest)
            if _kind(hints[f.name], f.default) == "list":  # repeated and/or comma-separated
                value = tuple(e for arg in value for e in split_list(arg))
            kwargs[f.name] = value
    kwargs.update(overrides)
    return cls(**kwargs)


def markdown_table(*configs: type) -> str:
    """The docs' flag table of these configs: flag, default, meaning (what `--help` says)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for s in (s for cls in configs for s in flag_specs(cls)):
        cells = (f"`{s.usage()}`", s.default_text(), s.flag.help)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
