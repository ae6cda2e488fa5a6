"""Hardware classes: built-in speeds match the Splitwise profiles, lookups fail helpfully."""
import csv
import statistics
from pathlib import Path

import pytest

from splitserve.placement.hardware import HARDWARE_CLASSES, HardwareProfile, hardware_profile

PROFILE_CANDIDATES = [Path(__file__).resolve().parents[3] / "shared" / "profiles" / "perf_model.csv",
                      Path(__file__).resolve().parents[2] / "shared" / "profiles" / "perf_model.csv"]
CSV_NAMES = {"a100": "a100-80gb", "h100-cap": "h100-80gb-pcap"}


def mean_times(path: Path) -> dict[str, tuple[float, float]]:
    """Mean (prompt_time, token_time) per hardware: llama2-70b, 1024-token prompt, batch 1."""
    times: dict[str, list[tuple[float, float]]] = {}
    with open(path) as profile:
        for row in csv.DictReader(profile):
            if (row["model"], row["prompt_size"], row["batch_size"]) == ("llama2-70b", "1024", "1"):
                times.setdefault(row["hardware"], []).append((float(row["prompt_time"]), float(row["token_time"])))
    return {hw: (statistics.fmean(p for p, _ in rows), statistics.fmean(t for _, t in rows))
            for hw, rows in times.items()}


def test_reference_classes_are_unit_speed():
    for name in ("h100", "cpu"):
        assert (HARDWARE_CLASSES[name].prompt_speed, HARDWARE_CLASSES[name].token_speed) == (1.0, 1.0)
    assert set(HARDWARE_CLASSES) == {"h100", "a100", "h100-cap", "cpu"}


def test_speeds_match_the_splitwise_profiles():
    path = next((p for p in PROFILE_CANDIDATES if p.exists()), None)
    if path is None:
        pytest.skip("profiles/perf_model.csv (shared data) not present")
    times = mean_times(path)
    h100_prompt, h100_token = times["h100-80gb"]
    for name, csv_name in CSV_NAMES.items():
        prompt_time, token_time = times[csv_name]
        assert HARDWARE_CLASSES[name].prompt_speed == pytest.approx(h100_prompt / prompt_time, abs=0.01)
        assert HARDWARE_CLASSES[name].token_speed == pytest.approx(h100_token / token_time, abs=0.01)


def test_lookup_by_name_and_custom_classes():
    assert hardware_profile("a100") is HARDWARE_CLASSES["a100"]
    custom = {"l40s": HardwareProfile("l40s", 0.3, 0.4), "h100": HardwareProfile("h100", 2.0, 2.0)}
    assert hardware_profile("l40s", custom).token_speed == 0.4
    assert hardware_profile("h100", custom).prompt_speed == 2.0  # a cluster config's classes win


def test_unknown_class_lists_the_known_ones():
    with pytest.raises(ValueError, match="a100, cpu, h100, h100-cap.*'tpu'"):
        hardware_profile("tpu")


@pytest.mark.parametrize("field,kwargs", [("prompt_speed", {"prompt_speed": 0.0, "token_speed": 1.0}),
                                          ("token_speed", {"prompt_speed": 1.0, "token_speed": -1.0}),
                                          ("token_speed", {"prompt_speed": 1.0, "token_speed": float("nan")})])
def test_speeds_must_be_positive(field, kwargs):
    with pytest.raises(ValueError, match=field):
        HardwareProfile("x", **kwargs)
