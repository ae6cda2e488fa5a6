"""An append-only JSONL of result lines that survives a crash: each line is written whole (one
write), so a killed process loses none; the file is synced at most SYNC_EVERY_S after a line is
written (at the next append past that, else on close), so a machine that loses power loses at most
the lines of the last SYNC_EVERY_S, whose requests a resumed run runs again. On reopening, a torn
last line is cut off and the custom_ids present are reported done, so a resumed run neither loses
nor repeats a line. Syncing each line held the caller's event loop at every result (0.3 ms on a
local ext4 disk, milliseconds on a network volume).
A whole line that is not a result line (JSON with a string custom_id) is a ValueError naming the
file and the line: only this class writes the log, so the file was damaged or is not one."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from splitserve.api.json_pieces import dumps_in_pieces
from splitserve.api.response_bodies import one_line_json

SYNC_EVERY_S = 0.5
JSON_SEPARATORS = (", ", ": ")  # json.dumps' own, which one_line_json keeps


def line_text(line: dict, in_pieces: bool = False) -> str:
    """`line` as the log writes it. `in_pieces`: the same text, made by `dumps_in_pieces` (a line
    with a large body, encoded in a thread without holding the GIL throughout)."""
    text = dumps_in_pieces(line, one_line_json, JSON_SEPARATORS) if in_pieces else one_line_json(line)
    return text + "\n"


class ResultLog:
    def __init__(self, path: str | Path, on_line: Callable[[dict], None] = lambda line: None):
        """`on_line`: sees every line in the log, those read back on opening, then each appended."""
        self.path = Path(path)
        self.on_line = on_line
        self.done: dict[str, dict] = {}  # custom_id -> its result line
        self._synced_at, self._unsynced = time.monotonic(), False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = self.path.read_bytes() if self.path.exists() else b""
        whole = data[:data.rfind(b"\n") + 1]
        for number, raw in enumerate(whole.split(b"\n")[:-1], 1):  # lines end in \n alone (`append`)
            line = self._parse(raw, number)
            self.done[line["custom_id"]] = line
            on_line(line)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if len(whole) < len(data):
            os.ftruncate(self._fd, len(whole))

    def _parse(self, raw: bytes, number: int) -> dict:
        """Line `number` (from 1), as `append` wrote it."""
        try:
            line = json.loads(raw)
        except UnicodeDecodeError:
            problem = "not UTF-8"
        except json.JSONDecodeError as error:
            problem = f"not valid JSON ({error.msg} at column {error.colno})"
        else:
            if isinstance(line, dict) and isinstance(line.get("custom_id"), str):
                return line
            problem = f"not a JSON object with a string custom_id: {raw[:80].decode(errors='replace')}"
        raise ValueError(f"{self.path} line {number}: {problem}; the file is damaged or is not a result log")

    def append(self, line: dict, text: str | None = None) -> None:
        """`text`: `line_text(line)`, where the caller made it beforehand (in a thread)."""
        if line["custom_id"] in self.done:
            raise ValueError(f"custom_id {line['custom_id']!r} already has a result in {self.path}")
        os.write(self._fd, (line_text(line) if text is None else text).encode())
        self._unsynced = True
        if time.monotonic() - self._synced_at >= SYNC_EVERY_S:
            self.sync()
        self.done[line["custom_id"]] = line
        self.on_line(line)

    def sync(self) -> None:
        """The lines written so far, on disk."""
        if self._unsynced:
            os.fsync(self._fd)
        self._synced_at, self._unsynced = time.monotonic(), False

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "ResultLog":
        return self

    def __exit__(self, *_) -> None:
        self.close()
