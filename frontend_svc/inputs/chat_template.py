"""vLLM's `--chat-template`: a file holding a Jinja chat template, or the template itself
inline. Read and compiled once at start-up, so a missing file or a template that does not parse
stops the frontend with the reason instead of failing every chat request."""

from __future__ import annotations

import argparse
from pathlib import Path

from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

JINJA_CHARS = "{}\n"
"""A value with none of these is a path (vLLM's rule), never a template."""


def read_chat_template(value: str) -> str:
    """The template `value` names: the file's text, or `value` itself when it is a template;
    argparse.ArgumentTypeError otherwise."""
    if not value:
        return ""
    path = Path(value).expanduser()
    if not any(c in value for c in JINJA_CHARS):
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise argparse.ArgumentTypeError(
                f"{value!r} looks like a file path but cannot be read ({err}); pass a Jinja "
                "chat template file or the template itself"
            ) from None
    try:  # transformers renders chat templates in this sandbox
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(value)
    except TemplateSyntaxError as err:
        raise argparse.ArgumentTypeError(
            f"the chat template does not parse: {err.message} (line {err.lineno})"
        ) from None
    return value
