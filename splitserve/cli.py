"""The `splitserve` command line: `serve` (the cluster), `bench` (load against a server), `profile` and `sim`
(measure this engine; simulate a cluster), `generate` and `batch` (one offline engine)."""
from __future__ import annotations

import argparse
import sys
from importlib import import_module
from pathlib import Path

from splitserve.api import chat_parsers
from splitserve.command import add_lora_modules, add_speculative_config
from splitserve.engine.attention.fp8_kv import KV_CACHE_DTYPES
from splitserve.engine.policies import POLICY_CLASSES

MAX_BATCH_SIZE = 4096  # `splitserve profile --batch-sizes`: the largest batch, its engine's max_num_seqs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve", description="Disaggregated LLM serving (Splitwise) on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve(commands)
    _add_delegated(commands, "bench")
    _add_generate(commands)
    _add_profile(commands)
    _add_delegated(commands, "sim")
    _add_delegated(commands, "plan")
    _add_delegated(commands, "batch")
    args = parser.parse_args(argv)
    return args.run(args)


def _add_serve(commands) -> None:
    p = commands.add_parser("serve", help="run a splitserve cluster with the OpenAI API (default: local, demo model)",
                            description="Start (or join) a Ray cluster, deploy splitserve and serve the OpenAI API "
                                        "until Ctrl-C. No arguments: a local cluster with one prompt and one token "
                                        "worker running the built-in demo model (deploy/local-cpu.yaml).")
    p.add_argument("--config", help="a Serve config file (deploy/*.yaml) or a bare cluster config (YAML)")
    p.add_argument("--address", default=None, help="join this Ray cluster (e.g. auto, or ray://host:10001) "
                                                   "instead of starting a local one")
    p.add_argument("--host", default=None, help="HTTP host (default: the config's http_options, else 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's http_options, else 8000)")
    p.add_argument("--model", default=None, help="override the config's model (demo or a checkpoint directory)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the name(s) clients send as `model` (aliases; the first names the metrics); "
                        "default: the config's served_model_name, else the model")
    p.add_argument("--api-key", default=None, help="require this Bearer key (default: $SPLITSERVE_API_KEY, if set)")
    p.add_argument("--score-label-tokens", nargs="+", default=None, metavar="TOKEN",
                   help="serve a reranker that answers in tokens (Qwen3-Reranker: no yes): /score and /rerank "
                        "score each pair by the last token's probability; default: the config's "
                        "score_label_tokens, else by embeddings' cosine similarity")
    add_lora_modules(p, "; added to the config's engine.lora_modules")
    add_speculative_config(p, " (default: the config's engine.num_speculative_tokens, 0: off)")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="slots for N LoRA adapters, loaded at start or while serving (POST /v1/load_lora_adapter "
                        "and /v1/unload_lora_adapter); default: the config's engine.max_loras (0: off)")
    p.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                   help="with --max-loras, the largest rank an adapter may have (default: the config's, 16)")
    p.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                   help="with --max-loras, LoRA adapters held in host memory and swapped into the slots as their "
                        "requests are admitted (default: the config's engine.max_cpu_loras, else --max-loras)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None,
                   help="priority: workers serve requests by their `priority` (lower first) and preempt lower ones "
                        "for them; default: the config's engine.scheduling_policy (fcfs)")
    chat_parsers.add_arguments(p, config_fallback=True)
    p.set_defaults(run=_run_serve)


def _run_serve(args) -> int:
    from pydantic import ValidationError

    from splitserve.cluster.launcher import serve_until_interrupted
    from splitserve.config import ClusterConfig, load_cluster_config
    from splitserve.engine.lora_adapter import load_adapter
    from splitserve.engine.model_builder import load_metadata

    try:
        config, http = load_cluster_config(args.config) if args.config else (ClusterConfig(), {})
        overrides = {k: v for k, v in (("model", args.model), ("served_model_name", args.served_model_name),
                                       ("reasoning_parser", args.reasoning_parser),
                                       ("score_label_tokens", args.score_label_tokens),
                                       ("tool_call_parser", args.tool_call_parser)) if v is not None}
        if args.api_key:
            overrides["ingress"] = {**config.ingress.model_dump(), "api_key": args.api_key}
        engine = {k: v for k, v in (("max_loras", args.max_loras), ("max_lora_rank", args.max_lora_rank),
                                    ("max_cpu_loras", args.max_cpu_loras),
                                    ("scheduling_policy", args.scheduling_policy)) if v is not None}
        if args.lora_modules:
            engine["lora_modules"] = {**config.engine.lora_modules, **dict(args.lora_modules)}
        engine.update(args.speculative_config or {})
        if engine:
            overrides["engine"] = {**config.engine.model_dump(), **engine}
        config = ClusterConfig.model_validate({**config.model_dump(), **overrides})
        if args.address is None:  # a local cluster reads the model here: check it before anything starts
            model, tokenizer, _ = load_metadata(config.model, config.engine_config("token"))
            config.check_model(model)
            config.score_labels(tokenizer)
            for name, path in config.engine.lora_modules.items():
                load_adapter(name, path)
    except (OSError, ValueError, ValidationError) as error:
        print(f"splitserve serve: {error}", file=sys.stderr)
        return 2
    host = args.host or http.get("host", "127.0.0.1")
    serve_until_interrupted(config, host, args.port or http.get("port", 8000), args.address)
    return 0


