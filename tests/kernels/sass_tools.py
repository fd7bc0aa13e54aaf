"""Compiling a Triton kernel for a GPU without one, and reading what the compiler made of it:
registers, SASS, the innermost loop's instructions (for tests/kernels/hopper_compile.py and the
bench scripts that count instructions)."""
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)


def _types(overrides: dict[str, str]):
    """Argument types by name: the overrides, else i32 (strides, sizes)."""
    return lambda name: overrides.get(name, "i32")


def compile_kernel(fn, types, constexprs: dict, num_warps: int = 4, num_stages: int = 1, divisible: bool = False,
                   max_registers: int = 0, target: GPUTarget = HOPPER):
    """The compiled kernel (sm_90 unless target says otherwise). divisible: pointers, strides, the
    sizes N and K and a K split's length (K_SPLIT) marked 16-divisible, as the launcher specialises
    them at run time for the real shapes (what the SASS then shows). max_registers: the launch's
    maxnreg (0: none)."""
    names = fn.arg_names
    # as a launch leaves them: constexpr parameters at their defaults, and descriptor arguments the
    # case does not type at the pointer-load form's None
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty}
    descs = {n: None for n in names if n.endswith("_desc") and not types(n).startswith("tensordesc")}
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in defaults and p.name not in constexprs]
    assert not missing, f"constexpr parameters without a value in the case: {missing}"
    constexprs = {**defaults, **descs, **constexprs}
    signature = {n: "constexpr" if n in constexprs else types(n) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if divisible and n not in constexprs and (n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K", "K_SPLIT"))}
    src = ASTSource(fn, signature, {(names.index(k),): v for k, v in constexprs.items()}, attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if max_registers:
        options["maxnreg"] = max_registers
    kernel = triton.compile(src, target=target, options=options)
    assert len(kernel.asm.get("cubin", b"")) > 0, "no cubin"
    return kernel



CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _cuobjdump(kernel, option: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([CUOBJDUMP, option, f.name], capture_output=True, text=True, check=True).stdout


def disassemble(kernel) -> str:
    """The SASS of a compiled kernel (Triton's bundled cuobjdump)."""
    return _cuobjdump(kernel, "-sass")


def registers(kernel) -> int:
    """Registers a thread of a compiled kernel holds (cuobjdump's resource usage)."""
    return int(re.search(r"REG:(\d+)", _cuobjdump(kernel, "-res-usage")).group(1))


def sass(fn, types, constexprs: dict, num_warps: int, num_stages: int) -> str:
    """SASS of one specialization; pointers and strides marked 16-divisible, as at run time."""
    return disassemble(compile_kernel(fn, types, constexprs, num_warps, num_stages, divisible=True))


def main_loop(text: str) -> list[str]:
    """The instructions of the longest innermost loop: a branch back to a lower address with no
    other such branch between the two (the spans that barrier-wait retries and peeled stages
    make across loops are left out)."""
    instrs = [(int(m.group(1), 16), m.group(2)) for m in
              re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;", text)]
    back = []  # (target, source) of each backward branch
    for addr, ins in instrs:
        m = re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            back.append((int(m.group(1), 16), addr))
    best: list[str] = []
    for lo, hi in back:
        if any(lo < src < hi for _, src in back):
            continue
        body = [i for a, i in instrs if lo <= a <= hi]
        best = max(best, body, key=len)
    return best


def _operands(ins: str) -> tuple[str, str, list[str]]:
    """(full opcode, destination, sources) of one SASS instruction, predicate left out."""
    parts = ins.replace(",", " ").split()
    parts = parts[1:] if parts[0].startswith("@") else parts
    return parts[0], (parts[1] if len(parts) > 1 else ""), parts[2:]


def opcode(ins: str) -> str:
    return _operands(ins)[0].split(".")[0]


def loads_waited_in_trip(loop: list[str]) -> int:
    """How many global loads of a loop body have their result read before the trip ends (the
    warp then waits for them in the trip that issued them); a vector load's later registers count."""
    waited = 0
    for i, ins in enumerate(loop):
        if opcode(ins) != "LDG":
            continue
        op, dst, _ = _operands(ins)
        m = re.fullmatch(r"R(\d+)", dst)
        width = 4 if op.endswith(".128") else 2 if op.endswith(".64") else 1  # LDG.E.128: 4 registers
        regs = {f"R{int(m.group(1)) + r}" for r in range(width)} if m else {dst}
        for later in loop[i + 1:]:
            later_op, ldst, srcs = _operands(later)
            reads = srcs + ([ldst] if later_op.split(".")[0] in ("STS", "STG", "ST", "STL") else [])
            if any(src.split(".")[0].lstrip("-|") in regs for src in reads):
                waited += 1
                break
    return waited
