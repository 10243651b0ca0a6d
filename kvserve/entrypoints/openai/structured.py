"""A request's output constraint from its HTTP fields (response_format, structured_outputs, guided_*), and a cheap
structural check of the JSON schemas clients send."""
from __future__ import annotations

from typing import Any

from kvserve.entrypoints.openai.errors import BadRequestError
from kvserve.entrypoints.openai.protocol import SamplingFields
from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import StructuredOutputsParams

# vLLM's older fields and the StructuredOutputsParams field each one sets
GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def request_constraint(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint a request asks for and the field it came from; 400 when more than one field asks."""
    sources = [name for name in ("response_format", "structured_outputs", *GUIDED_ALIASES)
               if _asks(name, getattr(req, name))]
    if len(sources) > 1:
        raise BadRequestError(f"give at most one output constraint, got {', '.join(sources)}", sources[1],
                              "invalid_value")
    if not sources:
        return None, None
    source = sources[0]
    try:
        if source == "response_format":
            return response_format_constraint(req.response_format), source
        if source == "structured_outputs":
            return StructuredOutputsParams.from_value(req.structured_outputs), source
        return StructuredOutputsParams(**{GUIDED_ALIASES[source]: getattr(req, source)}), source
    except InvalidRequestError as e:
        raise BadRequestError(e.message, source, "invalid_value") from e
    except RecursionError:   # JSON text (guided_json, structured_outputs.json) nested too deeply to decode
        raise BadRequestError(f"{source} is nested too deeply", source, "invalid_value") from None


def _asks(name: str, value: Any) -> bool:
    if name == "response_format":
        return value is not None and value.type != "text"
    return value is not None


def response_format_constraint(fmt) -> StructuredOutputsParams:
    """{"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}} as a constraint."""
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise BadRequestError("response_format json_schema needs json_schema.schema (a JSON schema object)",
                              "response_format", "invalid_value")
    check_json_schema(fmt.json_schema.json_schema, "response_format", "response_format.json_schema.schema")
    return StructuredOutputsParams(json=fmt.json_schema.json_schema)


# ----- a structural check of JSON schemas (what Draft 2020-12's meta-schema says of each keyword's own type) -----
_TYPES = {"null", "boolean", "object", "array", "number", "integer", "string"}
_SCHEMA_KEYS = ("not", "if", "then", "else", "additionalProperties", "unevaluatedProperties", "propertyNames",
                "contains", "additionalItems", "unevaluatedItems")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
           "maxContains")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def check_json_schema(schema: Any, param: str, where: str) -> None:
    """400 naming `param` when `schema` is not a JSON schema: an object (or boolean) whose known keywords have
    the types the meta-schema gives them. Unknown keywords are allowed, as JSON Schema allows them."""
    stack = [(schema, where)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            _bad(param, path, "must be a JSON schema (an object or a boolean)")
        stack.extend(_subschemas(node, param, path))
        _check_keywords(node, param, path)


def _subschemas(node: dict, param: str, path: str) -> list[tuple[Any, str]]:
    out = [(node[k], f"{path}.{k}") for k in _SCHEMA_KEYS if k in node]
    for key in _SCHEMA_LISTS:
        if key in node:
            if not isinstance(node[key], list) or (key != "prefixItems" and not node[key]):
                _bad(param, f"{path}.{key}", "must be a non-empty list of schemas")
            out += [(s, f"{path}.{key}[{i}]") for i, s in enumerate(node[key])]
    for key in _SCHEMA_MAPS:
        if key in node:
            if not isinstance(node[key], dict):
                _bad(param, f"{path}.{key}", "must be an object mapping names to schemas")
            out += [(s, f"{path}.{key}.{name}") for name, s in node[key].items()]
    items = node.get("items")
    if isinstance(items, list):   # draft 4-7 tuple form
        out += [(s, f"{path}.items[{i}]") for i, s in enumerate(items)]
    elif "items" in node:
        out.append((items, f"{path}.items"))
    return out


def _check_keywords(node: dict, param: str, path: str) -> None:
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if "type" in node else []
    if not kinds and "type" in node or any(k not in _TYPES for k in kinds):
        _bad(param, f"{path}.type", f"must be one of {', '.join(sorted(_TYPES))} or a list of them, got {kind!r}")
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        _bad(param, f"{path}.required", "must be a list of property names")
    if "enum" in node and not isinstance(node["enum"], list):
        _bad(param, f"{path}.enum", "must be a list")
    for key in _COUNTS:
        if key in node and (not _is_int(node[key]) or node[key] < 0):
            _bad(param, f"{path}.{key}", "must be a non-negative integer")
    for key in _NUMBERS:
        if key in node and (isinstance(node[key], bool) or not isinstance(node[key], (int, float))):
            _bad(param, f"{path}.{key}", "must be a number")
    # the pattern's syntax is ECMA-262's, not Python's: the grammar compiler judges it
    if "pattern" in node and not isinstance(node["pattern"], str):
        _bad(param, f"{path}.pattern", "must be a string (a regular expression)")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bad(param: str, path: str, what: str):
    raise BadRequestError(f"{path} {what}", param, "invalid_value")
