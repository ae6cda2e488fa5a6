"""A worker of several ranks (tensor parallelism) is weighed by its class's speeds scaled by
`tensor_parallel_speedup`, a law read off Splitwise's own TP 2 / 4 / 8 profiles; checked here
against that CSV and by hand-computed placements."""
import math
import statistics
from collections import defaultdict

import pytest

from splitserve.config import ClusterConfig
from splitserve.placement.hardware import TP_DOUBLING_GAINS, tensor_parallel_speedup
from splitserve.sim.perf_model import profile_setups
from tests.placement.placement_helpers import A100, H100, cluster, load, pair

PROFILED = ("h100-80gb", "a100-80gb")


def measured_doubling_gains() -> dict[int, tuple[float, float]]:
    """TP n -> (median time(n) / time(2n) of prefill, of decode) over the llama2-70b points
    (hardware, prompt_size, batch_size, token_size) profiled at TP 2, 4 and 8; outliers left out."""
    times: dict[tuple, dict[int, tuple[float, float]]] = defaultdict(dict)
    for (model, hardware, tp), rows in profile_setups().items():
        if model != "llama2-70b" or hardware not in PROFILED:
            continue
        points = defaultdict(list)
        for row in rows:
            points[hardware, row.prompt_size, row.batch_size, row.token_size].append(row)
        for point, same in points.items():
            times[point][tp] = (statistics.median(r.prompt_time for r in same),
                                statistics.median(r.token_time for r in same))
    complete = [by_tp for by_tp in times.values() if set(by_tp) == {2, 4, 8}]
    assert len(complete) == 36
    return {n: tuple(statistics.median(by_tp[n][phase] / by_tp[2 * n][phase] for by_tp in complete)
                     for phase in (0, 1)) for n in (2, 4)}


def test_the_law_reproduces_the_profiled_tp_ratios():
    measured = measured_doubling_gains()
    for n, (prompt_gain, token_gain) in measured.items():
        prompt_n, token_n = tensor_parallel_speedup(n)
        prompt_2n, token_2n = tensor_parallel_speedup(2 * n)
        assert prompt_2n / prompt_n == pytest.approx(prompt_gain, rel=0.02), f"prefill, TP {n} -> {2 * n}"
        assert token_2n / token_n == pytest.approx(token_gain, rel=0.02), f"decode, TP {n} -> {2 * n}"
    # the unprofiled first doubling is taken as the second
    assert TP_DOUBLING_GAINS[0] == TP_DOUBLING_GAINS[1]


def test_speedup_between_and_past_powers_of_two():
    assert tensor_parallel_speedup(1) == (1.0, 1.0)
    assert tensor_parallel_speedup(2) == TP_DOUBLING_GAINS[0]
    assert tensor_parallel_speedup(8) == pytest.approx((1.41 * 1.41 * 1.35, 1.28 * 1.28 * 0.98))
    assert tensor_parallel_speedup(16) == tensor_parallel_speedup(64) == tensor_parallel_speedup(8)
    share = math.log2(3) - 1  # TP 3: TP 2's speeds times that share of the 2 -> 4 gain
    assert tensor_parallel_speedup(3) == pytest.approx((1.41 * 1.41 ** share, 1.28 * 1.28 ** share))
    for bad in (0, -2, 2.0):
        with pytest.raises(ValueError, match="tensor_parallel"):
            tensor_parallel_speedup(bad)


def test_a_profile_scaled_for_tp_keeps_its_class_name():
    assert H100.with_tensor_parallel(1) is H100
    a100_tp4 = A100.with_tensor_parallel(4)
    assert a100_tp4.name == "a100"
    assert (a100_tp4.prompt_speed, a100_tp4.token_speed) == pytest.approx((0.45 * 1.41 ** 2, 0.67 * 1.28 ** 2))


def test_a_pool_s_workers_get_the_speeds_of_its_tp():
    config = ClusterConfig.model_validate({"pools": [
        {"role": "prompt", "hardware": "h100", "tensor_parallel_size": 8},
        {"role": "token", "hardware": "a100"}]})
    prompt, token = config.pools
    assert config.worker_hardware(token) is config.hardware("a100")  # TP 1: the class itself
    assert config.worker_hardware(prompt) == H100.with_tensor_parallel(8)
    custom = ClusterConfig.model_validate({"hardware_classes": {"l40s": {"prompt_speed": 0.5, "token_speed": 0.5}},
                                           "pools": [{"role": "mixed", "hardware": "l40s",
                                                      "tensor_parallel_size": 2}]})
    assert custom.worker_hardware(custom.pools[0]).prompt_speed == pytest.approx(0.5 * 1.41)


def test_jsq_weighs_a_tp_worker_s_queue_by_its_scaled_speed():
    # prompt: TP-2 1300 / 1.41 = 922 < TP-1 1000; token: TP-4 1600 / 1.6384 = 977 < TP-1 1000.
    # Unscaled, the TP-1 workers' shorter queues would win both.
    h100_tp2, h100_tp4 = H100.with_tensor_parallel(2), H100.with_tensor_parallel(4)
    state = cluster("jsq", prompt=[("p0", H100, load(pending=1000)), ("p1", h100_tp2, load(pending=1300))],
                    token=[("t0", H100, load(decode=1000)), ("t1", h100_tp4, load(decode=1600))])
    assert pair(state) == ("p1", "t1")
    slower = cluster("jsq", prompt=[("p0", H100, load(pending=1000)), ("p1", h100_tp2, load(pending=1420))],
                     token=[("t0", H100, load(decode=1000)), ("t1", h100_tp4, load(decode=1650))])
    assert pair(slower) == ("p0", "t0")  # 1420 / 1.41 = 1007 > 1000; 1650 / 1.6384 = 1007 > 1000
