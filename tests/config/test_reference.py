"""The committed configuration reference is what the schema generates, and says something of
every field."""
from pathlib import Path

from pydantic import BaseModel

from splitserve.config import ClusterConfig
from splitserve.config.reference import _models_in, markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration-reference.md"


def test_committed_page_is_what_the_schema_generates():
    assert PAGE.read_text() == markdown(), (
        "docs/configuration-reference.md is stale: python -m splitserve.config.reference > "
        "docs/configuration-reference.md")


def _fields(model: type[BaseModel], path: str = ""):
    for name, field in model.model_fields.items():
        yield f"{path}{name}", field
        for _, nested in _models_in(field.annotation):
            yield from _fields(nested, f"{path}{name}.")


def test_every_field_has_a_description_and_a_row():
    page = markdown()
    for path, field in _fields(ClusterConfig):
        assert field.description, f"{path} has no description"
        assert f"| `{path.rsplit('.', 1)[-1]}` |" in page


def test_sections_follow_the_nesting():
    headings = [line for line in markdown().splitlines() if line.startswith("## ")]
    assert headings[:3] == ["## `top level`", "## `pools[]`", "## `pools[].resources`"]
    assert "## `hardware_classes.<name>`" in headings and "## `engine.slo_scheduling`" in headings
