"""A directory of entries kept as JSON files, `<dir>/<name>.json`, each written whole and renamed
into place with a sequence number that orders the files by when each was written (so a store that
reads them again knows which were kept last). Not fsynced: a killed process loses nothing, a
machine that loses power may lose the last writes. A file that cannot be written (a full disk) or
read is logged, never raised: the entry stays in memory, or is left out of what is read."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class JsonFiles:
    def __init__(self, directory: Path):
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self._sequence = 0  # the last file's

    def read(self) -> list[tuple[str, dict]]:
        """Every entry that reads, as (name, entry), the last written last; a write the process did
        not finish is removed."""
        read: list[tuple[int, str, dict]] = []
        for path in self.directory.glob("*.json"):
            try:
                entry = json.loads(path.read_bytes())
                read.append((int(entry.pop("sequence")), path.stem, entry))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                log.exception("stored entry %s does not read; left out (and left there)", path)
        for path in self.directory.glob(".*.tmp"):
            path.unlink(missing_ok=True)
        read.sort(key=lambda found: found[0])
        self._sequence = max(self._sequence, read[-1][0] if read else 0)
        return [(name, entry) for _, name, entry in read]

    def write(self, name: str, entry: dict) -> None:
        path = self.directory / f"{name}.json"
        temporary = path.with_name(f".{path.name}.tmp")
        self._sequence += 1
        try:
            temporary.write_text(json.dumps({"sequence": self._sequence, **entry}))
            os.replace(temporary, path)
        except OSError:  # a full disk: kept in memory still, and the request that kept it goes on
            log.exception("stored entry %s could not be written to %s", name, self.directory)

    def remove(self, name: str) -> None:
        try:
            (self.directory / f"{name}.json").unlink(missing_ok=True)
        except OSError:
            log.exception("stored entry %s could not be removed from %s", name, self.directory)
