"""A JsonFiles line is the text of `json.dumps({"sequence": n, **line})`, whether the store
encodes the line's values or the caller brings them encoded; read back, with each value's text
where asked, without the collector's passes."""
from __future__ import annotations

import gc
import json

import pytest

from splitserve.cluster.json_files import JsonFiles, fields_of

LINE = {"response": {"id": "resp_é", "text": "a\u2028b\n\"q\"", "n": [1, 2.5, None, True]}, "items": []}


def test_lines_are_the_encoders_text_however_their_values_came(tmp_path):
    files = JsonFiles(tmp_path)
    files.write("a", LINE)
    files.append("a", {"items": [{"k": "v"}]})
    files.write_encoded("b", {key: json.dumps(value) for key, value in LINE.items()})
    assert (tmp_path / "a.json").read_text() == "".join(
        json.dumps(line) + "\n" for line in ({"sequence": 1, **LINE}, {"sequence": 2, "items": [{"k": "v"}]}))
    assert (tmp_path / "b.json").read_text() == json.dumps({"sequence": 3, **LINE}) + "\n"
    assert JsonFiles(tmp_path).read() == [("a", [LINE, {"items": [{"k": "v"}]}]), ("b", [LINE])]


@pytest.mark.parametrize("value", [LINE, {}, {"a": []}, {"k": {"x": [1, {"y": "}"}]}, "s": "a,b:}{"}])
def test_fields_are_what_json_reads_each_with_the_encoders_text(value):
    for text in (json.dumps(value), json.dumps(value, indent=2), f" {json.dumps(value, separators=(',', ':'))}\n"):
        got = fields_of(text)
        assert {key: value for key, (value, _) in got.items()} == json.loads(text)
        assert all(json.loads(part) == json.loads(text)[key] for key, (_, part) in got.items())
    assert {key: part for key, (_, part) in fields_of(json.dumps(value)).items()} == {
        key: json.dumps(member) for key, member in value.items()}


@pytest.mark.parametrize("text", ['{"a": 1', '{"a": 1,}', '{"a": 1} x', '{"a" 1}', '{1: 2}', '{"a": }', ''])
def test_what_json_refuses_fields_refuse(text):
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        fields_of(text)


def test_fields_of_anything_but_an_object_are_refused():
    with pytest.raises(ValueError, match="not a JSON object"):
        fields_of("[1]")


def test_reading_starts_no_collection_and_leaves_the_collector_as_it_was(tmp_path):
    """Each full pass while a large entry was parsed walked everything parsed so far."""
    files = JsonFiles(tmp_path)
    files.write("a", {"items": [[index] for index in range(20_000)]})
    started = []
    gc.callbacks.append(lambda phase, info: started.append(info) if phase == "start" else None)
    try:
        [(_, [line])] = JsonFiles(tmp_path).read()
        [(_, [fields])] = JsonFiles(tmp_path).read_fields()
    finally:
        gc.callbacks.pop()
    assert len(started) <= 2 and gc.isenabled(), len(started)  # the walk of the directory's own
    assert fields["items"][0] == line["items"] and len(line["items"]) == 20_000