def _add_generate(commands) -> None:
    p = commands.add_parser("generate", help="generate text offline with one engine (no cluster)",
                            description="Generate a completion for each --prompt with one in-process engine.")
    p.add_argument("--model", default="demo", help='"demo" (built-in, random weights) or a Hugging Face checkpoint directory')
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past EOS (forced output lengths)")
    p.add_argument("--policy", default="mixed", choices=[x for x in POLICY_CLASSES if x != "prompt"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto (the serving dtype) or fp8: K and V stored as float8 e4m3 codes, twice the tokens")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    add_speculative_config(p, " (default: off)")
    p.set_defaults(run=_run_generate)


def _run_generate(args) -> int:
    from splitserve import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                                ignore_eos=args.ignore_eos)
        llm = LLM(args.model, policy=args.policy, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                  device=args.device, load_format=args.load_format, **(args.speculative_config or {}))
        outputs = llm.generate(args.prompt, params)
    except ValueError as error:
        print(f"splitserve generate: {error}", file=sys.stderr)
        return 2
    for out in outputs:
        print(f"{out.prompt!r} -> {out.text!r}  [{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
    return 0


def _add_profile(commands) -> None:
    p = commands.add_parser("profile", help="measure the engine's prefill and decode times into a profile CSV",
                            description="Run one in-process engine through a prompt-size sweep (batch 1) and a "
                                        "batch-size sweep (at prompt 512, or the largest size below it), plus a "
                                        "chunk sweep (a prompt after a cached prefix), and write the times in the "
                                        "Splitwise profile CSV format (with a prefix_size column), for `splitserve sim`.")
    p.add_argument("--out", required=True, help="the CSV file to write (with --url: the JSON file)")
    p.add_argument("--model", default="demo", help='"demo" (built-in) or a Hugging Face checkpoint directory')
    p.add_argument("--hardware", default="cpu", help="the hardware column (a label, e.g. cpu, a100-80gb)")
    p.add_argument("--device", default="cpu", help="where the engine runs: cpu, cuda or cuda:N")
    p.add_argument("--threads", type=_positive_int, default=1, help="torch CPU threads")
    p.add_argument("--repeats", type=_positive_int, default=3, help="runs of each sweep point")
    p.add_argument("--prompt-sizes", type=_sizes, default=(32, 64, 128, 256, 512, 1024), help="comma-separated")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=(1, 2, 4, 8, 16, 32),
                   help=f"comma-separated, each at most {MAX_BATCH_SIZE}")
    p.add_argument("--token-size", type=_positive_int, default=32, help="output tokens per request (>= 2)")
    p.add_argument("--chunk-size", type=_positive_int, default=256, help="new tokens of a chunk-sweep prompt")
    p.add_argument("--chunk-contexts", type=_sizes_or_none, default=(256, 512, 1024),
                   help="cached prefixes (multiples of 16) the chunk sweep prefills after, comma-separated; "
                        "'none': no chunk sweep")
    serving = p.add_argument_group("serving overhead (--url): what a running cluster adds to its engine's times; "
                                   "writes JSON for `splitserve sim --overhead`")
    serving.add_argument("--url", help="the cluster's base URL: measure its overhead instead of profiling an engine")
    serving.add_argument("--engine-profile", type=Path, help="the cluster's engine profile (a `splitserve profile` CSV)")
    serving.add_argument("--config", help="the cluster's config (deploy/*.yaml); default: local-cpu")
    serving.add_argument("--api-key")
    serving.add_argument("--shared-host", action="store_true",
                         help="the cluster (workers and serving stack) runs on this machine: also measure its "
                              "cores and the stack's CPU per request and per token streamed, which slow the "
                              "workers under load")
    p.set_defaults(run=_run_profile)


def _sizes_or_none(text: str) -> tuple[int, ...]:
    return () if text.strip().lower() == "none" else _sizes(text)


def _positive_int(text: str) -> int:
    sizes = _sizes(text)
    if len(sizes) != 1:
        raise argparse.ArgumentTypeError(f"expected one integer >= 1, got {text!r}")
    return sizes[0]


def _batch_sizes(text: str) -> tuple[int, ...]:
    sizes = _sizes(text)
    if max(sizes) > MAX_BATCH_SIZE:
        raise argparse.ArgumentTypeError(f"each must be at most {MAX_BATCH_SIZE}, got {max(sizes)}")
    return sizes


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1 (comma-separated for a list), got {text!r}")
    return sizes


def _run_profile(args) -> int:
    try:
        _check_out(Path(args.out))
    except (ValueError, OSError) as error:
        print(f"splitserve profile: {error}", file=sys.stderr)
        return 2
    if args.url:
        return _run_serving_profile(args)
    from tqdm import tqdm

    from splitserve.sim.profile import ProfileSpec, run_profile, summary_table, write_csv

    try:
        spec = ProfileSpec(args.model, args.hardware, args.device, args.threads, args.repeats, args.prompt_sizes,
                           args.batch_sizes, args.token_size, args.chunk_size, args.chunk_contexts)
        with tqdm(total=spec.repeats * len(spec.sweep()), desc="profile", unit="point") as bar:
            result = run_profile(spec, lambda row: bar.update())
    except ValueError as error:
        print(f"splitserve profile: {error}", file=sys.stderr)
        return 2
    path = write_csv(result.rows, args.out)
    print(f"{spec.model} on {spec.hardware} ({spec.threads} thread(s)): {result.shape.num_layers} layers, "
          f"{result.shape.kv_bytes_per_token} KV bytes per token")
    print(summary_table(result.rows))
    print(f"wrote {len(result.rows)} rows to {path}")
    return 0


def _check_out(path: Path) -> None:
    """The file --out names can be written once the run ends: checked before it (a bad one lost the run)."""
    if path.is_dir():
        raise ValueError(f"--out {path} is a directory: name the file to write")
    path.parent.mkdir(parents=True, exist_ok=True)


def _run_serving_profile(args) -> int:
    import httpx
    from pydantic import ValidationError

    from splitserve.command import report_errors
    from splitserve.config import ClusterConfig, load_cluster_config
    from splitserve.sim.serving_profile import measure_serving_overhead

    def run(args) -> None:
        if args.engine_profile is None:
            raise ValueError("--url needs --engine-profile: the CSV `splitserve profile` wrote for the cluster's engine")
        config = load_cluster_config(args.config)[0] if args.config else ClusterConfig()
        overhead, num = measure_serving_overhead(args.url, config, args.engine_profile, args.prompt_sizes,
                                                 args.token_size, args.repeats, args.api_key, args.shared_host)
        path = overhead.save(args.out, num)
        shared = (f", {overhead.host_cores:g} cores shared with a serving stack of "
                  f"{overhead.request_cpu_s * 1000:.2f} ms CPU per request + "
                  f"{overhead.stream_cpu_s * 1000:.2f} ms per token" if args.shared_host else "")
        print(f"serving overhead at {args.url} over {num} requests: {overhead.request_s * 1000:.2f} ms per request, "
              f"{overhead.iteration_s * 1000:.2f} ms per iteration + {overhead.token_s * 1000:.2f} ms per token, "
              f"prefills x {overhead.prefill_scale:.2f}{shared}; wrote {path}")

    return report_errors("profile", run, args, (ValueError, OSError, RuntimeError, ValidationError, httpx.HTTPError))


DELEGATED = {  # subcommands whose arguments and run live with their package: (module, help, description)
    "bench": ("splitserve.bench.cli", "replay a trace against a server and report TTFT / TBT / E2E, SLOs, capacity",
              "Open-loop, streaming OpenAI-API load generator (also `python -m splitserve.bench`, for `ray job "
              "submit`). Writes requests.jsonl, summary.json, report.md and plots to --out."),
    "sim": ("splitserve.sim.sim_cli", "simulate a cluster config on a trace (the real schedulers, modelled time)",
            "Event-driven simulation of the cluster a config file describes, with the engine's own schedulers and "
            "the CLS's own placement, timed by performance profiles; writes the report `splitserve bench` writes."),
    "plan": ("splitserve.provision.plan_cli", "provision prompt / token machines for a design (Splitwise IV-D)",
             "Simulate the splits of a design under an iso-power, iso-cost or iso-throughput goal with the Table VI "
             "SLOs; print a table and write plan.json and a design-space heat map to --out."),
    "batch": ("splitserve.batch.cli", "run an OpenAI batch file offline (BlendServe order)",
              "Run an OpenAI Batch API input file (JSONL) on one in-process engine, ordered by BlendServe's "
              "resource-aware prefix tree and dual scanner on top of the prefix cache; results go to OUTPUT as "
              "they finish, and a rerun resumes where OUTPUT ends."),
}


def _add_delegated(commands, name: str) -> None:
    module_name, help_text, description = DELEGATED[name]
    module = import_module(module_name)
    p = commands.add_parser(name, help=help_text, description=description)
    module.add_arguments(p)
    p.set_defaults(run=module.run_command, make_runner=_make_runner)


def _make_runner(args):
    """Where a delegated command's jobs run (splitserve.jobs): here, or as Ray tasks."""
    from splitserve.cluster.task_runner import make_runner

    return make_runner(args)


if __name__ == "__main__":
    sys.exit(main())
