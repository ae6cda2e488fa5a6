"""Running a subcommand's work as a command: a user's error is one line on stderr and exit status 2;
the options several subcommands share."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable


def report_errors(prog: str, run: Callable, args, errors: tuple[type[BaseException], ...]) -> int:
    try:
        run(args)
    except errors as error:
        print(f"splitserve {prog}: {error}", file=sys.stderr)
        return 2
    return 0


def add_lora_modules(p: argparse.ArgumentParser, where: str) -> None:
    """`--lora-modules NAME=PATH ...` (vLLM's spelling), a list of (name, path); `where`: what the
    help says they join."""
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                   help=f"LoRA adapters (PEFT directories), each served as a model of its own named NAME{where}")


def _lora_module(value: str) -> tuple[str, str]:
    name, _, path = value.partition("=")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def add_speculative_config(p: argparse.ArgumentParser, where: str) -> None:
    """`--speculative-config JSON` (vLLM's spelling, its `ngram` method): the engine fields it sets."""
    p.add_argument("--speculative-config", type=speculative_fields, default=None, metavar="JSON",
                   help='speculative decoding by n-gram prompt lookup, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\'' + where)


def speculative_fields(value: str) -> dict[str, int]:
    """The engine's num_speculative_tokens, prompt_lookup_min and prompt_lookup_max from vLLM's JSON
    (a missing bound: the engine's default, the minimum no more than the maximum given)."""
    try:
        spec = json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}") from None
    if not isinstance(spec, dict) or "num_speculative_tokens" not in spec:
        raise argparse.ArgumentTypeError("expected a JSON object with num_speculative_tokens")
    unknown = sorted(set(spec) - set(SPECULATIVE_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown keys {unknown}: it takes {', '.join(SPECULATIVE_KEYS)}")
    if spec.pop("method", "ngram") != "ngram":
        raise argparse.ArgumentTypeError("method: only ngram (prompt lookup) is served")
    if "prompt_lookup_max" in spec and "prompt_lookup_min" not in spec and isinstance(spec["prompt_lookup_max"], int):
        spec["prompt_lookup_min"] = min(2, spec["prompt_lookup_max"])
    return spec
