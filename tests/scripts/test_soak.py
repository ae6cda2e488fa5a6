"""The soak test's one-minute version (its own local Ray, in a subprocess): open-loop streaming load
with hostile-but-valid parameters, clients hanging up, a worker SIGKILLed mid-run, then the CLS. No
request is lost, none is placed again but those the kills hit, and no KV block is left in use at
the end (the new CLS adopted the workers, so it checks the very blocks the load used). LoRA
adapters are unloaded and loaded again all along: every load and unload the cluster answered
while its CLS lived succeeded, and at the end every worker holds what the cluster serves."""
import pytest

from tests.scripts.script_runner import run_ray_script


@pytest.mark.serial  # its own local Ray
def test_a_one_minute_soak_loses_nothing_and_leaks_nothing(tmp_path):
    _, result = run_ray_script("soak", tmp_path, "--minutes", "1", "--calibrate-s", "8", "--kill-every-s", "25",
                               "--kill-controller-every-s", "35", "--lora-churn-s", "8", "--port", "8033",
                               timeout=900)
    assert result["requests"] > 20 and result["completed"] > 0 and result["kills"] >= 1
    assert result["controller_kills"] == 1
    assert result["lost"] == 0, result["lost_reasons"]
    assert result["requests_restarted"] <= 50 * result["kills"], result  # only what the kills had in flight
    assert result["leaked_blocks"] == 0, result["blocks_held"]
    assert result["requests"] == (result["completed"] + result["failed_with_error"] + result["disconnected"])
    churn = result["lora_churn"]
    assert churn["statuses"].get("load 200", 0) >= 4 and churn["statuses"].get("unload 200", 0) >= 2, churn
    # 503: the CLS was dying; 409: every slot still ran requests; 404: an unload after such a load
    assert set(churn["statuses"]) <= {f"{what} {status}" for what, statuses in (("load", (200, 409, 503)),
                                                                               ("unload", (200, 404, 503)))
                                      for status in statuses}, churn
    assert churn["consistent"] and churn["served"], churn
