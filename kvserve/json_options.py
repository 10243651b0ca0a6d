"""The options given as one JSON object (speculative_config, kv_transfer_config): a dict or its JSON text, whose
keys must be the fields of the dataclass it becomes."""
from __future__ import annotations

import json
from dataclasses import fields

from kvserve.errors import InvalidRequestError


def json_object(value, cls, param: str) -> dict:
    """`value` (a dict or JSON object text) as a dict of `cls`'s fields; InvalidRequestError naming `param`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be a JSON object, got {type(value).__name__}", param)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidRequestError(f"unknown {param} key(s) {unknown}; known: {sorted(known)}", param)
    return dict(value)
