"""StructuredOutputs: the constraint a request puts on its output (a JSON schema, any JSON object, a regex, a
choice of strings, or an EBNF grammar), as vLLM names them. Pure Python, validated at creation.

What can be checked without the tokenizer is checked here: exactly one constraint, the right types, a JSON schema
that is valid JSON and a valid schema (the `jsonschema` library's meta-schema check). Whether a regex or a grammar
compiles, and within what time, only the grammar compiler knows (engine/grammar.py): the server and LLM.generate
compile before a request is queued, so both kinds of mistake are a 400 naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ostinato.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: `json` (a JSON schema, as a dict or its JSON text), `json_object` (any JSON object),
    `regex`, `choice` (the output is one of these strings), `grammar` (EBNF, as xgrammar reads it).

    `param` names the request field the constraint came from (`response_format`, `tool_choice`, ...) so that
    an error about it names what the user sent; it takes no part in equality."""

    json: str | dict | bool | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}", param=self.param)
        kind = given[0]
        if kind == "json":
            object.__setattr__(self, "json", _canonical_schema(self.json, self.param))
        elif kind == "choice":
            object.__setattr__(self, "choice", _choices(self.choice, self.param))
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise InvalidRequestError(f"{kind} must be a non-empty string, got {value!r}",
                                          param=self.field_name)
        elif self.json_object is not True:
            raise InvalidRequestError(f"json_object must be true, got {self.json_object!r}", param=self.field_name)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def field_name(self) -> str:
        """The name an error about this constraint gives: the request field, with the kind under it."""
        return self.param if self.param != "structured_outputs" else f"structured_outputs.{self.kind}"

    @property
    def key(self) -> tuple[str, Any]:
        """What the compile cache is keyed by: the kind and its (canonical) value."""
        return self.kind, getattr(self, self.kind)

    @property
    def schema(self) -> dict | bool | None:
        return json.loads(self.json) if self.json is not None else None

    def with_param(self, param: str) -> StructuredOutputs:
        new = StructuredOutputs(**{self.kind: getattr(self, self.kind)}, param=param)
        return new


def _canonical_schema(schema, param: str) -> str:
    """The schema as canonical JSON text (sorted keys): equal schemas share one compiled grammar."""
    name = param if param != "structured_outputs" else "structured_outputs.json"
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", param=name) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"a JSON schema must be an object (or true/false), got {type(schema).__name__}",
                                  param=name)
    import jsonschema  # noqa: PLC0415  (loaded by the first constrained request only)

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(map(str, e.path)) or "(root)"
        raise InvalidRequestError(f"the JSON schema is invalid at {where}: {e.message}", param=name) from None
    try:
        return json.dumps(schema, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"the JSON schema cannot be written as JSON: {e}", param=name) from None


def _choices(choice, param: str) -> tuple[str, ...]:
    name = param if param != "structured_outputs" else "structured_outputs.choice"
    if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
        raise InvalidRequestError(f"choice must be a non-empty list of strings, got {choice!r}", param=name)
    if not all(isinstance(c, str) and c for c in choice):
        raise InvalidRequestError("every choice must be a non-empty string", param=name)
    return tuple(choice)


def from_request(value: Any, param: str = "structured_outputs") -> StructuredOutputs | None:
    """vLLM's `structured_outputs` request field (a dict with one of the kinds) as a StructuredOutputs."""
    if value is None:
        return None
    if isinstance(value, StructuredOutputs):
        return value
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be an object with one of {', '.join(KINDS)}", param=param)
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        raise InvalidRequestError(f"{param} has unknown field(s) {unknown}; use one of {', '.join(KINDS)}",
                                  param=param)
    return StructuredOutputs(**{k: v for k, v in value.items() if v is not None}, param=param)


def from_response_format(fmt: dict | None) -> StructuredOutputs | None:
    """OpenAI's `response_format`: {"type": "text"} (no constraint), {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True, param="response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidRequestError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': "
                                      "{...}}}", param="response_format")
        return StructuredOutputs(json=spec["schema"], param="response_format")
    raise InvalidRequestError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                              param="response_format")
