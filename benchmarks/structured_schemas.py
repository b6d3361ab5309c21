"""The JSON Schemas of benchmarks/structured_cost.py.

RECORDS: the TPOT schema. A list of at least 64 small records (integer with bounds, short
string, number, boolean, enum), so a JSON document that satisfies it is far longer than the
128 tokens measured: the grammar cannot end early, and every measured token is masked, across
keys, punctuation, numbers, strings and enum values.

twenty_fields(salt): a 20-field object (strings with lengths and patterns, bounded numbers,
enums, arrays, a nested object, required and optional fields) for the compile measurement;
`salt` renames one field so each salt is a grammar the core has not compiled yet (a cache miss).
"""

from __future__ import annotations

import json
from typing import Any

RECORDS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 999999},
                    "name": {"type": "string", "maxLength": 12},
                    "score": {"type": "number"},
                    "ok": {"type": "boolean"},
                    "tag": {"enum": ["alpha", "beta", "gamma"]},
                },
                "required": ["id", "name", "score", "ok", "tag"],
            },
        }
    },
    "required": ["records"],
}


def twenty_fields(salt: str) -> dict[str, Any]:
    """A 20-field schema, one field named after `salt` (each salt a distinct grammar)."""
    fields: dict[str, Any] = {
        f"id_{salt}": {"type": "integer", "minimum": 0, "maximum": 10**9},
        "title": {"type": "string", "minLength": 3, "maxLength": 80},
        "email": {"type": "string", "pattern": "^[a-z0-9._]+@[a-z0-9]+\\.[a-z]{2,6}$"},
        "price": {"type": "number", "minimum": 0, "maximum": 100000},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 500},
        "currency": {"enum": ["EUR", "USD", "GBP", "JPY", "CHF"]},
        "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4,6}$"},
        "created": {"type": "string", "format": "date-time"},
        "status": {"enum": ["draft", "active", "archived", "deleted"]},
        "weight_kg": {"type": "number", "exclusiveMinimum": 0},
        "dimensions": {
            "type": "object",
            "properties": {n: {"type": "number", "minimum": 0} for n in ("w", "h", "d")},
            "required": ["w", "h", "d"],
        },
        "supplier": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
        "discount": {"type": ["number", "null"]},
        "notes": {"type": "string", "maxLength": 200},
        "related_ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 5},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
    }
    assert len(fields) == 20
    required = [name for i, name in enumerate(fields) if i % 4 != 3]
    return {"type": "object", "properties": fields, "required": required}


def as_text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, separators=(",", ":"))
