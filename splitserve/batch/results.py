"""An append-only JSONL of result lines that survives a crash: each line is written whole and
synced before the next request's result; on reopening, a torn last line is cut off and the
custom_ids already present are reported done, so a resumed run neither loses nor repeats a line."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from splitserve.api.response_bodies import one_line_json


class ResultLog:
    def __init__(self, path: str | Path, on_line: Callable[[dict], None] = lambda line: None):
        """`on_line`: sees every line in the log, those read back on opening, then each appended."""
        self.path = Path(path)
        self.on_line = on_line
        self.done: dict[str, dict] = {}  # custom_id -> its result line
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = self.path.read_bytes() if self.path.exists() else b""
        whole = data[:data.rfind(b"\n") + 1]
        for raw in whole.splitlines():
            line = json.loads(raw)
            self.done[line["custom_id"]] = line
            on_line(line)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if len(whole) < len(data):
            os.ftruncate(self._fd, len(whole))

    def append(self, line: dict) -> None:
        if line["custom_id"] in self.done:
            raise ValueError(f"custom_id {line['custom_id']!r} already has a result in {self.path}")
        os.write(self._fd, (one_line_json(line) + "\n").encode())
        os.fsync(self._fd)
        self.done[line["custom_id"]] = line
        self.on_line(line)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "ResultLog":
        return self

    def __exit__(self, *_) -> None:
        self.close()
