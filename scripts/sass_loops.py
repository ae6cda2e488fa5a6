"""The innermost loops of a compiled CUDA kernel, read from its SASS (disassembled by the nvdisasm
that Triton ships): each loop's instructions, per thread and iteration, counted by kind. An
attention kernel's loop is one key tile, so without a GPU this says where a tile's issue slots
go: tensor-core instructions (`mma`) against the exponentials (`mufu`), the float work of the
softmax and masks, integer and address arithmetic, conversions, memory and the rest.

A loop is a branch back to a label before it; an innermost one holds no other.
`compile_kernels.py` reports these for every variant it compiles.
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
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def kind(opcode: str) -> str:
    return next((name for name, prefixes in _PREFIXES if opcode.startswith(prefixes)), "other")


def innermost_loops(sass: str) -> list[dict[str, int]]:
    """Each innermost loop's instruction count ("instructions") and its counts by kind, in the
    order of their addresses."""
    opcodes, labels, branches = [], {}, []
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
            opcodes.append(found.group(1))
    loops = sorted((labels[target], at) for target, at in branches if labels.get(target, at) < at)
    innermost = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    return [_counts(opcodes[a:b + 1]) for a, b in innermost]


def _counts(opcodes: list[str]) -> dict[str, int]:
    kinds = Counter(kind(op) for op in opcodes)
    return {"instructions": len(opcodes), **{name: kinds[name] for name in KINDS}}


def disassemble(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(NVDISASM), "-c", f.name], capture_output=True, text=True, check=True).stdout


def describe(loops: list[dict[str, int]]) -> str:
    """'458 (20 mma, 34 mufu) / 752 (20 mma, 34 mufu)': each loop's instructions."""
    return " / ".join(f"{loop['instructions']} ({loop['mma']} mma, {loop['mufu']} mufu)" for loop in loops)
