"""Batch input files for the batch tests: completions sharing a prefix, greedy and fixed-length."""
from __future__ import annotations

import json

PREFIX = "You grade answers. Reply with one letter. " * 2


def batch_lines(n: int, max_tokens: int = 4) -> list[dict]:
    return [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "demo", "prompt": PREFIX + f"Question {i}: {i * 7919 % 1000}?",
                      "max_tokens": max_tokens if i % 5 else 4 * max_tokens, "temperature": 0, "ignore_eos": True}}
            for i in range(n)]


def as_jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def expected_texts(lines: list[dict]) -> dict[str, str]:
    """What the offline engine answers for each line (the batch must give the same)."""
    from splitserve import LLM, SamplingParams

    llm = LLM("demo")
    outs = llm.generate([line["body"]["prompt"] for line in lines],
                        [SamplingParams(max_tokens=line["body"]["max_tokens"], temperature=0, ignore_eos=True)
                         for line in lines])
    return {line["custom_id"]: out.text for line, out in zip(lines, outs)}
