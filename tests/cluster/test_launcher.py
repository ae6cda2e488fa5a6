"""`splitserve serve`'s stop: the first SIGINT or SIGTERM tears down what it started, and signals that
follow at once (a second Ctrl-C, a supervisor signalling the process group) cannot cut that short.
Ray is stood in for: deploy answers at once, the teardown takes a second."""
import signal
import subprocess
import sys
import time

import pytest

SERVER = """
import signal
import time
from splitserve.cluster import launcher

def deploy(config, host, port, address, on_sigterm=None):
    signal.signal(signal.SIGTERM, on_sigterm)  # as the real one does once Ray is up
    return "http://127.0.0.1:8000"

def teardown(joined):
    time.sleep(1)
    print("torn down", flush=True)

launcher.deploy, launcher.teardown = deploy, teardown
config = type("Config", (), {"pools": [], "model_name": "demo"})()
launcher.serve_until_interrupted(config, "127.0.0.1", 8000, None)
"""


@pytest.mark.parametrize("signals", [[signal.SIGINT, signal.SIGINT, signal.SIGTERM], [signal.SIGTERM, signal.SIGTERM]])
def test_signals_after_the_first_do_not_cut_the_teardown_short(signals):
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        while "press Ctrl-C" not in server.stdout.readline():
            assert server.poll() is None, server.stderr.read()
        server.send_signal(signals[0])
        time.sleep(0.2)  # inside the teardown
        for sig in signals[1:]:
            server.send_signal(sig)
        out, err = server.communicate(timeout=60)
    finally:
        server.kill()
    assert server.returncode == 0 and "Traceback" not in err, err
    assert out.splitlines() == ["splitserve: shutting down", *["splitserve: still shutting down"] * (len(signals) - 1),
                                "torn down"]
