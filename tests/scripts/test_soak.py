"""The soak test's one-minute version (its own local Ray, in a subprocess): open-loop streaming load
with hostile-but-valid parameters, clients hanging up, a worker SIGKILLed mid-run, then the CLS. No
request is lost, none is placed again but those the kills hit, and no KV block is left in use at
the end (the new CLS adopted the workers, so it checks the very blocks the load used)."""
import pytest

from tests.scripts.script_runner import run_ray_script


@pytest.mark.serial  # its own local Ray
def test_a_one_minute_soak_loses_nothing_and_leaks_nothing(tmp_path):
    _, result = run_ray_script("soak", tmp_path, "--minutes", "1", "--calibrate-s", "8", "--kill-every-s", "25",
                               "--kill-controller-every-s", "35", "--port", "8033", timeout=900)
    assert result["requests"] > 20 and result["completed"] > 0 and result["kills"] >= 1
    assert result["controller_kills"] == 1
    assert result["lost"] == 0, result["lost_reasons"]
    assert result["requests_restarted"] <= 50 * result["kills"], result  # only what the kills had in flight
    assert result["leaked_blocks"] == 0, result["blocks_held"]
    assert result["requests"] == (result["completed"] + result["failed_with_error"] + result["disconnected"])
