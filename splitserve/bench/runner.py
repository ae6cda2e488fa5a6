"""One benchmark run against a server: calibrate (unloaded latencies, for Table VI slowdowns),
replay the workload with a progress bar, summarize; and the capacity search over rates."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from splitserve.bench.client import ServerInfo, fetch_server_info, fresh_prompt_seed, replay, send
from splitserve.bench.report import RequestRecord, summarize
from splitserve.bench.slo import Baseline, SLOSpec
from splitserve.bench.workload import RequestSpec, WorkloadSpec, make_workload

CALIBRATION_OUTPUT_TOKENS = 16
CALIBRATION_POINTS = (0, 25, 50, 90, 100)  # percentiles of the workload's prompt lengths
CALIBRATION_INDEX = 1_000_000  # probe indices (their prompt ids), apart from the workload's


@dataclass(frozen=True)
class Target:
    """A running cluster to replay workloads against. Each replay through one target sends prompts
    no earlier one sent (`fresh_prompt_seed`, the first its workload's own), so none is served from
    the prefix cache an earlier replay of the same workload filled."""

    url: str
    model: str | None = None
    api_key: str | None = None
    replays: Iterator[int] = field(default_factory=itertools.count, compare=False, repr=False)


def fit_to_context(requests: list[RequestSpec], max_model_len: int | None) -> list[RequestSpec]:
    """Shorten prompts (then outputs) that would not fit the server's context window."""
    if max_model_len is None:
        return requests
    fitted = []
    for r in requests:
        output = min(r.output_tokens, max_model_len - 1)
        prompt = max(1, min(r.prompt_tokens, max_model_len - output))
        fitted.append(dataclasses.replace(r, prompt_tokens=prompt, output_tokens=output))
    return fitted


async def calibrate(target: Target, info: ServerInfo, requests: list[RequestSpec], seed: int,
                    repeats: int = 2) -> Baseline:
    """Unloaded latencies: requests one at a time at a few prompt lengths of the workload."""
    import httpx

    lengths = sorted({int(np.percentile([r.prompt_tokens for r in requests], q)) for q in CALIBRATION_POINTS})
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(timeout=600, headers=headers) as http:
        for i, length in enumerate(lengths * repeats):
            probe = RequestSpec(index=CALIBRATION_INDEX + i, arrival_s=0.0, prompt_tokens=length,
                                output_tokens=CALIBRATION_OUTPUT_TOKENS)
            record = await send(http, target.url, info.model, probe, seed, 0.0)
            if record.error is None:
                records.append(record)
    if not records:
        raise RuntimeError(f"calibration failed: no request to {target.url} succeeded")
    return Baseline.from_records(records)


async def run_once(target: Target, workload: WorkloadSpec, slo: SLOSpec | None, baseline: Baseline | None,
                   progress: bool = True, label: str = "requests") -> tuple[list[RequestRecord], dict]:
    """Replay `workload` against `target` (prompts of this replay's own): its records and their summary."""
    info = await fetch_server_info(target.url, target.model, target.api_key)
    requests = fit_to_context(make_workload(workload), info.max_model_len)
    with tqdm(total=len(requests), desc=label, unit="req", disable=not progress, leave=False) as bar:
        seed = fresh_prompt_seed(workload.seed, next(target.replays))
        records, duration = await replay(target.url, requests, info.model, seed, target.api_key,
                                         on_done=lambda _: bar.update())
    return records, summarize(records, duration, slo, baseline)


async def measure_baseline(target: Target, workload: WorkloadSpec) -> Baseline:
    info = await fetch_server_info(target.url, target.model, target.api_key)
    requests = fit_to_context(make_workload(workload), info.max_model_len)
    return await calibrate(target, info, requests, workload.seed)


def run_at_rate(target: Target, workload: WorkloadSpec, slo: SLOSpec | None, baseline: Baseline | None,
                progress: bool = True):
    """A callable rate -> summary (for the capacity search): the same workload at another rate."""
    def run(rate: float) -> dict:
        at_rate = dataclasses.replace(workload, rate=rate)
        _, summary = asyncio.run(run_once(target, at_rate, slo, baseline, progress, f"rate {rate:.2f}"))
        return {**summary, "rate": rate}
    return run
