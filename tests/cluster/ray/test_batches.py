"""The batch API of a real local cluster through the official `openai` client: upload, create,
poll, download; greedy results equal the offline engine's; a bad line lands in the error file."""
from __future__ import annotations

import io
import json
import time

from splitserve import SamplingParams

PROMPTS = ["Shared system prompt. " * 4 + f"Question {i}?" for i in range(6)]


def test_batch_round_trip_through_the_cluster(client, offline):
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "demo", "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}}
             for i, p in enumerate(PROMPTS)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "demo", "prompt": "x", "max_tokens": 0}})
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h",
                                  metadata={"job": "test"})
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (7, 6, 1)
    results = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    expected = offline.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    got = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in results}
    assert got == {f"q{i}": out.text for i, out in enumerate(expected)}
    error = json.loads(client.files.content(batch.error_file_id).text)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert batch.id in [b.id for b in client.batches.list(limit=10).data]
