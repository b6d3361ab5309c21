"""The structured-outputs constraint of one request (vLLM's StructuredOutputsParams), in plain form,
with the rules every trust boundary applies to its shape and its conversion from and to
common.v1.StructuredOutputsParams.

The frontend fills it from whichever request form the client used (OpenAI `response_format`,
vLLM's `structured_outputs`, the older `guided_*` fields, the gRPC field); a tool-choice layer
fills `json` with the schema of the calls it requires. Whether the grammar itself is valid is
llguidance's to say (splitserve_runtime.grammars); these rules bound what reaches it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from splitserve_contracts.common.v1 import types_pb2

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The constraints, in vLLM's names; exactly one is set."""
MAX_SPEC_CHARS = 256 * 1024
"""Longest schema, regex, grammar or structural tag (characters); the compile time limit
bounds the cost of what fits."""
MAX_CHOICES = 1024
MAX_WHITESPACE_PATTERN_CHARS = 256


class InvalidStructuredOutputs(ValueError):
    """A constraint the engine cannot take; `field` names the part (e.g. "json", "choice")."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field

    def describe(self, prefix: str = "structured_outputs") -> str:
        """The message with the field's path, e.g. "structured_outputs.json: is not valid
        JSON: ..."."""
        path = prefix if self.field in ("", "structured_outputs") else f"{prefix}.{self.field}"
        return f"{path}: {self}"


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One request's output constraint (vLLM's StructuredOutputsParams): exactly one of `json`
    (a JSON Schema as JSON text), `regex`, `choice`, `grammar` (Lark or GBNF), `json_object`,
    `structural_tag` (JSON text); the options shape JSON output (`disable_any_whitespace`:
    compact JSON; `whitespace_pattern`: the whitespace between tokens; unset, it is bounded)."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str = ""

    @property
    def kind(self) -> str:
        """The name of the constraint that is set (validate first)."""
        for name in KINDS:
            value = getattr(self, name)
            if value is not None and value is not False:
                return name
        raise InvalidStructuredOutputs("no constraint is set", "structured_outputs")

    @property
    def spec(self) -> str:
        """The constraint's text: the schema, regex, grammar or tag; choices as a JSON list."""
        kind = self.kind
        if kind == "choice":
            return json.dumps(list(self.choice or ()))
        if kind == "json_object":
            return '{"type": "object"}'
        value = getattr(self, kind)
        assert isinstance(value, str)
        return value

    @property
    def cache_key(self) -> tuple[str, str, bool, bool, str]:
        """Equal keys compile to the same grammar (the compiled-grammar cache's key)."""
        return (
            self.kind,
            self.spec,
            self.disable_any_whitespace,
            self.disable_additional_properties,
            self.whitespace_pattern,
        )


def validate(params: StructuredOutputsParams) -> None:
    """Raise InvalidStructuredOutputs unless exactly one constraint is set and every part is
    within bounds (the grammar's own validity is checked when it is compiled)."""
    set_kinds = [k for k in KINDS if getattr(params, k) not in (None, False)]
    if len(set_kinds) != 1:
        what = ", ".join(set_kinds) if set_kinds else "none"
        raise InvalidStructuredOutputs(
            f"exactly one of {', '.join(KINDS)} must be set (got: {what})", "structured_outputs"
        )
    kind = set_kinds[0]
    if kind == "choice":
        _check_choices(params.choice or ())
    elif kind != "json_object":
        text = getattr(params, kind)
        if not text.strip():
            raise InvalidStructuredOutputs(f"{kind} must not be empty", kind)
        if len(text) > MAX_SPEC_CHARS:
            raise InvalidStructuredOutputs(
                f"{kind} has {len(text)} characters; at most {MAX_SPEC_CHARS} are accepted", kind
            )
        if kind in ("json", "structural_tag"):
            _check_json_text(text, kind)
    if len(params.whitespace_pattern) > MAX_WHITESPACE_PATTERN_CHARS:
        raise InvalidStructuredOutputs(
            f"at most {MAX_WHITESPACE_PATTERN_CHARS} characters", "whitespace_pattern"
        )


def _check_choices(choices: tuple[str, ...]) -> None:
    if not choices:
        raise InvalidStructuredOutputs("must list at least one string", "choice")
    if len(choices) > MAX_CHOICES:
        raise InvalidStructuredOutputs(f"at most {MAX_CHOICES} choices are accepted", "choice")
    if sum(len(c) for c in choices) > MAX_SPEC_CHARS:
        raise InvalidStructuredOutputs(f"at most {MAX_SPEC_CHARS} characters in all", "choice")
    if any(not isinstance(c, str) or not c for c in choices):
        raise InvalidStructuredOutputs("every choice must be a non-empty string", "choice")


def _check_json_text(text: str, kind: str) -> None:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise InvalidStructuredOutputs(f"is not valid JSON: {err}", kind) from None
    except RecursionError:  # deeper than Python's recursion limit (llguidance takes 128 levels)
        raise InvalidStructuredOutputs("nests too deeply to be read", kind) from None
    if kind == "json" and not isinstance(value, dict | bool):
        raise InvalidStructuredOutputs("a JSON Schema must be an object (or a boolean)", kind)
    if kind == "structural_tag" and not isinstance(value, dict):
        raise InvalidStructuredOutputs("must be a JSON object", kind)


def from_proto(msg: types_pb2.StructuredOutputsParams) -> StructuredOutputsParams | None:
    """The plain form of a StructuredOutputsParams message, unvalidated (call `validate`); None
    when the message is empty (no constraint, no option)."""
    kind = msg.WhichOneof("constraint")
    options = StructuredOutputsParams(
        disable_any_whitespace=msg.disable_any_whitespace,
        disable_additional_properties=msg.disable_additional_properties,
        whitespace_pattern=msg.whitespace_pattern,
    )
    if kind is None:
        return None if options == StructuredOutputsParams() else options
    if kind == "choice":
        return dataclasses.replace(options, choice=tuple(msg.choice.choices))
    if kind == "json_object":
        return dataclasses.replace(options, json_object=msg.json_object)
    return dataclasses.replace(options, **{kind: getattr(msg, kind)})


def to_proto(params: StructuredOutputsParams, msg: types_pb2.StructuredOutputsParams) -> None:
    """Fill `msg` (a field of the message being built) from `params`."""
    kind = params.kind
    if kind == "choice":
        msg.choice.choices.extend(params.choice or ())
    else:
        setattr(msg, kind, getattr(params, kind))
    msg.disable_any_whitespace = params.disable_any_whitespace
    msg.disable_additional_properties = params.disable_additional_properties
    msg.whitespace_pattern = params.whitespace_pattern
