"""Command-line flags with `SPLITSERVE_*` environment fallbacks, parsed once at start-up.

Every flag `--some-name` can also be set through the environment variable `SPLITSERVE_SOME_NAME`;
a flag given on the command line wins. Nothing is read from the environment at import time: the
environment is passed to `FlagParser.parse` explicitly.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

ENV_PREFIX = "SPLITSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_name(dest: str) -> str:
    """Environment variable that backs the flag with destination `dest`."""
    return ENV_PREFIX + dest.upper()


def parse_bool(text: str) -> bool:
    """Parse an environment boolean ("1", "true", "yes", "on" / "0", "false", "no", "off")."""
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r} (use true/false)")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def address_list(text: str) -> list[str]:
    """argparse type: comma-separated HOST:PORT list."""
    addrs = [a.strip() for a in text.split(",") if a.strip()]
    for addr in addrs:
        if ":" not in addr:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {addr!r}")
    return addrs


class FlagParser(argparse.ArgumentParser):
    """ArgumentParser whose options fall back to `SPLITSERVE_<DEST>` environment variables."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if action.option_strings and action.dest != "help":
            note = f"[env {env_name(action.dest)}]"
            action.help = f"{action.help} {note}" if action.help else note
        return action

    def parse(self, argv: Sequence[str] | None, environ: Mapping[str, str]) -> argparse.Namespace:
        """Parse `argv`, taking defaults for absent flags from `environ`."""
        self._apply_environ(environ)
        return self.parse_args(argv)

    def parse_known_env(
        self, argv: Sequence[str] | None, environ: Mapping[str, str]
    ) -> tuple[argparse.Namespace, list[str]]:
        """Like `parse`, but return the arguments this parser does not know instead of failing."""
        self._apply_environ(environ)
        return self.parse_known_args(argv)

    def _apply_environ(self, environ: Mapping[str, str]) -> None:
        defaults: dict[str, Any] = {}
        for action in self._actions:
            value = environ.get(env_name(action.dest)) if action.option_strings else None
            if value is None or action.dest == "help":
                continue
            try:
                defaults[action.dest] = _convert(action, value)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                self.error(f"{env_name(action.dest)}={value!r}: {exc}")
        self.set_defaults(**defaults)


def _convert(action: argparse.Action, value: str) -> Any:
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        return parse_bool(value)
    if action.type is None:
        return value
    converted = action.type(value)  # type: ignore[operator]
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"must be one of {sorted(action.choices)}")
    return converted
