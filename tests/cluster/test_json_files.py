"""A JsonFiles line is the text of `json.dumps({"sequence": n, **line})`, whether the store
encodes the line's values or the caller brings them encoded."""
from __future__ import annotations

import json

from splitserve.cluster.json_files import JsonFiles

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
