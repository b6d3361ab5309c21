"""OpenAI request fields -> SamplingParams, driven by the contract's own field list.

Every SamplingParams field is read from the request field of the same name (vLLM's request
names are the contract's names) and converted by its type hint. Per endpoint there are only
aliases (chat's `max_completion_tokens` for `max_tokens`), fields the endpoint fills itself (chat's
`logprobs` is a bool in OpenAI's chat API) and defaults that differ from the contract's
(completions' `max_tokens` is 16, as in OpenAI and vLLM). A field added to the contract is
accepted over HTTP with no change here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from frontend_svc.openai.fields import Coerce, coercer_for
from splitserve_contracts.sampling_types import SamplingParams

FIELD_COERCERS: dict[str, Coerce] = {
    name: coercer_for(hint) for name, hint in get_type_hints(SamplingParams).items()
}
"""SamplingParams field name -> the coercer of its type, in contract order."""


@dataclass(frozen=True)
class FieldMap:
    """How one endpoint's request fields map onto SamplingParams."""

    aliases: Mapping[str, str] = field(default_factory=dict)
    """Request field -> SamplingParams field; read before (and winning over) the field's own
    name."""
    own: Mapping[str, str] = field(default_factory=dict)
    """SamplingParams fields the endpoint fills itself (not read by name) -> the request field
    that sets it."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Values for fields the request leaves out, where the endpoint's default differs."""

    def by_own_name(self) -> tuple[str, ...]:
        """The SamplingParams fields the endpoint reads from the request field of the same name
        (all but `own`), in contract order: what another API built on it can pass through."""
        return tuple(name for name in FIELD_COERCERS if name not in self.own)

    def request_names(self, name: str) -> list[str]:
        return [alias for alias, target in self.aliases.items() if target == name] + [name]

    def request_name(self, body: Mapping[str, Any], name: str) -> str:
        """The request field that set SamplingParams field `name` in `body`."""
        if name in self.own:
            return self.own[name]
        names = self.request_names(name)
        return next((key for key in names if body.get(key) is not None), names[-1])


COMPLETIONS = FieldMap(defaults={"max_tokens": 16})
CHAT = FieldMap(aliases={"max_completion_tokens": "max_tokens"}, own={"logprobs": "top_logprobs"})


def sampling_values(
    body: Mapping[str, Any], fields: FieldMap, defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The SamplingParams values `body` sets (null counts as unset), over the model's
    `defaults` (its generation config), over the endpoint's defaults; raises InvalidRequest
    naming a field of the wrong type."""
    values: dict[str, Any] = {**fields.defaults, **(defaults or {})}
    for name, coerce in FIELD_COERCERS.items():
        if name in fields.own:
            continue
        for key in fields.request_names(name):
            raw = body.get(key)
            if raw is not None:
                values[name] = coerce(raw, key)
                break
    return values


def sampling_params(
    body: Mapping[str, Any],
    fields: FieldMap,
    defaults: Mapping[str, Any] | None = None,
    **own: Any,
) -> SamplingParams:
    """SamplingParams from `body` over the model's `defaults`, plus the endpoint's own fields
    (`own`, None = unset)."""
    values = sampling_values(body, fields, defaults)
    values.update({k: v for k, v in own.items() if v is not None})
    return SamplingParams(**values)
