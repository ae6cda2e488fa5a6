"""sass_loops.py finds a kernel's innermost loops in nvdisasm's SASS and counts their instructions
by kind: on a hand-written listing (a loop nested in another, a forward branch, a branch to
itself), and on kernels that Triton's own compiler builds for sm_90 and sm_80 without a GPU, whose
loop of dots and exponentials shows its tensor-core and MUFU instructions, and whose loop without
them shows none. A loop's copy slack: on listings, and on the loop of dots compiled at 2, 3 and 4
software pipelining stages, which Triton's pipeliner runs its loads 1, 2 and 3 iterations ahead
(slack 0, 1, 2); the loop without dots copies nothing asynchronously."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.script_runner import load_script

pytest.importorskip("triton")
sass_loops = load_script("sass_loops")

KERNEL = Path(__file__).with_name("sass_loops_kernel.py")  # compiled in a process of its own (no interpreter)

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   IMAD R2, R2, 0x2, RZ ;
.L_x_0:
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0030*/                   MUFU.EX2 R5, R5 ;
        /*0040*/                   FFMA R6, R6, R7, -R8 ;
        /*0050*/                   F2FP.BF16.F32.PACK_AB R9, R6, R5 ;
        /*0060*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R10.64] ;
        /*0070*/                   UIADD3 UR4, UR4, 0x1, URZ ;
        /*0080*/               @P0 BRA `(.L_x_0) ;
        /*0090*/                   SHFL.BFLY PT, R3, R4, 0x1, 0x1f ;
        /*00a0*/              @!P1 BRA `(.L_x_1) ;
        /*00b0*/               @P2 BRA `(.L_x_2) ;
        /*00c0*/                   EXIT ;
.L_x_2:
        /*00d0*/                   BRA `(.L_x_2);
"""


def test_the_innermost_loop_of_a_listing_and_its_kinds():
    loops = sass_loops.innermost_loops(LISTING)
    assert loops == [{"instructions": 7, "mma": 1, "mufu": 1, "float": 1, "integer": 0, "uniform": 1, "convert": 1,
                      "memory": 1, "other": 1, "copy_slack": None}]  # the outer loop holds it; .L_x_2 is no loop
    assert sass_loops.describe(loops) == "7 (1 mma, 1 mufu)"
    opcodes = ("IMAD", "SHFL", "FENCE", "F2F", "I2FP", "HGMMA", "FMNMX", "LDS", "UMOV", "BAR")
    assert [sass_loops.kind(op) for op in opcodes] == \
        ["integer", "other", "other", "convert", "convert", "mma", "float", "memory", "uniform", "other"]


def _copying_loop(commits: int, wait: str) -> str:
    """A loop that commits `commits` groups of asynchronous copies an iteration and waits with `wait`."""
    copies = "".join(f"        /*00{i}0*/                   LDGDEPBAR ;\n" for i in range(2, 2 + commits))
    return (".L_x_0:\n"
            f"        /*0000*/                   {wait} ;\n"
            "        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;\n"
            f"{copies}        /*00f0*/               @P0 BRA `(.L_x_0) ;\n")


@pytest.mark.parametrize("commits, wait, slack", [
    (3, "DEPBAR.LE SB0, 0x0", 0),   # waits for every copy in flight: the ones the iteration before asked for
    (3, "DEPBAR.LE SB0, 0x3", 1),   # the last iteration's three groups may stay in flight
    (2, "DEPBAR.LE SB0, 0x5", 2),
    (1, "WARPGROUP.DEPBAR.LE gsb0, 0x0", None),  # a wait for the tensor cores, not for copies
    (0, "DEPBAR.LE SB0, 0x1", None),  # waits for copies it does not ask for
])
def test_the_copy_slack_of_a_listing(commits, wait, slack):
    [loop] = sass_loops.innermost_loops(_copying_loop(commits, wait))
    assert loop["copy_slack"] == slack and loop["mma"] == 1
    assert sass_loops.describe([loop]).endswith("1 mma, 0 mufu" + ("" if slack is None else f", copy slack {slack}") + ")")


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("softmax, stages", [(True, 2), (True, 3), (True, 4), (False, 3)])
def test_a_compiled_loop_of_dots_and_exponentials(arch, softmax, stages):
    done = subprocess.run([sys.executable, str(KERNEL), str(arch), str(int(softmax)), str(stages)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [loop] = json.loads(done.stdout)
    assert loop["instructions"] == sum(loop[k] for k in sass_loops.KINDS)
    assert loop["memory"] > 0
    assert (loop["mma"] > 0, loop["mufu"] > 0) == (softmax, softmax)
    assert loop["copy_slack"] == (stages - 2 if softmax else None)
