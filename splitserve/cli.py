"""The `splitserve` command line. Subcommands arrive with the issues that build them."""
from __future__ import annotations

import argparse
import sys

from splitserve.engine.policies import POLICY_CLASSES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve", description="Disaggregated LLM serving (Splitwise) on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands)
    args = parser.parse_args(argv)
    return args.run(args)


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
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.set_defaults(run=_run_generate)


def _run_generate(args) -> int:
    from splitserve import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                                ignore_eos=args.ignore_eos)
        llm = LLM(args.model, policy=args.policy, dtype=args.dtype, device=args.device, load_format=args.load_format)
        outputs = llm.generate(args.prompt, params)
    except ValueError as error:
        print(f"splitserve generate: {error}", file=sys.stderr)
        return 2
    for out in outputs:
        print(f"{out.prompt!r} -> {out.text!r}  [{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
