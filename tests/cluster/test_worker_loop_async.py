"""The worker loop's tests that stream tokens, abort, switch roles and fail steps, rerun with the
token worker's engine scheduling asynchronously (each step queues the next iteration before it
builds its outputs), as it does on CUDA: every request still gets the offline engine's tokens,
and every block comes back."""
from __future__ import annotations

import pytest

from tests.cluster.test_worker_loop import Pair, offline  # noqa: F401  (pytest fixture)
from tests.cluster.test_worker_loop import (  # noqa: F401  (collected here, with this module's `pair`)
    test_abort_of_a_running_local_request_stops_its_deltas,
    test_disaggregated_request_equals_offline,
    test_local_request_streams_the_offline_tokens,
    test_requests_of_every_kind_in_flight_at_once,
    test_role_switch_while_requests_run_changes_no_output,
)
from tests.cluster.test_worker_loop_failures import (  # noqa: F401
    test_a_failed_step_fails_its_requests_and_the_loop_serves_the_next,
)


@pytest.fixture
def pair():
    p = Pair(t0={"async_scheduling": True})
    assert p.token.engine.async_scheduling and not p.prompt.engine.async_scheduling
    yield p.start()
    p.close()
