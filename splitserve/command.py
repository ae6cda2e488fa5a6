"""Running a subcommand's work as a command: a user's error is one line on stderr and exit status 2;
the options several subcommands share."""
from __future__ import annotations

import argparse
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
