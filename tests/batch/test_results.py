"""The result log's writes and syncs (`splitserve.batch.results`): each line is one whole write,
read back by a log opened after a killed process (no close, no sync); the file is synced once per
SYNC_EVERY_S of appends, not per line, and on close."""
from __future__ import annotations

from splitserve.batch import results
from splitserve.batch.results import ResultLog
from tests.batch.batch_helpers import answered


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_are_synced_once_per_interval_and_on_close(tmp_path, monkeypatch):
    clock, syncs = Clock(), []
    monkeypatch.setattr(results.time, "monotonic", clock)
    monkeypatch.setattr(results.os, "fsync", syncs.append)
    log = ResultLog(tmp_path / "out.jsonl")
    for i in range(100):  # a burst: none past the interval
        log.append(answered(f"req-{i}"))
    assert syncs == []
    clock.now += results.SYNC_EVERY_S
    log.append(answered("req-100"))
    assert len(syncs) == 1  # the burst and this line together
    clock.now += results.SYNC_EVERY_S / 2
    log.append(answered("req-101"))
    assert len(syncs) == 1
    log.close()
    assert len(syncs) == 2
    log.close()  # closed: nothing more
    assert len(syncs) == 2
    empty = ResultLog(tmp_path / "empty.jsonl")
    empty.close()  # nothing written, nothing to sync
    assert len(syncs) == 2


def test_a_log_left_unsynced_by_a_killed_process_reads_back_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(results.os, "fsync", lambda fd: None)  # no sync happens
    written = ResultLog(tmp_path / "out.jsonl")
    for i in range(50):
        written.append(answered(f"req-{i}"))
    resumed = ResultLog(tmp_path / "out.jsonl")  # `written` never closed: as a killed server leaves it
    assert list(resumed.done) == [f"req-{i}" for i in range(50)]
    resumed.close()
    written.close()


def test_a_line_made_in_pieces_is_the_same_text_and_reads_back(tmp_path):
    entries = [{"token": f"t\u2028{i}é", "logprob": -i / 7, "top_logprobs": [{"token": "\x85", "logprob": -1.5}]}
               for i in range(500)]
    line = answered("req-0")
    line["response"]["body"]["choices"] = [{"index": 0, "logprobs": {"content": entries}}]
    text = results.line_text(line, in_pieces=True)
    assert text == results.line_text(line) and text.count("\n") == 1 and "\u2028" not in text
    with ResultLog(tmp_path / "out.jsonl") as log:
        log.append(line, text)
    with ResultLog(tmp_path / "out.jsonl") as reread:
        assert reread.done == {"req-0": line}
