"""What a request asks its output to match: OpenAI's `response_format`, vLLM's `structured_outputs`
and its older `guided_*` fields, as one `OutputConstraint` (or none)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from splitserve.api.errors import RequestError
from splitserve.api.strict_model import STRICT
from splitserve.engine.output_constraint import OutputConstraint


class JSONSchemaFormat(BaseModel):
    model_config = STRICT
    name: str
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")  # {}: any JSON value
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of its fields."""
    model_config = STRICT
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark syntax (llguidance's)
    json_object: bool | None = None


class StructuredOutputFields(BaseModel):
    """The structured-output fields of both endpoints; at most one may be set."""
    model_config = STRICT
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def output_constraint(self) -> tuple[OutputConstraint | None, str | None]:
        """What the output must match, and the field that asked (a RequestError if several did)."""
        asked = []
        if self.response_format is not None and self.response_format.type != "text":
            schema = self.response_format.json_schema
            asked.append(("response_format", "json_object", None) if schema is None else
                         ("response_format", "json_schema", schema.schema_))
        outputs = self.structured_outputs
        if outputs is not None:
            given = [(k, v) for k, v in (("json_schema", outputs.json_), ("regex", outputs.regex),
                                         ("choice", outputs.choice), ("grammar", outputs.grammar)) if v is not None]
            given += [("json_object", None)] if outputs.json_object else []
            if len(given) != 1:
                raise RequestError("structured_outputs: set exactly one of json, regex, choice, grammar and "
                                   "json_object", param="structured_outputs")
            asked.append(("structured_outputs", *given[0]))
        for field, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                asked.append((field, kind, getattr(self, field)))
        if not asked:
            return None, None
        if len(asked) > 1:
            raise RequestError(f"{asked[1][0]}: only one structured-output option per request (already "
                               f"{asked[0][0]})", param=asked[1][0])
        field, kind, value = asked[0]
        try:
            return OutputConstraint.of(kind, value), field
        except ValueError as exc:
            raise RequestError(f"{field}: {exc}", param=field) from None
