"""The innermost loops of a compiled CUDA kernel, read from its SASS (disassembled by the nvdisasm
that Triton ships): each loop's instructions, per thread and iteration, counted by kind. An
attention kernel's loop is one key tile, so without a GPU this says where a tile's issue slots
go: tensor-core instructions (`mma`) against the exponentials (`mufu`), the float work of the
softmax and masks, integer and address arithmetic, conversions, memory and the rest.

A loop is a branch back to a label before it; an innermost one holds no other.
`compile_kernels.py` reports these for every variant it compiles.

A loop that copies global memory to shared memory asynchronously (Triton's software pipelining:
`LDGSTS`, each iteration's copies committed in groups by `LDGDEPBAR`) waits for them with
`DEPBAR.LE SB0, N`: until at most N groups are in flight. Its copy slack, N // the groups an
iteration commits, is how many whole iterations of work run between asking for a copy and waiting
for it: 0 when each iteration waits at once for the copies the one before asked for at its end,
so their latency is exposed every iteration.
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import triton

NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
KINDS = ("mma", "mufu", "float", "integer", "uniform", "convert", "memory", "other")
_PREFIXES = (  # first match wins
    ("other", ("SHFL", "FENCE")),
    ("mma", ("HMMA", "HGMMA", "IMMA", "QMMA", "QGMMA", "OMMA")),
    ("mufu", ("MUFU",)),
    ("convert", ("F2F", "F2I", "I2F")),
    ("memory", ("LD", "ST", "ATOM", "RED", "UTMA")),
    ("uniform", ("U",)),
    ("float", ("F", "H", "DADD", "DMUL", "DFMA")),
    ("integer", ("I", "LOP", "SHF", "SEL", "LEA", "PRMT", "PLOP", "VIADD", "MOV", "P2R", "R2P", "POPC", "FLO")),
)
_INSTRUCTION = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)[.\s;]")
_COPY_WAIT = re.compile(r"\bDEPBAR\.LE SB0, (0x[0-9a-f]+|\d+)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def kind(opcode: str) -> str:
    return next((name for name, prefixes in _PREFIXES if opcode.startswith(prefixes)), "other")


def innermost_loops(sass: str) -> list[dict[str, int | None]]:
    """Each innermost loop's instruction count ("instructions"), its counts by kind and its copy
    slack ("copy_slack"), in the order of their addresses."""
    opcodes, waits, labels, branches = [], [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(opcodes)
            continue
        found = _INSTRUCTION.search(line)
        if found:
            target = _TARGET.search(line) if found.group(1) == "BRA" else None
            if target:
                branches.append((target.group(1), len(opcodes)))
            wait = _COPY_WAIT.search(line)
            waits.append(int(wait.group(1), 0) if wait else None)
            opcodes.append(found.group(1))
    loops = sorted((labels[target], at) for target, at in branches if labels.get(target, at) < at)
    innermost = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    return [_counts(opcodes[a:b + 1], waits[a:b + 1]) for a, b in innermost]


def _counts(opcodes: list[str], waits: list[int | None]) -> dict[str, int | None]:
    """By kind, and "copy_slack": None in a loop without asynchronous copies (or waits for them)."""
    kinds = Counter(kind(op) for op in opcodes)
    groups, waited = opcodes.count("LDGDEPBAR"), [w for w in waits if w is not None]
    slack = min(waited) // groups if groups and waited else None
    return {"instructions": len(opcodes), **{name: kinds[name] for name in KINDS}, "copy_slack": slack}


def disassemble(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(NVDISASM), "-c", f.name], capture_output=True, text=True, check=True).stdout


def describe(loops: list[dict[str, int | None]]) -> str:
    """'458 (20 mma, 34 mufu, copy slack 1) / 84 (0 mma, 2 mufu)': each loop's instructions."""
    return " / ".join(f"{loop['instructions']} ({loop['mma']} mma, {loop['mufu']} mufu"
                      + ("" if loop["copy_slack"] is None else f", copy slack {loop['copy_slack']}") + ")"
                      for loop in loops)
