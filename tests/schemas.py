"""JSON schemas the structured output and tool call tests share, and a
checker for the parts of JSON schema they use (no jsonschema package)."""

from __future__ import annotations

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "role": {"enum": ["student", "teacher", "doctor", "other"]},
    },
    "required": ["name", "age", "city", "pets", "role"],
    "additionalProperties": False,
}
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ADD = {
    "name": "add",
    "description": "Add two integers",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}


def valid(value, schema) -> bool:
    """`value` against the parts of JSON schema these tests use."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (
            isinstance(value, dict)
            and all(k in value for k in schema.get("required", []))
            and (schema.get("additionalProperties", True) or set(value) <= set(props))
            and all(valid(v, props[k]) for k, v in value.items() if k in props)
        )
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema.get("maxItems", len(value))
            and all(valid(v, schema["items"]) for v in value)
        )
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and schema.get("minimum", value) <= value <= schema.get("maximum", value)
        )
    return True
