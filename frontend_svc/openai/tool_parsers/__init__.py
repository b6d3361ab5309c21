"""Tool-call parsers by vLLM's `--tool-call-parser` names."""

from __future__ import annotations

from frontend_svc.openai.tool_parsers.base import CallDraft, Parsed, ToolCall, ToolParser
from frontend_svc.openai.tool_parsers.harmony import HarmonyToolParser
from frontend_svc.openai.tool_parsers.hermes import HermesToolParser
from frontend_svc.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from frontend_svc.openai.tool_parsers.mistral import MistralToolParser
from frontend_svc.openai.tool_parsers.pythonic import PythonicToolParser
from frontend_svc.openai.tool_parsers.qwen3_xml import Qwen3XmlToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "openai": HarmonyToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3XmlToolParser,
    "qwen3_xml": Qwen3XmlToolParser,
}
"""--tool-call-parser NAME -> its parser (vLLM's names for the same formats)."""

__all__ = ["TOOL_PARSERS", "CallDraft", "Parsed", "ToolCall", "ToolParser"]
