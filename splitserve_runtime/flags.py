"""Command-line flags with a `--config` YAML file and `SPLITSERVE_*` environment fallbacks,
parsed once at start-up.

Every flag `--some-name` can also be set through the environment variable `SPLITSERVE_SOME_NAME`
and, where the parser takes `--config FILE` (or `SPLITSERVE_CONFIG`), through the key
`some-name` or `some_name` of that YAML mapping (vLLM's `--config`). The command line wins over
the file, the file over the environment, the environment over the built-in default. As in vLLM,
`--some_name` is the same flag as `--some-name`; unlike argparse's default, a prefix of a flag
(`--max-model` for `--max-model-len`) is an error, never a guess. Nothing is read from the
environment at import time: the environment is passed to `FlagParser.parse` explicitly.

A service declares its flags as a table: one `Flag` row each (its names, vLLM's first, and what
argparse needs), in `--help` order; `FlagParser.add_flags` builds the parser from it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

from splitserve_contracts.engine_options_types import CHOICES, HELP

ENV_PREFIX = "SPLITSERVE_"
CONFIG_FLAG = "--config"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_SAYS_DEFAULT = re.compile(r"\(default|\bdefault:", re.IGNORECASE)


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


def only_values(*accepted: str, why: str) -> Callable[[str], str]:
    """argparse type: one of `accepted`; any other value is refused by name, saying `why`
    (e.g. vLLM's --kv-cache-dtype, whose other values would change results)."""

    def check(text: str) -> str:
        if text not in accepted:
            raise argparse.ArgumentTypeError(f"{text!r} is not available here: {why}")
        return text

    return check


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


def dashed_spelling(argv: Sequence[str]) -> list[str]:
    """`--max_model_len=8` -> `--max-model-len=8` (vLLM accepts both spellings); values and
    everything after a bare `--` stay as they are."""
    out: list[str] = []
    for i, token in enumerate(argv):
        if token == "--":
            return out + list(argv[i:])
        if token.startswith("--") and "_" in token.partition("=")[0]:
            name, eq, value = token.partition("=")
            token = name.replace("_", "-") + eq + value
        out.append(token)
    return out


class RefuseFlag(argparse.Action):
    """A flag users bring from vLLM that splitserve refuses on purpose: naming it is an error
    that says why (`help` is the reason)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.pop("default", None)
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> NoReturn:
        parser.error(f"{option_string}: {self.help}")


_NOTICES: dict[str, str] = {}
"""Flag -> the one warning this process owes the operator for it (flushed by
log_config.configure_logging, which every service and the launcher call once their flags are
parsed)."""


def add_flag_notice(key: str, text: str) -> None:
    """Warn the operator once about `key` (a flag) when logging is configured."""
    _NOTICES.setdefault(key, text)


def take_flag_notices() -> list[str]:
    """The pending one-per-flag warnings, in the order the flags came; forgets them."""
    notices = list(_NOTICES.values())
    _NOTICES.clear()
    return notices


class NoEffectFlag(argparse.Action):
    """A flag vLLM's `vllm serve` takes that has no effect here (templates pass it): it is
    accepted, with or without a value as vLLM's is, and warned about once; `help` says why it
    changes nothing. With `choices`, only those values are accepted (others would change
    results)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.pop("default", None)
        kwargs.setdefault("nargs", 0)
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        add_flag_notice(self.dest, f"{option_string} has no effect here: {self.help}")


@dataclass(frozen=True)
class Flag:
    """One row of a flag table: the option strings (the first names the flag), the keyword
    arguments of argparse's `add_argument` (type, default, choices, action, help, ...) and, for
    a flag that sets an engine option, the field it fills ("cache.block_size", or a whole group
    such as "speculative"; common.v1.EngineOptions)."""

    names: tuple[str, ...]
    settings: Mapping[str, Any] = field(default_factory=dict)
    fills: str = ""

    @property
    def dest(self) -> str:
        """The argparse destination (the parsed value's name)."""
        return str(self.settings.get("dest") or self.names[0].lstrip("-").replace("-", "_"))


def flag(*names: str, fills: str = "", **settings: Any) -> Flag:
    """A Flag row: `flag("--max-num-seqs", type=positive_int, default=256, help=...)`. A row
    that `fills` an engine option without a `help` takes the option's contract comment, and
    its `choices` where the contract lists them."""
    if fills in HELP:
        settings.setdefault("help", HELP[fills])
        if fills in CHOICES:
            settings.setdefault("choices", CHOICES[fills])
    return Flag(names, settings, fills)


def filling(row: Flag, field_path: str) -> Flag:
    """`row` (declared elsewhere, e.g. a flag shared by several services) filling `field_path`."""
    return replace(row, fills=field_path)


def filled_options(rows: Sequence[Flag], values: dict[str, Any]) -> dict[str, Any]:
    """Take the values of the rows that fill an engine option out of `values` (parsed flags),
    by option name (a group's fields by their own name; engine_option_rules.engine_options
    builds the record from them)."""
    return {row.fills.rsplit(".", 1)[-1]: values.pop(row.dest) for row in rows if row.fills}


_NOT_SETTINGS = (argparse._HelpAction, argparse._VersionAction)
_NO_ENVIRONMENT = (*_NOT_SETTINGS, RefuseFlag, NoEffectFlag)
"""Flags no environment variable stands for."""
SECRET_DESTS = frozenset({"api_key", "internal_secret"})
"""Flags whose value is a credential: `--help` never shows their default (it may come from the
environment)."""


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` ends every flag's text with its default, unless the text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is argparse.SUPPRESS
            or isinstance(action, _NO_ENVIRONMENT)
            or _SAYS_DEFAULT.search(text)
        ):
            return text
        if action.dest in SECRET_DESTS:
            return f"{text} (default: {'set, not shown' if default else 'none'})".lstrip()
        return f"{text} (default: {_shown(default).replace('%', '%%')})".lstrip()


class FlagParser(argparse.ArgumentParser):
    """ArgumentParser whose options fall back to `SPLITSERVE_<DEST>` environment variables and,
    with `config_file=True`, to a `--config` YAML file; see the module docstring."""

    def __init__(self, *args: Any, config_file: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        if config_file:
            self.add_argument(
                CONFIG_FLAG,
                default="",
                metavar="FILE",
                help="YAML mapping of flag names (without the leading --) to values, e.g. "
                "`max-model-len: 2048`; flags on the command line win over it",
            )

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        return _with_environment_note(super().add_argument(*args, **kwargs))

    def error(self, message: str) -> NoReturn:
        """The error and where the flags are listed, without argparse's usage: a command with
        a hundred flags would print a hundred lines of it before the one that says what is
        wrong (e.g. a bad --speculative-config). Exits 2, as argparse."""
        self.exit(2, f"{self.prog}: error: {message}\nRun `{self.prog} --help` for its flags.\n")

    @classmethod
    def of_service(cls, prog: str, description: str, table: Sequence[Flag]) -> FlagParser:
        """A service's parser: its flag table, after `--config`."""
        parser = cls(prog=prog, description=description, config_file=True)
        parser.add_flags(table)
        return parser

    def add_flags(self, table: Sequence[Flag], group: str = "") -> None:
        """Add every row of a flag table, in order (under the heading `group`, if given)."""
        container = self.add_argument_group(group) if group else self
        for row in table:
            _with_environment_note(container.add_argument(*row.names, **row.settings))

    def parse(self, argv: Sequence[str] | None, environ: Mapping[str, str]) -> argparse.Namespace:
        """Parse `argv`, taking defaults for absent flags from the --config file and `environ`."""
        return self.parse_args(self.expand(argv, environ))

    def expand(self, argv: Sequence[str] | None, environ: Mapping[str, str]) -> list[str]:
        """The command line as parsed: dashed spellings, the --config file's flags first (so
        the command line's own come later and win); applies `environ` as defaults."""
        tokens = dashed_spelling(sys.argv[1:] if argv is None else argv)
        self._apply_environ(environ)
        path = self._config_path(tokens, environ)
        if not path:
            return tokens
        # `--config=PATH` again after the file's flags ends a list value (`served-model-name:
        # [a, b]`) before a positional MODEL on the command line.
        return [*self._config_tokens(path), f"{CONFIG_FLAG}={path}", *tokens]

    def has_flag(self, option: str) -> bool:
        return option in self._option_string_actions

    def _config_path(self, tokens: list[str], environ: Mapping[str, str]) -> str:
        if not self.has_flag(CONFIG_FLAG):
            return ""
        path = environ.get(env_name("config"), "")
        for i, token in enumerate(tokens):
            if token == CONFIG_FLAG and i + 1 < len(tokens):
                path = tokens[i + 1]
            elif token.startswith(CONFIG_FLAG + "="):
                path = token.partition("=")[2]
        return path

    def _config_tokens(self, path: str) -> list[str]:
        """The YAML file's keys and values as command-line tokens."""
        try:
            import yaml
        except ImportError:  # the light client has no PyYAML (and no --config)
            self.error(f"{CONFIG_FLAG} {path}: reading YAML needs the PyYAML package")
        try:
            with open(path, encoding="utf-8") as f:
                values = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as err:
            self.error(f"{CONFIG_FLAG} {path}: {err}")
        if values is None:
            return []
        if not isinstance(values, dict):
            self.error(f"{CONFIG_FLAG} {path}: expected a mapping of flag names to values")
        tokens: list[str] = []
        for key, value in values.items():
            option = "--" + str(key).replace("_", "-")
            action = self._option_string_actions.get(option)
            if action is None or option == CONFIG_FLAG or isinstance(action, _NOT_SETTINGS):
                self.error(f"{CONFIG_FLAG} {path}: {key!r} is not a flag of {self.prog}")
            try:
                tokens += config_value_tokens(action, option, value)
            except ValueError as err:
                self.error(f"{CONFIG_FLAG} {path}: {key}: {err}")
        return tokens

    def _apply_environ(self, environ: Mapping[str, str]) -> None:
        defaults: dict[str, Any] = {}
        for action in self._actions:
            value = environ.get(env_name(action.dest)) if action.option_strings else None
            if value is None or isinstance(action, _NO_ENVIRONMENT):
                continue
            try:
                defaults[action.dest] = _convert(action, value)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                self.error(f"{env_name(action.dest)}={value!r}: {exc}")
        self.set_defaults(**defaults)


def _with_environment_note(action: argparse.Action) -> argparse.Action:
    """`--help` names the variable that backs the flag (once)."""
    note = f"[env {env_name(action.dest)}]"
    is_setting = action.option_strings and not isinstance(action, _NO_ENVIRONMENT)
    if is_setting and not (action.help or "").endswith(note):
        action.help = f"{action.help} {note}" if action.help else note
    return action


def _shown(default: Any) -> str:
    if default == "":
        return '""'
    if isinstance(default, list):
        return ",".join(map(str, default)) or "[]"
    return str(default)


def config_value_tokens(action: argparse.Action, option: str, value: Any) -> list[str]:
    """One --config entry as command-line tokens (`--name=value`, so negative numbers and
    values starting with '-' stay values)."""
    if value is None:
        return []
    if action.nargs == 0:  # a switch: true/false
        is_on = value if isinstance(value, bool) else parse_bool(str(value))
        if isinstance(action, argparse.BooleanOptionalAction):
            return [option if is_on else "--no-" + option[2:]]
        return [option] if is_on else []
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [f"{option}={_scalar(item)}" for item in items]
    if isinstance(value, list) and action.nargs in ("+", "*"):
        return [option, *(_scalar(item) for item in value)]
    if isinstance(value, list):
        return [f"{option}={','.join(_scalar(item) for item in value)}"]
    return [f"{option}={_scalar(value)}"]


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def _convert(action: argparse.Action, value: str) -> Any:
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        return parse_bool(value)
    if action.nargs == "+":  # SPLITSERVE_SERVED_MODEL_NAME="a b": one value per word
        return [_convert_one(action, word) for word in value.replace(",", " ").split()]
    return _convert_one(action, value)


def _convert_one(action: argparse.Action, value: str) -> Any:
    if action.type is None:
        return value
    converted = action.type(value)  # type: ignore[operator]
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"must be one of {sorted(action.choices)}")
    return converted
