"""Compiles a small loop for an architecture with Triton's own compiler (no GPU) and prints its
innermost loops as sass_loops.py counts them, as JSON: `python sass_loops_kernel.py ARCH SOFTMAX STAGES`
(STAGES: Triton's software pipelining stages).
A process of its own: the tests' process runs Triton as the interpreter, which compiles nothing."""
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # read when triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from script_runner import load_script  # noqa: E402  (this file's folder)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sass_loops = load_script("sass_loops")


@triton.jit
def attend(q_ptr, k_ptr, out_ptr, n_tiles, SOFTMAX: tl.constexpr):
    """With SOFTMAX, a loop of dots and exponentials; without, of loads, multiplies and adds."""
    rows, cols = tl.arange(0, 64), tl.arange(0, 64)
    q = tl.load(q_ptr + rows[:, None] * 64 + cols[None, :])
    acc = tl.zeros([64, 64], tl.float32)
    for tile in range(n_tiles):
        k = tl.load(k_ptr + tile * 4096 + rows[:, None] * 64 + cols[None, :])
        if SOFTMAX:
            acc += tl.math.exp2(tl.dot(q, tl.trans(k)))
        else:
            acc += k.to(tl.float32) * 3
    tl.store(out_ptr + rows[:, None] * 64 + cols[None, :], acc)


if __name__ == "__main__":
    arch, softmax, stages = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
    signature = {"q_ptr": "*bf16", "k_ptr": "*bf16", "out_ptr": "*fp32", "n_tiles": "i32", "SOFTMAX": "constexpr"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(3)}  # the pointers, as torch allocates them
    kernel = triton.compile(ASTSource(attend, signature, constexprs={"SOFTMAX": softmax}, attrs=aligned),
                            target=GPUTarget("cuda", arch, 32), options={"num_stages": stages})
    print(json.dumps(sass_loops.innermost_loops(sass_loops.disassemble(kernel.asm["cubin"]))))
