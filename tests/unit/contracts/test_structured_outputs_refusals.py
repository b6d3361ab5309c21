"""Constraints that Python's JSON reader or llguidance's schema translation cannot take are
refused by name (InvalidStructuredOutputs, a 400 at the frontend, a failed request in the core)
instead of escaping as RecursionError or ValueError (a 500, an error logged in the core)."""

from __future__ import annotations

import pytest

from splitserve_contracts.structured_outputs import (
    InvalidStructuredOutputs,
    StructuredOutputsParams,
    validate,
)
from splitserve_runtime.grammars import check_grammar, to_llguidance

NESTED = '{"type":"array","items":' * 5_000 + "{}" + "}" * 5_000


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (StructuredOutputsParams(json=NESTED), "json"),
        (
            StructuredOutputsParams(structural_tag=f'{{"t": {"[" * 5_000}{"]" * 5_000}}}'),
            "structural_tag",
        ),
    ],
)
def test_json_deeper_than_python_reads_is_refused_by_name(
    params: StructuredOutputsParams, field: str
) -> None:
    with pytest.raises(InvalidStructuredOutputs, match="nests too deeply") as info:
        validate(params)
    assert info.value.field == field


def test_an_integer_llguidance_cannot_take_is_refused_by_name() -> None:
    params = StructuredOutputsParams(json='{"type": "integer", "maximum": 100000000000000000000}')
    validate(params)
    for compile_ in (check_grammar, to_llguidance):  # the frontend's check, the core's compile
        with pytest.raises(InvalidStructuredOutputs, match="not JSON serializable") as info:
            compile_(params)
        assert info.value.field == "json"


def test_llguidance_error_categories_do_not_read_as_a_python_exception() -> None:
    """A failed matcher's "Parser Error: Current row has 4044 items" reaches the client as the
    request's 400 (the hostile-grammar fuzz found it); it must not look like a leaked exception."""
    from splitserve_runtime.grammars import summary
    from tests.reliability.probes import PYTHON_INTERNALS

    message = summary(["Parser Error: Current row has 4044 items; max is 2000"])
    assert message == "parser error: Current row has 4044 items; max is 2000"
    assert not [fragment for fragment in PYTHON_INTERNALS if fragment in message]
