"""The bad-input table of wave 3's HTTP surfaces (structured outputs, tools, Responses, LoRA
admin, pooling routes on a generative model), against the tiny model with default flags: the
hostile probe's cases, each with the status, message fragment and `param` it must get. Every row
is one case of test_surface_bad_input.py; ACCEPTED holds the edges vLLM serves too."""

from __future__ import annotations

from typing import Any

from tests.reliability.http_cases import CHAT, COMPLETIONS, HttpCase

RESPONSES, LOAD_LORA, UNLOAD_LORA = (
    "/v1/responses",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
)
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def chat(id: str, fragment: str, param: str | None, status: int = 400, **body: Any) -> HttpCase:
    return HttpCase(id, CHAT, {"messages": USER, "max_tokens": 4, **body}, status, fragment, param)


def cmpl(id: str, fragment: str, param: str | None, **body: Any) -> HttpCase:
    return HttpCase(
        id, COMPLETIONS, {"prompt": "hi", "max_tokens": 4, **body}, 400, fragment, param
    )


def so(id: str, fragment: str, param: str, constraint: Any) -> HttpCase:
    """A completions call with vLLM's `structured_outputs` field."""
    return cmpl(id, fragment, param, structured_outputs=constraint)


def schema(id: str, fragment: str, param: str, json_schema: Any) -> HttpCase:
    return chat(
        id, fragment, param, response_format={"type": "json_schema", "json_schema": json_schema}
    )


def resp(id: str, fragment: str, param: str | None, status: int = 400, **body: Any) -> HttpCase:
    return HttpCase(
        id, RESPONSES, {"input": "hi", "max_output_tokens": 4, **body}, status, fragment, param
    )


STRUCTURED_CASES = [
    chat(
        "rf-unknown-type",
        "must be one of text, json_object",
        "response_format.type",
        response_format={"type": "xml"},
    ),
    chat(
        "rf-schema-missing",
        "must be an object",
        "response_format.json_schema",
        response_format={"type": "json_schema"},
    ),
    schema(
        "rf-schema-not-object",
        "must be a JSON Schema object",
        "response_format.json_schema.schema",
        {"name": "x", "schema": 5},
    ),
    schema(
        "rf-schema-bad-type",
        "type must be a string",
        "response_format",
        {"name": "x", "schema": {"type": 123}},
    ),
    schema(
        "rf-schema-bad-ref",
        "does not exist",
        "response_format",
        {"name": "x", "schema": {"$ref": "#/$defs/nope"}},
    ),
    so("so-bad-regex", "unclosed group", "structured_outputs.regex", {"regex": "("}),
    so("so-empty-choice", "at least one string", "structured_outputs.choice", {"choice": []}),
    so("so-bad-grammar", "Expected ')'", "structured_outputs.grammar", {"grammar": "root ::= ("}),
    so("so-two-kinds", "exactly one of", "structured_outputs", {"regex": "a+", "choice": ["a"]}),
    so("so-not-object", "must be an object", "structured_outputs", "a"),
    so("so-unknown-key", "unknown keys ['xml']", "structured_outputs", {"xml": "a"}),
    so(
        "so-json-not-schema",
        "must be a JSON Schema object",
        "structured_outputs.json",
        {"json": [1]},
    ),
    so(
        "so-regex-over-limit",
        "at most 262144",
        "structured_outputs.regex",
        {"regex": "a" * 300_000},
    ),
    so(
        "so-structural-tag-not-json",
        "is not valid JSON",
        "structured_outputs.structural_tag",
        {"structural_tag": "{not json"},
    ),
]

