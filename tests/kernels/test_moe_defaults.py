"""What default_config picks for each format, size and GPU generation, and the GPU facts it reads."""
import pytest
import torch

from kernel_checks import DEV, random_gpt_oss_experts, rel_err, with_aligned_scale_rows
from localchat.kernels.moe import fused_moe, fused_moe_ref
from localchat.kernels.moe_routing import route_gpt_oss

TOL_BF16 = 2e-2


def test_glm_fp8_decode_defaults():
    # GLM-4.5V (128 routed experts + its shared expert folded in as the 129th, 8 + 1 pairs a token):
    # one token sums its rows in the down kernel, from two tokens 64-row programs and the combine
    from localchat.kernels.moe import FMT_FP8_BLK, FMT_FP8_ROW, default_config
    for fmt in (FMT_FP8_ROW, FMT_FP8_BLK):
        one = default_config(9, 129, fmt, on_gpu=True)
        assert one.gemv and one.fused_combine and (one.block_n, one.down_tile) == (16, (32, 256, 4, 2))
        for t in (2, 3, 8, 14):
            cfg = default_config(9 * t, 129, fmt, on_gpu=True)
            assert cfg.gemv and not cfg.fused_combine and cfg.block_n == 64 and cfg.down_tile is None
        assert not default_config(9 * 16, 129, fmt, on_gpu=True).gemv  # above one pair per expert: tiles


def test_glm_fp8_prefill_tiles_take_e4m3_activations_from_8_pairs_per_expert():
    # FP8 x FP8 dots where the GPU has FP8 tensor cores (Ada, Hopper, Blackwell), from 8 pairs
    # an expert; the MXFP4 and bf16 experts never
    from localchat.kernels.gpu_facts import GpuArch
    from localchat.kernels.moe import FMT_DENSE, FMT_FP8_BLK, FMT_FP8_ROW, FMT_MXFP4, default_config
    hopper, ada, ampere = GpuArch((9, 0), 232448), GpuArch((8, 9), 101376), GpuArch((8, 0), 166912)
    for fmt in (FMT_FP8_ROW, FMT_FP8_BLK):
        for arch in (hopper, ada):
            assert not default_config(8 * 127, 128, fmt, on_gpu=True, arch=arch).fp8_act  # 7.9 an expert
            for t in (128, 256, 1024, 8192):
                cfg = default_config(8 * t, 128, fmt, on_gpu=True, arch=arch)
                assert cfg.fp8_act and not cfg.gemv
        assert not default_config(8 * 1024, 128, fmt, on_gpu=True, arch=ampere).fp8_act
        assert not default_config(8 * 1024, 128, fmt, on_gpu=False, arch=hopper).fp8_act
    for fmt in (FMT_MXFP4, FMT_DENSE):
        assert not default_config(8 * 1024, 128, fmt, on_gpu=True, arch=hopper).fp8_act


def test_glm_fp8_channel_prefill_tiles_turn_pairs_major_on_wgmma_gpus():
    # above 48 pairs an expert, channel scales on Hopper: 128 pairs by 128 rows, down 128 by 256,
    # four stages, within the shared memory a program gets (192 KiB of operands each); block
    # scales, Ada and fewer pairs keep the weight-major tiles
    from localchat.kernels.gpu_facts import GpuArch
    from localchat.kernels.moe import FMT_FP8_BLK, FMT_FP8_ROW, default_config
    hopper, ada = GpuArch((9, 0), 232448), GpuArch((8, 9), 101376)
    for t in (689, 1024, 2048, 8192):
        cfg = default_config(9 * t, 129, FMT_FP8_ROW, on_gpu=True, arch=hopper)
        assert cfg.pairs_major and cfg.fp8_act
        assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) == (128, 128, 128, 8, 4)
        assert cfg.down_tile == (256, 128, 8, 4)
        for other in (default_config(9 * t, 129, FMT_FP8_BLK, on_gpu=True, arch=hopper),
                      default_config(9 * t, 129, FMT_FP8_ROW, on_gpu=True, arch=ada)):
            assert not other.pairs_major and other.down_tile is None and other.block_m == 64
    assert not default_config(9 * 688, 129, FMT_FP8_ROW, on_gpu=True, arch=hopper).pairs_major


