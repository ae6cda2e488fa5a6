"""bench_gpu.py's throughput sections (its docstring defines their rows): ours (`LLM.generate`)
and `transformers` `generate` on the same prompts, each in a process of its own."""
from __future__ import annotations

import random
import statistics
import time

import torch

from gpu_step_sections import random_prompt, started  # this script's folder


def throughput_prompts(s: dict) -> list[list[int]]:
    rng = random.Random(2)
    return [random_prompt(rng, s["config"], s["prompt"]) for _ in range(s["in_flight"])]


def ours_section(model: str, s: dict, args) -> list[dict]:
    from splitserve import LLM, SamplingParams

    llm, startup = started(lambda: LLM(model, load_format="dummy", enable_prefix_caching=False,
                                       max_num_seqs=s["in_flight"], max_model_len=s["prompt"] + s["output"] + 16,
                                       **s["engine"]))
    prompts, rows = throughput_prompts(s), []
    for engine, params in (("splitserve", SamplingParams(temperature=0, max_tokens=s["output"], ignore_eos=True)),
                           ("splitserve sampled", SamplingParams(temperature=0.8, top_p=0.9, max_tokens=s["output"],
                                                                 ignore_eos=True))):
        llm.generate(prompts, params)  # warm-up: the same work
        rows.append({**_throughput_row(engine, lambda: llm.generate(prompts, params), s, args.repeats),
                     "startup_s": startup})
    return rows


def hf_section(model: str, s: dict, args) -> list[dict]:
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, s["engine"]["dtype"])
    device = torch.device(s["engine"]["device"])

    def build():
        config = AutoConfig.from_pretrained(model)
        if hasattr(config, "quantization_config"):  # MXFP4 experts: transformers' own dequantized (bf16) ones
            del config.quantization_config
        with device:
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()

    hf, startup = started(build)
    ids = torch.tensor(throughput_prompts(s), device=device)

    def run(new_tokens: int):
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    run(s["output"])  # warm-up: the same work (its cache grown to full length once, the allocator warm)
    return [{**_throughput_row("transformers", lambda: run(s["output"]), s, args.repeats), "startup_s": startup}]


def _throughput_row(engine: str, run, s: dict, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    tokens = s["in_flight"] * s["output"]
    return {"section": "throughput", "engine": engine, "batch": s["in_flight"], "context": s["prompt"],
            "output_tokens": tokens, "seconds": statistics.median(times), "seconds_min": min(times),
            "seconds_max": max(times), "output_tokens_per_s": tokens / statistics.median(times)}
