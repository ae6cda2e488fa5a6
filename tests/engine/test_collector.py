"""collector_paused: no collection starts inside, and the collector is left as it was, even when
the work inside raises."""
import gc

import pytest

from splitserve.engine.collector import collector_paused


def test_no_collection_starts_inside_and_the_collector_is_on_again_after():
    started = []
    gc.callbacks.append(lambda phase, info: started.append(info) if phase == "start" else None)
    try:
        with collector_paused():
            made = [[index] for index in range(50_000)]  # far past the youngest generation's threshold
            inside = len(started)
        assert inside == 0 and gc.isenabled()
    finally:
        gc.callbacks.pop()
    assert len(made) == 50_000


def test_an_error_inside_leaves_it_on_and_an_off_collector_stays_off():
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