TOOL_CASES = [
    chat("tools-not-list", "must be a list", "tools", tools={"a": 1}),
    chat("tools-bad-type", 'must be "function"', "tools[0].type", tools=[{"type": "retrieval"}]),
    chat(
        "tools-no-name",
        "must be 1 to 64",
        "tools[0].function.name",
        tools=[{"type": "function", "function": {}}],
    ),
    chat(
        "tools-params-not-object",
        "must be an object",
        "tools[0].function.parameters",
        tools=[{"type": "function", "function": {"name": "f", "parameters": 7}}],
    ),
    chat("tools-defined-twice", "is defined twice", "tools[1].function.name", tools=[TOOL, TOOL]),
    chat(
        "tool-choice-unknown-function",
        "does not match any",
        "tool_choice",
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "g"}},
    ),
    chat(
        "tool-choice-required-without-tools",
        "`tools` must be set",
        "tool_choice",
        tool_choice="required",
    ),
    chat(  # as vLLM: "auto" needs a tool-call parser
        "tool-choice-auto-without-a-parser",
        "requires --enable-auto-tool-choice and --tool-call-parser",
        "tool_choice",
        tools=[TOOL],
        tool_choice="auto",
    ),
    chat(
        "tool-choice-unknown-mode",
        "Invalid value for `tool_choice`",
        "tool_choice",
        tools=[TOOL],
        tool_choice="sometimes",
    ),
    HttpCase(
        "tool-call-arguments-not-json",
        CHAT,
        {
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "1", "type": "function", "function": {"name": "f", "arguments": 5}}
                    ],
                },
            ],
            "max_tokens": 4,
        },
        400,
        "must be a JSON object",
        "messages[1].tool_calls[0].function.arguments",
    ),
]

RESPONSES_CASES = [
    resp("resp-input-number", "must be a list", "input", input=5),
    resp(
        "resp-unknown-item", "'bogus' is not supported", "input[0].type", input=[{"type": "bogus"}]
    ),
    resp(
        "resp-previous-unknown", "not found", "previous_response_id", previous_response_id="resp_x"
    ),
    resp(
        "resp-builtin-tool",
        "only function tools are",
        "tools[0].type",
        tools=[{"type": "web_search"}],
    ),
    resp("resp-negative-max", "must be >= 1", "max_output_tokens", max_output_tokens=-1),
    resp(
        "resp-format-without-schema",
        "is required",
        "response_format.json_schema.schema",
        text={"format": {"type": "json_schema"}},
    ),
    HttpCase(
        "resp-get-unknown", f"{RESPONSES}/resp_x", None, 404, "not found", "response_id", "GET"
    ),
    HttpCase(
        "resp-delete-unknown",
        f"{RESPONSES}/resp_x",
        None,
        404,
        "not found",
        "response_id",
        "DELETE",
    ),
    HttpCase(
        "resp-cancel-unknown", f"{RESPONSES}/resp_x/cancel", None, 404, "not found", "response_id"
    ),
]

RUNTIME_LORA_OFF = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
LORA_CASES = [
    HttpCase(
        "lora-load-when-off",
        LOAD_LORA,
        {"lora_name": "a", "lora_path": "/etc"},
        404,
        RUNTIME_LORA_OFF,
        None,
    ),
    HttpCase(
        "lora-load-traversal-when-off",
        LOAD_LORA,
        {"lora_name": "../..", "lora_path": "/"},
        404,
        RUNTIME_LORA_OFF,
        None,
    ),
    HttpCase("lora-unload-when-off", UNLOAD_LORA, {"lora_name": "a"}, 404, RUNTIME_LORA_OFF, None),
    HttpCase("lora-load-not-json", LOAD_LORA, b"{", 400, "not valid JSON", None),
    HttpCase(
        "lora-unknown-model",
        COMPLETIONS,
        {"prompt": "hi", "model": "nope-adapter"},
        404,
        "does not exist",
        None,
    ),
]

POOLING_ON_GENERATE = "it is served for generation"
POOLING_CASES = [
    HttpCase(f"{name}-on-a-generative-model", path, body, 400, POOLING_ON_GENERATE, "model")
    for name, path, body in [
        ("embeddings", "/v1/embeddings", {"input": "hi"}),
        ("embeddings-bad-input", "/v1/embeddings", {"input": {"a": 1}}),
        ("score", "/v1/score", {"text_1": "a", "text_2": "b"}),
        ("rerank", "/v1/rerank", {"query": "a", "documents": ["b"]}),
        ("pooling", "/pooling", {"input": "hi"}),
        ("classify", "/classify", {"input": "hi"}),
    ]
]
REFUSED = STRUCTURED_CASES + TOOL_CASES + RESPONSES_CASES + LORA_CASES + POOLING_CASES

ACCEPTED: dict[str, tuple[str, dict[str, Any]]] = {
    # vLLM still reads the pre-0.11 guided_* fields as structured outputs.
    "guided-choice-legacy-field": (
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 8, "guided_choice": ["yes", "no"]},
    ),
    # vLLM does not require tool_call_id on a tool message (its message types are not checked).
    "tool-message-without-id": (
        CHAT,
        {"messages": [*USER, {"role": "tool", "content": "x"}], "max_tokens": 4},
    ),
}
