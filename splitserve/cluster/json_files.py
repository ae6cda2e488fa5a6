"""A directory of entries kept as files of JSON lines, `<dir>/<name><suffix>`: an entry is written
whole (temporary file renamed into place) or grown by appended lines, each line carrying a sequence
number so the files order by when each was last written (a store that reads them again knows which
were kept last). Not fsynced: a killed process loses nothing, a machine that loses power may lose
the last writes; a line a crash cut short is cut off when the file is read. A file that cannot be
written (a full disk) or read is logged, never raised: the entry stays in memory, or is left out of
what is read."""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

from splitserve.engine.collector import collector_paused

log = logging.getLogger(__name__)


class JsonFiles:
    def __init__(self, directory: Path, suffix: str = ".json"):
        self.directory, self.suffix = directory, suffix
        self.directory.mkdir(parents=True, exist_ok=True)
        self._sequence = 0  # the last line's

    def read(self) -> list[tuple[str, list[dict]]]:
        """Every entry that reads, as (name, its lines without their sequence numbers), the last
        written last; a write the process did not finish is removed, a torn last line cut off."""
        return self._read(_values)

    def read_fields(self) -> list[tuple[str, list[dict[str, tuple[object, str]]]]]:
        """`read`, each value with its text as the file has it (`json.dumps`'), so an entry read
        back need not be encoded again for its size."""
        return self._read(_fields)

    def _read(self, parse: Callable[[str], tuple[dict, int]]) -> list:
        read: list[tuple[int, str, list[dict]]] = []
        for path in self.directory.glob(f"*{self.suffix}"):
            try:
                with collector_paused():  # JSON's values hold no cycles
                    parsed = [parse(line) for line in self._whole_lines(path)]
                sequence = max(sequence for _, sequence in parsed)
                read.append((sequence, path.name[:-len(self.suffix)], [line for line, _ in parsed]))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                log.exception("stored entry %s does not read; left out (and left there)", path)
        for path in self.directory.glob(".*.tmp"):
            path.unlink(missing_ok=True)
        read.sort(key=lambda found: found[0])
        self._sequence = max(self._sequence, read[-1][0] if read else 0)
        return [(name, lines) for _, name, lines in read]

    def write(self, name: str, line: dict) -> None:
        """The entry `name` is this one line now."""
        self.write_encoded(name, _encoded(line))

    def write_encoded(self, name: str, fields: dict[str, str]) -> None:
        """`write` of a line whose values the caller has as JSON text already (a large entry is
        encoded once, for its size, its file and its client)."""
        path = self.directory / f"{name}{self.suffix}"
        temporary = path.with_name(f".{path.name}.tmp")
        try:
            temporary.write_text(self._line(fields), encoding="utf-8")
            os.replace(temporary, path)
        except OSError:  # a full disk: kept in memory still, and the request that kept it goes on
            log.exception("stored entry %s could not be written to %s", name, self.directory)

    def append(self, name: str, line: dict) -> None:
        """`line` after the entry's lines (written whole before)."""
        try:
            with open(self.directory / f"{name}{self.suffix}", "a", encoding="utf-8") as file:
                file.write(self._line(_encoded(line)))
        except OSError:
            log.exception("stored entry %s could not be appended to in %s", name, self.directory)

    def remove(self, name: str) -> None:
        try:
            (self.directory / f"{name}{self.suffix}").unlink(missing_ok=True)
        except OSError:
            log.exception("stored entry %s could not be removed from %s", name, self.directory)

    def _line(self, fields: dict[str, str]) -> str:
        """`json.dumps({"sequence": next, **line})`'s text, from `line`'s values encoded."""
        self._sequence += 1
        rest = "".join(f", {json.dumps(key)}: {text}" for key, text in fields.items())
        return f'{{"sequence": {self._sequence}{rest}}}\n'

    @staticmethod
    def _whole_lines(path: Path) -> list[str]:
        """The file's lines; a last one that does not read (an append a crash cut short) is cut off
        the file too, so the next append starts a line of its own. A file of one line may lack its
        newline (as this store wrote responses before it wrote lines)."""
        text = path.read_text(encoding="utf-8")
        lines = text.split("\n")
        tail = lines.pop()
        if tail:
            try:
                json.loads(tail)
                lines.append(tail)
            except ValueError:
                if not lines:
                    raise
                os.truncate(path, len(text.encode()) - len(tail.encode()))
        return lines


def _encoded(line: dict) -> dict[str, str]:
    return {key: json.dumps(value) for key, value in line.items()}


def _values(text: str) -> tuple[dict, int]:
    line = json.loads(text)
    return line, int(line.pop("sequence"))


def _fields(text: str) -> tuple[dict[str, tuple[object, str]], int]:
    line = fields_of(text)
    return line, int(line.pop("sequence")[0])


_DECODE = json.JSONDecoder().raw_decode
_SPACE = re.compile(r"[ \t\n\r]*")


def fields_of(text: str) -> dict[str, tuple[object, str]]:
    """A JSON object's members as `json.loads` reads them, each value with its text; a ValueError
    where `json.loads` raises one."""
    line, at = {}, _SPACE.match(text).end()
    try:
        if text[at] != "{":
            raise ValueError(f"not a JSON object at {at}")
        at = _SPACE.match(text, at + 1).end()
        while text[at] != "}":
            key, at = _DECODE(text, at)
            at = _SPACE.match(text, at).end()
            if not isinstance(key, str) or text[at] != ":":
                raise ValueError(f"not a member at {at}")
            start = _SPACE.match(text, at + 1).end()
            value, at = _DECODE(text, start)
            line[key] = value, text[start:at]
            at = _SPACE.match(text, at).end()
            if text[at] == ",":
                at = _SPACE.match(text, at + 1).end()
                if text[at] == "}":
                    raise ValueError(f"a comma before the object's end at {at}")
            elif text[at] != "}":
                raise ValueError(f"neither ',' nor '}}' at {at}")
    except IndexError:
        raise ValueError("the object is cut short") from None
    if _SPACE.match(text, at + 1).end() != len(text):
        raise ValueError(f"extra data at {at + 1}")
    return line
