"""The configuration reference (docs/configuration-reference.md), generated from `ClusterConfig`:
every field with its type, default and description, one table per section. A test compares the
committed page with this output, so the page cannot drift from the schema.

    python -m splitserve.config.reference > docs/configuration-reference.md
"""
from __future__ import annotations

import json
import types
import typing
from typing import Literal

from pydantic import BaseModel

from splitserve.config import ClusterConfig

HEADER = """# Configuration reference

Generated from `splitserve.config.ClusterConfig` by `python -m splitserve.config.reference`; do not
edit by hand. One schema serves `splitserve serve --config`, the Serve builder
(`splitserve.cluster.app:build_app` args), the helm chart's `cluster` values and the simulator
(see [configuration.md](configuration.md) for how they fit together). Unknown fields are errors.
"""


def markdown(root: type[BaseModel] = ClusterConfig) -> str:
    sections: list[tuple[str, type[BaseModel]]] = []
    _collect("", root, sections)
    parts = [HEADER]
    for path, model in sections:
        parts.append(f"\n## `{path or 'top level'}`\n\n{_doc(model)}| field | type | default | description |\n"
                     "|---|---|---|---|\n")
        for name, field in model.model_fields.items():
            default = "required" if field.is_required() else _value(field.get_default(call_default_factory=True))
            parts.append(f"| `{name}` | {_type(field.annotation)} | {default} | {field.description or ''} |\n")
    return "".join(parts)


def _collect(path: str, model: type[BaseModel], sections: list) -> None:
    """Depth-first: a section, then the sections of its nested models (each once)."""
    if any(m is model for _, m in sections):
        return
    sections.append((path, model))  # a model reached again (none is today) keeps its first path
    for name, field in model.model_fields.items():
        for suffix, nested in _models_in(field.annotation):
            _collect((f"{path}.{name}" if path else name) + suffix, nested, sections)


def _models_in(annotation, suffix: str = "") -> list[tuple[str, type[BaseModel]]]:
    """Models inside an annotation, with the path suffix that reaches them: `[]` for a list's
    items, `.<name>` for a map's values."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(suffix, annotation)]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        return _models_in(args[0], suffix + "[]")
    if origin is dict:
        return _models_in(args[1], suffix + ".<name>")
    return [m for arg in args for m in _models_in(arg, suffix)]


def _doc(model: type[BaseModel]) -> str:
    doc = (model.__doc__ or "").strip()
    return " ".join(doc.split()) + "\n\n" if doc else ""


def _type(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in args)
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return f"map of {_type(args[0])} to {_type(args[1])}"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    return getattr(annotation, "__name__", str(annotation))


def _value(value) -> str:
    if isinstance(value, BaseModel):
        return "its fields' defaults"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return "`" + json.dumps([v.model_dump(exclude_defaults=True) for v in value]) + "`"
    return f"`{json.dumps(value)}`"


if __name__ == "__main__":
    print(markdown(), end="")
