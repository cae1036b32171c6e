"""Five JSON schemas and one valid document of each: the structured-output benchmarks' and tests' workload.

Strings carry a maxLength (or a pattern), integers bounds and arrays a maxItems: sampled at temperature 1, a small
model rarely picks a closing quote or a digit's end, so an open-ended string or number can outrun any max_tokens
(the reply then ends cut, finish_reason "length"); bounded, every sampled document ends."""

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "email": {"type": "string", "maxLength": 40}},
        "required": ["name", "age"], "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                       "items": {"type": "array", "minItems": 1, "maxItems": 3,
                                 "items": {"type": "object",
                                           "properties": {"sku": {"type": "string", "maxLength": 12},
                                                          "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                                           "required": ["sku", "qty"], "additionalProperties": False}},
                       "paid": {"type": "boolean"}},
        "required": ["id", "items", "paid"], "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 32},
                       "kind": {"enum": ["meeting", "call", "deadline"]},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
                       "priority": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["title", "kind", "priority"], "additionalProperties": False,
    },
    "point": {
        "type": "object",
        "properties": {"kind": {"const": "point"},
                       "coords": {"type": "array", "items": {"type": "integer", "minimum": -999, "maximum": 999},
                                  "minItems": 2, "maxItems": 3},
                       "label": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 16}]}},
        "required": ["kind", "coords", "label"], "additionalProperties": False,
    },
    "config": {
        "type": "object",
        "properties": {"name": {"type": "string", "pattern": "^[a-z_]{1,16}$"},
                       "version": {"type": "string", "pattern": "^[0-9]{1,3}\\.[0-9]{1,3}$"},
                       "debug": {"type": "boolean"},
                       "retries": {"type": "integer", "minimum": 0, "maximum": 10},
                       "mode": {"enum": ["fast", "safe", "off"]}},
        "required": ["name", "version", "debug", "retries", "mode"], "additionalProperties": False,
    },
}

DOCUMENTS = {
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"},
    "order": {"id": 1042, "items": [{"sku": "AB-12", "qty": 2}, {"sku": "ZZ-9", "qty": 11}], "paid": True},
    "event": {"title": "Release planning", "kind": "meeting", "tags": ["q3", "infra"], "priority": 2},
    "point": {"kind": "point", "coords": [15, -225, 10], "label": "origin é"},
    "config": {"name": "read_path", "version": "1.12", "debug": False, "retries": 3, "mode": "safe"},
}
