"""An actor class made by `frozen_heap` builds as the class did, then leaves its process's heap
frozen, the garbage its start-up left collected first (run in a process of its own: a frozen
pytest process would keep every cycle made before)."""
from __future__ import annotations

import subprocess
import sys

PROBE = '''
import gc, weakref
from splitserve.cluster.frozen_heap import frozen_heap

class Node:
    pass

class Store:
    """The store."""
    def __init__(self, n, *, k):
        self.n, self.k = n, k
        cycle = Node()
        cycle.me = cycle  # start-up garbage only the collector frees
        self.garbage = weakref.ref(cycle)

    def total(self):
        return self.n + self.k

gc.disable()  # nothing collected but by frozen_heap
assert gc.get_freeze_count() == 0
Frozen = frozen_heap(Store)
store = Frozen(1, k=2)
assert isinstance(store, Store) and store.total() == 3
assert (Frozen.__name__, Frozen.__doc__, Frozen.__module__) == ("Store", "The store.", "__main__")
assert store.garbage() is None and gc.get_freeze_count() > 1000
print("ok")
'''


def test_an_instance_builds_as_the_class_did_then_freezes_its_process():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