def test_gpt_oss_decode_defaults_load_wide_activations_at_one_token():
    # gpt-oss (4 pairs a token): 16-byte activation loads in gate/up only for one token's pairs
    from localchat.kernels.moe import FMT_MXFP4, default_config
    for experts in (32, 128):
        one = default_config(4, experts, FMT_MXFP4, on_gpu=True)
        assert one.mx_half2 and one.wide_x and one.num_stages == 3
        for t in (2, 8):
            cfg = default_config(4 * t, experts, FMT_MXFP4, on_gpu=True)
            assert not cfg.wide_x


def test_gpt_oss_decode_defaults_take_tma_from_four_tokens():
    # with 16-byte aligned stacks the packed-f16 kernels read through the TMA engine from 16 pairs
    # (4 tokens) to 1.5 pairs per expert, 32 rows a program on two warps; two pairs of an expert
    # a program from 3/8 of a pair per expert and 32 pairs; never without alignment
    from localchat.kernels.moe import FMT_MXFP4, default_config
    for t in (1, 2):
        assert not default_config(4 * t, 128, FMT_MXFP4, on_gpu=True, tma=True).tma
    for experts, t, pairs in ((128, 4, 1), (128, 8, 1), (128, 12, 2), (128, 16, 2), (128, 32, 2), (128, 48, 2),
                              (32, 4, 1), (32, 8, 2), (32, 12, 2)):
        cfg = default_config(4 * t, experts, FMT_MXFP4, on_gpu=True, tma=True)
        assert cfg.mx_half2 and cfg.tma and cfg.tma_down and cfg.block_k == 512 and cfg.tail_k == 0
        assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.down_tile) == (pairs, 32, 2, (32, 512, 2, 3))
        # the down kernel held to 160 registers a thread from 12 tokens (48 pairs)
        assert cfg.down_max_registers == (160 if 4 * t >= 48 else 0)
        assert not default_config(4 * t, experts, FMT_MXFP4, on_gpu=True).tma
    # above 1.5 pairs per expert the tensor-core tiles; without alignment from one pair per expert
    assert default_config(4 * 64, 128, FMT_MXFP4, on_gpu=True, tma=True).mx_mma
    assert default_config(4 * 16, 32, FMT_MXFP4, on_gpu=True, tma=True).mx_mma
    assert default_config(4 * 12, 32, FMT_MXFP4, on_gpu=True).mx_mma


def test_loaded_mxfp4_stacks_have_aligned_scale_rows():
    # what the loader, the dummy weights and the parallel slicing hand the MoE: scale rows on
    # 16-byte boundaries (so fused_moe's default may take the TMA kernels), values unchanged
    from localchat.engine.parallel.slicing import Slice, slice_value
    from localchat.engine.weights.dummy import _mxfp4
    w = _mxfp4((4, 64, 2880), 0.02, DEV, torch.Generator(device=DEV))
    assert w.scales.shape == (4, 64, 90) and w.scales.stride(-2) == 96
    for s in (Slice(dim=0, start=1, end=3), Slice(dim=2, start=0, end=1440)):
        part = slice_value("experts.down", w, s)
        assert part.scales.stride(-2) % 16 == 0 and part.scales.data_ptr() % 16 == 0
    half = slice_value("experts.down", w, Slice(dim=2, start=1440, end=2880))
    assert torch.equal(half.dequantize(), w.dequantize()[..., 1440:])


def test_defaults_keep_to_what_each_gpu_generation_has():
    # Ada: no TMA (the pointer-fed packed-f16 kernels), the tensor-core tiles beyond one pair per
    # expert; Ampere: no e4m3 conversions (the word-decode kernels); consumer Blackwell as Hopper
    from localchat.kernels.gpu_facts import GpuArch
    from localchat.kernels.moe import FMT_DENSE, FMT_FP8_ROW, FMT_MXFP4, default_config
    ada, ampere, blackwell = GpuArch((8, 9), 101376), GpuArch((8, 0), 166912), GpuArch((12, 0), 101376)
    for t in (1, 4, 32):
        cfg = default_config(4 * t, 128, FMT_MXFP4, on_gpu=True, tma=True, arch=ada)
        assert cfg.mx_half2 and not (cfg.tma or cfg.tma_down)
        old = default_config(4 * t, 128, FMT_MXFP4, on_gpu=True, tma=True, arch=ampere)
        assert old.mx_words and not old.mx_half2 and not old.tma
        assert default_config(4 * t, 128, FMT_MXFP4, on_gpu=True, tma=True, arch=blackwell) == \
            default_config(4 * t, 128, FMT_MXFP4, on_gpu=True, tma=True)
    for arch in (ada, ampere):
        assert default_config(4 * 64, 128, FMT_MXFP4, on_gpu=True, tma=True, arch=arch).mx_mma
    # prefill tiles within 99 KiB a program: FP8 at 8192 pairs keeps its 3 stages (2 buffered, 80
    # KiB: its activations are e4m3 whatever the input's dtype); bf16 weights with fp32
    # activations (160 KiB for 2 buffered) drop to 2; an H200 holds the pairs-major FP8 tiles'
    # 4 stages (192 KiB)
    assert default_config(8192, 128, FMT_FP8_ROW, True, 2, arch=ada).num_stages == 3
    assert default_config(8192, 128, FMT_FP8_ROW, True, 4, arch=ada).num_stages == 3
    assert default_config(8192, 128, FMT_FP8_ROW, True, 4).num_stages == 4
    assert default_config(8192, 128, FMT_DENSE, True, 2, arch=ada).num_stages == 3
    assert default_config(8192, 128, FMT_DENSE, True, 4, arch=ada).num_stages == 2


