"""The OpenAI request forms of structured outputs -> one StructuredOutputsParams.

Three forms, as vLLM reads them; a request may use one:

- OpenAI's `response_format`: `{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}` (the grammar is always strict), `{"type": "json_object"}`, `{"type": "text"}`
  (no constraint), and vLLM's `{"type": "structural_tag", "structures": [...], "triggers":
  [...]}`.
- vLLM's `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object" |
  "structural_tag": ..., "disable_any_whitespace", "disable_additional_properties",
  "whitespace_pattern"}`.
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (with
  `guided_whitespace_pattern`).

Returns the constraint with the name of the request field it came from, for errors; whether
the constraint compiles is checked later, with the prompt (InputProcessor), for every API.
"""

from __future__ import annotations

import json
from typing import Any

from frontend_svc.errors import InvalidRequest
from frontend_svc.openai.fields import as_bool, as_object, as_str, as_str_tuple
from splitserve_contracts.structured_outputs import StructuredOutputsParams

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
IGNORED_OPTIONS = ("disable_fallback", "backend")
"""vLLM keys accepted and ignored: there is one backend (llguidance), no fallback."""


def structured_outputs(body: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str]:
    """The request's constraint (None: free text) and the field it came from; InvalidRequest
    names the field when a form is malformed or more than one form is used."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        params = _response_format(as_object(response_format, "response_format"))
        if params is not None:
            found.append((params, "response_format"))
    if body.get("structured_outputs") is not None:
        spec = as_object(body["structured_outputs"], "structured_outputs")
        found.append((_structured_outputs(spec), "structured_outputs"))
    guided = [name for name in GUIDED if body.get(name) is not None]
    if guided:
        found.append((_guided(body, guided), guided[0]))
    if len(found) > 1:
        names = ", ".join(f"`{where}`" for _, where in found)
        raise InvalidRequest(f"{names} each constrain the output; send only one", found[1][1])
    return found[0] if found else (None, "")


def _json_text(value: Any, name: str) -> str:
    """A schema given as an object (or boolean), or as JSON text."""
    if isinstance(value, dict | bool):
        return json.dumps(value)
    if isinstance(value, str):
        return value
    raise InvalidRequest(f"`{name}` must be a JSON Schema object", name)


def _response_format(spec: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = spec.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        inner = as_object(spec.get("json_schema"), "response_format.json_schema")
        if "schema" not in inner:
            raise InvalidRequest(
                "`response_format.json_schema.schema` is required (the JSON Schema)",
                "response_format.json_schema.schema",
            )
        if inner.get("strict") is not None:
            as_bool(inner["strict"], "response_format.json_schema.strict")
        schema = _json_text(inner["schema"], "response_format.json_schema.schema")
        return StructuredOutputsParams(json=schema)
    if kind == "structural_tag":
        tag = {k: v for k, v in spec.items() if k != "type"}
        return StructuredOutputsParams(structural_tag=json.dumps(tag))
    raise InvalidRequest(
        "`response_format.type` must be one of text, json_object, json_schema, structural_tag",
        "response_format.type",
    )


def _structured_outputs(spec: dict[str, Any]) -> StructuredOutputsParams:
    known = {"json", "regex", "choice", "grammar", "json_object", "structural_tag"}
    unknown = set(spec) - known - set(OPTIONS) - set(IGNORED_OPTIONS)
    if unknown:
        raise InvalidRequest(
            f"`structured_outputs` has unknown keys {sorted(unknown)}; known: "
            f"{sorted(known | set(OPTIONS))}",
            "structured_outputs",
        )
    values: dict[str, Any] = {}
    for key in known:
        value = spec.get(key)
        if value is None:
            continue
        where = f"structured_outputs.{key}"
        if key == "json":
            values[key] = _json_text(value, where)
        elif key == "choice":
            values[key] = as_str_tuple(value, where)
        elif key == "json_object":
            values[key] = as_bool(value, where)
        elif key == "structural_tag" and isinstance(value, dict):
            values[key] = json.dumps(value)
        else:
            values[key] = as_str(value, where)
    return StructuredOutputsParams(**values, **_options(spec, "structured_outputs."))


def _options(spec: dict[str, Any], prefix: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key in OPTIONS:
        if spec.get(key) is not None:
            coerce = as_str if key == "whitespace_pattern" else as_bool
            options[key] = coerce(spec[key], prefix + key)
    return options


def _guided(body: dict[str, Any], names: list[str]) -> StructuredOutputsParams:
    values: dict[str, Any] = {}
    for name in names:
        value = body[name]
        if name == "guided_json":
            values["json"] = _json_text(value, name)
        elif name == "guided_choice":
            values["choice"] = as_str_tuple(value, name)
        else:
            values[GUIDED[name]] = as_str(value, name)
    pattern = body.get("guided_whitespace_pattern")
    if pattern is not None:
        values["whitespace_pattern"] = as_str(pattern, "guided_whitespace_pattern")
    return StructuredOutputsParams(**values)
