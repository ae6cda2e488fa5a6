"""An Azure trace's TIMESTAMP column read as seconds since its first row, against Python's datetime."""
from datetime import datetime

import pytest

from splitserve.bench.workload import load_trace


@pytest.mark.parametrize("stamps", [
    ["2024-01-01 00:00:00.5000000", "2024-01-01 00:00:01.2500001", "2024-01-02 00:00:00"],
    ["1601-03-01 12:00:00", "2262-04-11 23:47:16", "2262-04-12 00:00:00", "9999-12-31 23:59:59.999999"],
], ids=["azure", "past-nanosecond-range"])
def test_timestamps_are_seconds_since_the_first(tmp_path, stamps):
    """Outside 1678-2262 (what nanoseconds since 1970 hold) too: numpy wrapped those silently."""
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{s},3,4\n" for s in stamps))
    first = datetime.fromisoformat(stamps[0][:26])
    want = [(datetime.fromisoformat(s[:26]) - first).total_seconds() for s in stamps]
    assert load_trace(str(path)).timestamps_s.tolist() == pytest.approx(want, abs=1e-6)
