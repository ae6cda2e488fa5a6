"""Running a subcommand's work as a command: a user's error is one line on stderr and exit status 2."""
from __future__ import annotations

import sys
from collections.abc import Callable


def report_errors(prog: str, run: Callable, args, errors: tuple[type[BaseException], ...]) -> int:
    try:
        run(args)
    except errors as error:
        print(f"splitserve {prog}: {error}", file=sys.stderr)
        return 2
    return 0
