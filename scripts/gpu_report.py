"""bench_gpu.py's result: its rows with MBU and MFU against the device's peaks, the issue's
targets met or not, and the table it prints."""
from __future__ import annotations

def report(rows: list[dict], device: str, hbm: float | None, flops: float | None, model: str, targets: bool,
           throughput_floor: float | None = None) -> dict:
    """The result: `rows` with MBU and MFU, the throughput ratio, and (for the issue's shape) its
    targets; with the throughput workload's roofline floor (seconds), each throughput row's share
    of it and the highest ratio to transformers it leaves."""
    for row in rows:
        row["device"] = device
        if "bytes_per_s" in row:
            row["mbu"] = row["bytes_per_s"] / hbm if hbm else None
        if "flops_per_s" in row:
            row["mfu"] = row["flops_per_s"] / flops if flops else None
        if row["section"] == "throughput" and "seconds" in row and throughput_floor:
            row["floor_s"], row["floor_share"] = throughput_floor, throughput_floor / row["seconds"]
    done = {r["engine"]: r for r in rows if r["section"] == "throughput" and "seconds" in r}
    ratio = (done["splitserve"]["output_tokens_per_s"] / done["transformers"]["output_tokens_per_s"]
             if {"splitserve", "transformers"} <= done.keys() else None)
    ceiling = (done["transformers"]["seconds"] / throughput_floor
               if "transformers" in done and throughput_floor else None)
    return {"device": device, "model": model, "hbm_peak_bytes_per_s": hbm, "bf16_peak_flops": flops,
            "throughput_ratio_vs_hf": ratio, "throughput_floor_s": throughput_floor,
            "throughput_ratio_ceiling_vs_hf": ceiling, "targets": met(rows, ratio) if targets else None, "rows": rows}


def met(rows: list[dict], ratio: float | None) -> dict:
    def first(section, **match):
        return next((r for r in rows if r["section"] == section and all(r.get(k) == v for k, v in match.items())),
                    {})

    mbu = {b: [r.get("mbu") for r in rows if r["section"] == "decode" and r["batch"] == b] for b in (1, 64)}
    return {"decode_mbu_batch1_ge_0.6": _all_at_least(mbu[1], 0.6), "decode_mbu_batch64_ge_0.5": _all_at_least(mbu[64], 0.5),
            "prefill_mfu_8k_ge_0.5": _all_at_least([first("prefill", context=8192).get("mfu")], 0.5),
            "throughput_ge_5x_hf": None if ratio is None else ratio >= 5,
            "transfer_visible_8k_le_0.1": _all_at_most([first("transfer", context=8192).get("visible_fraction")], 0.1)}


def _all_at_least(values: list, floor: float) -> bool | None:
    return None if not values or None in values else all(v >= floor for v in values)


def _all_at_most(values: list, ceiling: float) -> bool | None:
    return None if not values or None in values else all(v <= ceiling for v in values)


def print_table(result: dict) -> None:
    ceiling, floor = result["throughput_ratio_ceiling_vs_hf"], result["throughput_floor_s"]
    print(f"Device: {result['device']}; {result['model']}; throughput vs transformers: "
          f"{_fmt(result['throughput_ratio_vs_hf'], '.2f')}x (at most {_fmt(ceiling, '.2f')}x for any engine: "
          f"the workload's roofline floor is {_fmt(floor, '.2f')} s)")
    print("| section | engine/backend/attention | batch | context | step ms (min-max) | MBU | MFU "
          "| visible / serialized |")
    print("|---|---|---:|---:|---|---:|---:|---:|")
    for r in result["rows"]:
        if "error" in r or "skipped" in r:
            print(f"| {r['section']} | | {r.get('batch', '')} | {r.get('context', '')} | "
                  f"{r.get('skipped') or r['error'].strip().splitlines()[-1]} |")
            continue
        outside = f", {r['outside_forward_ms']:.2f} outside the forward" if "outside_forward_ms" in r else ""
        step = (f"{r['step_ms']:.2f} ({r['step_ms_min']:.2f}-{r['step_ms_max']:.2f}){outside}" if "step_ms" in r else
                f"{r['seconds']:.2f} s, {r['output_tokens_per_s']:.0f} tok/s, {_fmt(r.get('floor_share'), '.0%')} "
                "of the floor's speed" if "seconds" in r else
                f"serialized {r['serialized_transfer_ms']:.2f}, visible {r['visible_transfer_ms']:.2f}")
        what = r.get("engine") or r.get("backend") or r.get("attention", "")
        print(f"| {r['section']} | {what} | {r['batch']} | {r['context']} | {step} "
              f"| {_fmt(r.get('mbu'), '.0%')} | {_fmt(r.get('mfu'), '.0%')} | {_fmt(r.get('visible_fraction'), '.0%')} |")
    startup = {}
    for r in result["rows"]:
        if "startup_s" in r:
            startup.setdefault(r.get("engine") or r["section"], r["startup_s"])
    print("Start-up:", ", ".join(f"{name} {seconds:.1f} s" for name, seconds in startup.items()) or "-")
    if result["targets"]:
        print("Targets:", ", ".join(f"{k}: {v}" for k, v in result["targets"].items()))


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)