def test_fp8_weights_refused_before_ada(monkeypatch):
    # on a GPU without e4m3, loading FP8 weights says so instead of the kernels failing to compile; before Ampere
    # the engine refuses every model
    from localchat.engine.runtime import loading
    from localchat.kernels import gpu_facts
    monkeypatch.setattr(gpu_facts, "compiled_on_gpu", lambda device: True)
    monkeypatch.setattr(gpu_facts, "_cuda_arch", lambda index: gpu_facts.GpuArch((8, 0), 166912))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer .* NVIDIA A100-SXM4-80GB is 8.0"):
        gpu_facts.require_fp8(torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"\(GPU 1\); use a bf16 or MXFP4 model"):
        loading.require_gpus([1], fp8=True)
    loading.require_gpus([1], fp8=False)  # bf16 and MXFP4 run from Ampere
    monkeypatch.setattr(gpu_facts, "_cuda_arch", lambda index: gpu_facts.GpuArch((7, 0), 98304))
    with pytest.raises(ValueError, match=r"compute capability 8.0 or newer .* is 7.0"):
        loading.require_gpus([0], fp8=False)
    monkeypatch.setattr(gpu_facts, "_cuda_arch", lambda index: gpu_facts.GpuArch((8, 9), 101376))
    gpu_facts.require_fp8(torch.device("cuda", 0))
    monkeypatch.setattr(torch.version, "hip", "6.4")
    with pytest.raises(ValueError, match="written for NVIDIA GPUs .* AMD GPUs"):
        loading.require_gpus([0], fp8=False)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", [(8, 0), (8, 9), (12, 0)])
def test_gpt_oss_defaults_of_other_gpu_generations_gpu(arch, monkeypatch):
    # what default_config gives an A100 / RTX 40 / RTX 50 (word-decode kernels; pointer-fed
    # packed-f16 kernels and the float32-decode tensor-core tiles; as Hopper), run here
    from localchat.kernels import moe as moe_launchers
    from localchat.kernels.gpu_facts import GpuArch
    monkeypatch.setattr(moe_launchers, "gpu_arch", lambda device: GpuArch(arch, 101376))
    e, k, h, i = 128, 4, 2880, 2880
    experts = with_aligned_scale_rows(random_gpt_oss_experts(e, i, h, bias_dtype=torch.bfloat16, device="cuda"))
    for t in (1, 4, 32, 64):
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        w, ids = route_gpt_oss(torch.randn(t, e, device="cuda"), k)
        err = rel_err(fused_moe(x, experts, w, ids), fused_moe_ref(x, experts, w, ids))
        print(f"\ngpt-oss-120b as sm_{arch[0]}{arch[1]}, T={t}: rel err {err:.1e}")
        assert err < TOL_BF16


def test_gpu_arch_falls_back_to_the_documented_shared_memory(monkeypatch):
    # a Triton that cannot be asked for the opt-in shared memory: the figure for the capability
    from types import SimpleNamespace

    import triton

    from localchat.kernels import gpu_facts

    class NoQuery:
        def get_device_properties(self, index):
            raise RuntimeError("no such query")

    monkeypatch.setattr(type(triton.runtime.driver), "active", property(lambda self: SimpleNamespace(utils=NoQuery())))
    for capability, shared in (((9, 0), 232448), ((8, 0), 166912), ((8, 9), 101376), ((12, 0), 101376)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        assert gpu_facts._cuda_arch.__wrapped__(0) == gpu_facts.GpuArch(capability, shared)
