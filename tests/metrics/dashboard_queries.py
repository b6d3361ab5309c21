"""Reading the dashboard's queries in tests: the metrics each one uses and Grafana's variable
substitution."""

from __future__ import annotations

import re

METRIC_NAME = re.compile(
    r"\b(vllm:[a-z0-9_:]+|splitserve_[a-z0-9_]+|http_[a-z0-9_]+|grpc_server_[a-z0-9_]+)\b"
)
LABEL_VALUES = re.compile(r"^label_values\((.+),\s*([a-zA-Z_]\w*)\)$")


def metric_names(expr: str) -> set[str]:
    """The vllm:, splitserve_ and http_ metric names an expression reads."""
    return set(METRIC_NAME.findall(expr))


def parse_label_values(query: str) -> tuple[str, str]:
    """`label_values(selector, label)` -> (selector, label)."""
    match = LABEL_VALUES.match(query)
    assert match, f"not a label_values() query: {query}"
    return match.group(1), match.group(2)


def grafana_value(values: list[str], is_multi: bool) -> str:
    """What Grafana puts in a query for a variable's selected values: the value itself, or a
    regex alternation of the values for a multi-value variable."""
    for value in values:
        assert re.fullmatch(r"[\w.:/-]+", value), f"needs regex escaping: {value!r}"
    return f"({'|'.join(values)})" if is_multi else values[0]


def substitute(text: str, values: dict[str, str], rate_interval: str) -> str:
    """Grafana's variable substitution: $name -> its value, longest names first."""
    text = text.replace("$__rate_interval", rate_interval)
    for name in sorted(values, key=len, reverse=True):
        text = text.replace(f"${name}", values[name])
    return text
