"""JSON schemas the structured-output tests constrain the embedded model with.

Strings and arrays are bounded so that each answer fits the tests' small max_tokens.
"""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_object": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "integer_range": {
        "type": "object",
        "properties": {"score": {"type": "integer", "minimum": 10, "maximum": 20}},
        "required": ["score"],
    },
    "negative_range": {
        "type": "object",
        "properties": {"t": {"type": "integer", "minimum": -40, "maximum": -5}},
        "required": ["t"],
    },
    "number_range": {
        "type": "object",
        "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["ratio"],
    },
    "exclusive_range": {
        "type": "object",
        "properties": {"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}},
        "required": ["n"],
    },
    "enum_string": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    "enum_mixed": {
        "type": "object",
        "properties": {"v": {"enum": [1, "two", None, True]}},
        "required": ["v"],
    },
    "const": {
        "type": "object",
        "properties": {"kind": {"const": "point"}, "x": {"type": "integer"}},
        "required": ["kind", "x"],
    },
    "boolean_and_null": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "nothing": {"type": "null"}},
        "required": ["ok", "nothing"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "note": NAME, "tag": NAME},
        "required": ["id"],
    },
    "nested_object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": NAME,
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["user"],
    },
    "array_of_integers": {
        "type": "object",
        "properties": {
            "values": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}
        },
        "required": ["values"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": NAME,
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                },
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["items"],
    },
    "top_level_array": {
        "type": "array",
        "items": {"enum": ["a", "b", "c"]},
        "minItems": 1,
        "maxItems": 3,
    },
    "ref_defs": {
        "type": "object",
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "ref_definitions": {
        "type": "object",
        "definitions": {"unit": {"enum": ["kg", "lb"]}},
        "properties": {
            "weight": {"type": "number", "minimum": 0, "maximum": 500},
            "unit": {"$ref": "#/definitions/unit"},
        },
        "required": ["weight", "unit"],
    },
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
        "required": ["value"],
    },
    "string_pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
    },
    "string_length": {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 5}},
        "required": ["word"],
    },
    "nullable_union": {
        "type": "object",
        "properties": {"middle_name": {"type": ["string", "null"], "maxLength": 8}},
        "required": ["middle_name"],
    },
    "nested_arrays": {
        "type": "object",
        "properties": {
            "grid": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2,
                    "maxItems": 2,
                },
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["grid"],
    },
    "no_extra_properties": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "date_like": {
        "type": "object",
        "properties": {
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "month": {"type": "integer", "minimum": 1, "maximum": 12},
        },
        "required": ["year", "month"],
    },
}
