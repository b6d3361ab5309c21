"""`pythonic` (vLLM's PythonicToolParser): Llama 3.2 and 4, ToolACE and other models that call
tools as a Python list of calls, the whole answer (Llama 4 may frame it with
`<|python_start|>` ... `<|python_end|>`):

    [get_weather(city="Paris", days=3), get_time(zone='CET')]

Argument values are Python literals (strings, numbers, True/False/None, lists, dicts); the
arguments become a JSON object. A call's name is known at its `(`, its arguments once its `)`
closes it. An answer that does not start with `[` is content.
"""

from __future__ import annotations

import ast

from frontend_svc.openai.tool_parsers.base import CallDraft, Parsed, ToolParser, dumps

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_PAIRS = {"(": ")", "[": "]", "{": "}"}


class PythonicToolParser(ToolParser):
    markers = (PYTHON_START, PYTHON_END)
    starts_anywhere = False

    def parse(self, text: str, is_final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(PYTHON_START):
            body = body[len(PYTHON_START) :].lstrip()
        elif not is_final and PYTHON_START.startswith(body):
            return Parsed("")
        if not body:
            return Parsed(text if is_final else "")
        if body[0] != "[":
            return Parsed(text)
        return Parsed("", tuple(_calls(body, is_final)))


def _calls(body: str, is_final: bool) -> list[CallDraft]:
    """The calls in `[a(...), b(...)]` as far as they go."""
    calls: list[CallDraft] = []
    pos = 1
    while pos < len(body):
        while pos < len(body) and body[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(body) or body[pos] == "]":
            break
        paren = body.find("(", pos)
        if paren < 0:
            break
        name = body[pos:paren].strip()
        if not name.isidentifier() and not all(p.isidentifier() for p in name.split(".")):
            calls.append(CallDraft(None, "", True))
            break
        close = _closing(body, paren)
        if close is None:
            calls.append(CallDraft(name, "", False))
            break
        calls.append(_call(name, body[pos : close + 1]))
        pos = close + 1
    return calls


def _closing(body: str, start: int) -> int | None:
    """Index of the bracket closing the one at `start` (strings skipped), or None."""
    stack: list[str] = []
    quote = ""
    pos = start
    while pos < len(body):
        char = body[pos]
        if quote:
            if char == "\\":
                pos += 1
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in _PAIRS:
            stack.append(_PAIRS[char])
        elif stack and char == stack[-1]:
            stack.pop()
            if not stack:
                return pos
        pos += 1
    return None


def _call(name: str, source: str) -> CallDraft:
    """A complete call's arguments as a JSON object; a call that is not `name(key=literal,
    ...)` gets arguments that are not JSON (so the answer falls back to content)."""
    try:
        node = ast.parse(source, mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            raise ValueError("positional arguments")
        values = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        return CallDraft(name, dumps(values), True)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return CallDraft(name, source, True)
