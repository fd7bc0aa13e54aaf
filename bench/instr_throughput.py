"""Issue rate of single instructions on the GPU, relative to FFMA: 8 independent dependency
chains per thread of one inline-PTX operation, 32 warps per SM, timed per launch. Bounds what
an in-register weight decode can reach (bench/NOTES-moe.md).

    python bench/instr_throughput.py
"""
import torch
import triton
import triton.language as tl

OPS = {
    "FFMA": "fma.rn.f32 $0, $1, $1, $2;",
    "HFMA2": "fma.rn.f16x2 $0, $1, $1, $2;",
    "LOP3": "lop3.b32 $0, $1, $2, 0x80808080, 0xEA;",
    "PRMT": "prmt.b32 $0, $1, $2, 0x5140;",
    "F2FP e4m3x2 (low half)": "{ .reg .b16 a, b; mov.b32 {a, b}, $1; cvt.rn.f16x2.e4m3x2 $0, a; }",
    "F2FP e4m3x2 (high half)": "{ .reg .b16 a, b; mov.b32 {a, b}, $1; cvt.rn.f16x2.e4m3x2 $0, b; }",
}
CHAINS, REPS, ITERS = 8, 8, 2000


@triton.jit
def _chain(a, k, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, "=r,r,r", [a, k], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _probe_kernel(out_ptr, n_iter, ASM: tl.constexpr, REPS: tl.constexpr):
    i = tl.program_id(0) * 128 + tl.arange(0, 128)
    k = i * 7 + 3
    a0, a1, a2, a3, a4, a5, a6, a7 = i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6, i + 7
    for _ in range(n_iter):
        for _r in tl.static_range(REPS):
            a0 = _chain(a0, k, ASM)
            a1 = _chain(a1, k, ASM)
            a2 = _chain(a2, k, ASM)
            a3 = _chain(a3, k, ASM)
            a4 = _chain(a4, k, ASM)
            a5 = _chain(a5, k, ASM)
            a6 = _chain(a6, k, ASM)
            a7 = _chain(a7, k, ASM)
    tl.store(out_ptr + i, a0 ^ a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7)


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = sms * 8  # 4 warps each: 32 warps per SM
    out = torch.empty(programs * 128, dtype=torch.int32, device="cuda")
    rates = {}
    for name, asm in OPS.items():
        def launch():
            _probe_kernel[(programs,)](out, ITERS, ASM=asm, REPS=REPS, num_warps=4)
        launch()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        torch.cuda.synchronize()
        warp_instr = programs * 4 * ITERS * REPS * CHAINS
        rates[name] = warp_instr / sms / (start.elapsed_time(end) * 1e6)  # per ns per SM
        print(f"{name:26s} {rates[name]:6.2f} warp instructions / ns / SM, {rates[name] / rates['FFMA']:.2f} of FFMA",
              flush=True)


if __name__ == "__main__":
    main()
