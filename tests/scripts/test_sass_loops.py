"""sass_loops.py finds a kernel's innermost loops in nvdisasm's SASS and counts their instructions
by kind: on a hand-written listing (a loop nested in another, a forward branch, a branch to
itself), and on kernels that Triton's own compiler builds for sm_90 and sm_80 without a GPU, whose
loop of dots and exponentials shows its tensor-core and MUFU instructions, and whose loop without
them shows none."""
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
                      "memory": 1, "other": 1}]  # the outer loop holds it; .L_x_2 branches to itself, no loop
    assert sass_loops.describe(loops) == "7 (1 mma, 1 mufu)"
    opcodes = ("IMAD", "SHFL", "FENCE", "F2F", "I2FP", "HGMMA", "FMNMX", "LDS", "UMOV", "BAR")
    assert [sass_loops.kind(op) for op in opcodes] == \
        ["integer", "other", "other", "convert", "convert", "mma", "float", "memory", "uniform", "other"]


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("softmax", [True, False])
def test_a_compiled_loop_of_dots_and_exponentials(arch, softmax):
    done = subprocess.run([sys.executable, str(KERNEL), str(arch), str(int(softmax))], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [loop] = json.loads(done.stdout)
    assert loop["instructions"] == sum(loop[k] for k in loop if k != "instructions")
    assert loop["memory"] > 0
    assert (loop["mma"] > 0, loop["mufu"] > 0) == (softmax, softmax)
