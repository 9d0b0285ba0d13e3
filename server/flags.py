"""Command-line flags generated from configuration dataclasses (engine/config.py).

A field with `engine.config.flag(...)` metadata is a flag: `--` + prefix + the field's name with
dashes (or the name the metadata gives), parsed as the field's annotated type, defaulting to the
field's default (or the metadata's `default=`). Every flag may also be set as PDSERVE_<FLAG>
(engine/settings.py, `flag_env`); the flag wins. The same list turns parsed flags back into a
dataclass (`from_args`) and into a command line for a child process (`to_argv`), so a setting is
declared once, where the engine reads it.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine import settings

C = TypeVar("C")


@dataclass(frozen=True)
class Flag:
    field: str                  # the dataclass field it sets
    name: str                   # --max-num-seqs
    parse: Callable[[str], Any]  # the field's type (bool: an on/off flag)
    default: Any                # the command line's default, before the environment
    help: str
    role: str                   # the engine role it applies to ("": every role)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def is_switch(self) -> bool:
        """An off-by-default on/off flag: `--x` alone, no `--no-x`."""
        return self.parse is bool and self.default is False


def _scalar(hint: Any) -> Callable[[str], Any]:
    """`int | None` -> int: the type a flag's text parses to."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def _default(f: dataclasses.Field) -> Any:
    if "default" in f.metadata:
        return f.metadata["default"]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def flags_of(cls: type, prefix: str = "") -> list[Flag]:
    """The flags of dataclass `cls`: its fields with flag metadata, in declaration order."""
    hints = typing.get_type_hints(cls)
    return [Flag(f.name, f.metadata.get("flag") or f"--{prefix}{f.name.replace('_', '-')}", _scalar(hints[f.name]),
                 _default(f), f.metadata["help"], f.metadata.get("role", ""))
            for f in dataclasses.fields(cls) if "help" in f.metadata]


def add_flag(p: argparse.ArgumentParser, flag: str, typ: Callable[[str], Any], default: Any, help_: str) -> None:
    """A flag whose default comes from PDSERVE_<FLAG> when that is set."""
    env = settings.flag_env(flag)
    p.add_argument(flag, type=typ, default=typ(env) if env is not None else default,
                   help=f"{help_} [{settings.flag_env_name(flag)}]")


def _add(p: argparse.ArgumentParser, flag: Flag, help_: str) -> None:
    env = settings.flag_env(flag.name)
    env_name = settings.flag_env_name(flag.name)
    if flag.is_switch:  # on when its variable is 1/true/yes
        on = (env or "").lower() in ("1", "true", "yes")
        p.add_argument(flag.name, action="store_true", default=on, help=f"{help_} [{env_name}=1]")
    elif flag.parse is bool:
        default = settings.truthy(env) if env is not None else flag.default
        p.add_argument(flag.name, action=argparse.BooleanOptionalAction, default=default, help=f"{help_} [{env_name}]")
    else:
        add_flag(p, flag.name, flag.parse, flag.default, help_)


def add_flags(p: argparse.ArgumentParser, cls: type, prefix: str = "", only: Iterable[str] | None = None,
              say_role: bool = True) -> None:
    """`cls`'s flags on `p` (`only`: these fields). `say_role`: prefix each flag's help with the
    role it applies to ("prefill: ..."), for the commands that start one engine of any role."""
    keep = None if only is None else set(only)
    for flag in flags_of(cls, prefix):
        if keep is None or flag.field in keep:
            _add(p, flag, f"{flag.role}: {flag.help}" if flag.role and say_role else flag.help)


def from_args(cls: type[C], args: argparse.Namespace, prefix: str = "") -> C:
    """A `cls` from the parsed flags: the fields whose flags `args` has; a None (a flag left unset
    whose default is "none given") leaves the field's own default."""
    values = {flag.field: getattr(args, flag.dest) for flag in flags_of(cls, prefix) if hasattr(args, flag.dest)}
    return cls(**{k: v for k, v in values.items() if v is not None})


def to_argv(args: argparse.Namespace, cls: type, prefix: str = "") -> list[str]:
    """The flags of `cls` in `args` as a command line, for a child process that parses them again."""
    argv: list[str] = []
    for flag in flags_of(cls, prefix):
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        if flag.is_switch:
            argv += [flag.name] if value else []
        elif flag.parse is bool:
            argv.append(flag.name if value else "--no-" + flag.name.removeprefix("--"))
        else:  # one word, so that a value starting with "-" is not taken for a flag
            argv.append(f"{flag.name}={value}")
    return argv
