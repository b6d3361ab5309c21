"""vLLM's JSON-object flags (--speculative-config, --kv-transfer-config): one reading of their
text, so "", "{}" and "null" mean "none" and anything else must be a JSON object."""

from __future__ import annotations

import json
from typing import Any


def parse_json_object(text: str, error: type[ValueError]) -> dict[str, Any] | None:
    """The flag's object; None for "", "{}" or "null"; `error` for text that is no JSON or no
    object."""
    if not text.strip():
        return None
    try:
        value = json.loads(text)
    except ValueError as err:
        raise error(f"not JSON: {err}") from None
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise error("expected a JSON object")
    return value
