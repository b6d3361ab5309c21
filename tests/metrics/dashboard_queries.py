"""Reading the dashboard's queries in tests: the metrics each one uses, Grafana's variable
substitution, and the recovery metrics that may still be missing."""

from __future__ import annotations

import re
from collections.abc import Iterable

# The recovery row's metrics that the engine-recovery work (issue 13) adds and main does not
# export yet. Until a family appears on some process's /metrics, a panel expression that uses it
# may come back empty, and alerts/dashboards may name it; once it is exported, its panels must
# return data like every other. Remove the entries (and this allow-list) when they have landed.
# (splitserve_frontend_core_reconnects_total, the fifth recovery metric, is exported already.)
PENDING_RECOVERY_FAMILIES = frozenset(
    {
        "splitserve_engine_recoveries_total",
        "splitserve_engine_recovery_seconds",
        "splitserve_engine_requests_resumed_total",
        "splitserve_frontend_requests_resubmitted_total",
    }
)
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
METRIC_NAME = re.compile(r"\b(vllm:[a-z0-9_:]+|splitserve_[a-z0-9_]+|http_[a-z0-9_]+)\b")
LABEL_VALUES = re.compile(r"^label_values\((.+),\s*([a-zA-Z_]\w*)\)$")


def metric_names(expr: str) -> set[str]:
    """The vllm:, splitserve_ and http_ metric names an expression reads."""
    return set(METRIC_NAME.findall(expr))


def family(name: str) -> str:
    """The family a series name belongs to, as a `# TYPE` line names it (histograms lose
    _bucket/_sum/_count; counters keep _total)."""
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def is_pending(name: str) -> bool:
    """A name of the recovery metrics that may not be exported yet (PENDING_RECOVERY_FAMILIES)."""
    return family(name) in PENDING_RECOVERY_FAMILIES


def exported_families(texts: Iterable[str]) -> set[str]:
    """Every family declared in these /metrics pages (a `# TYPE` line, samples or not)."""
    return {
        line.split()[2]
        for text in texts
        for line in text.splitlines()
        if line.startswith("# TYPE ")
    }


def pending_in(expr: str, exported: set[str]) -> set[str]:
    """The allow-listed recovery families an expression reads that nothing exports yet."""
    return {
        family(name)
        for name in metric_names(expr)
        if is_pending(name) and family(name) not in exported
    }


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
