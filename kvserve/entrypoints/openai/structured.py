"""A request's output constraint from its HTTP fields (response_format, structured_outputs, guided_*), and the check
of the JSON schemas clients send."""
from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

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


# the meta-schema without its format checker: a "pattern" is ECMA-262 syntax (\p{L}, ...), which Python's re would
# refuse; the grammar compiler judges patterns
_META = Draft202012Validator(Draft202012Validator.META_SCHEMA)


def check_json_schema(schema: Any, param: str, where: str) -> None:
    """400 naming `param` when `schema` is not a JSON schema (Draft 2020-12's meta-schema, older drafts' keywords
    being unknown keywords there, which JSON Schema allows)."""
    error = best_match(_META.iter_errors(schema))
    if error is not None:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise BadRequestError(f"{where}{path} is not a valid JSON schema: {error.message}", param, "invalid_value")
