"""`python -m splitserve.bench`: the benchmark as a plain module, for `ray job submit -- python -m splitserve.bench ...`."""
import sys

from splitserve.bench.cli import main

sys.exit(main())
