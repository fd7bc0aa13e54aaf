"""Planner: safetensors headers, KV bytes per token, and fit verdicts for simulated GPU sets with the
registry's sizes (which test_registry checks against the real configs)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from localchat.engine.planner import (GiB, GpuInfo, KvLayout, TensorInfo, WeightBytes, checkpoint_weight_bytes,
                                      local_gpus, plan)
from localchat.engine.registry import REGISTRY

MiB = 1 << 20


def gpu(name: str, total_mib: int, used_mib: int = 600, index: int = 0) -> GpuInfo:
    return GpuInfo(name, total_mib * MiB, (total_mib - used_mib) * MiB, index)


# Memory as the driver reports it (nvidia-smi "MiB" totals of these boards).
RTX4090 = gpu("NVIDIA GeForce RTX 4090", 24564)
H100 = gpu("NVIDIA H100 80GB HBM3", 81559)
H200 = gpu("NVIDIA H200", 143771)


def gpus(model: GpuInfo, n: int) -> list[GpuInfo]:
    return [GpuInfo(model.name, model.total_bytes, model.free_bytes, i) for i in range(n)]


def test_checkpoint_weight_bytes_follows_the_index(tmp_path):
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 4, dtype=torch.bfloat16),
               "model.norm.weight": torch.zeros(4, dtype=torch.bfloat16)}, tmp_path / "s1.safetensors")
    save_file({"lm_head.weight": torch.zeros(16, 4, dtype=torch.bfloat16)}, tmp_path / "s2.safetensors")
    save_file({"stray": torch.zeros(1000)}, tmp_path / "not-in-index.safetensors")
    index = {"weight_map": {"model.layers.0.self_attn.q_proj.weight": "s1.safetensors",
                            "model.norm.weight": "s1.safetensors", "lm_head.weight": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    w = checkpoint_weight_bytes(tmp_path)
    assert w == WeightBytes(total=64 + 8 + 128, replicated=8, fp8_numel=32, fp8_rows=8, fp8_source_bytes=64)
    (tmp_path / "s2.safetensors").unlink()
    with pytest.raises(ValueError, match="s2.safetensors"):  # the loader's CheckpointError
        checkpoint_weight_bytes(tmp_path)


def test_prequantized_checkpoints_offer_no_fp8_conversion():
    w = WeightBytes.from_tensors([TensorInfo("model.layers.0.self_attn.q_proj.weight", "BF16", (8, 4), 64),
                                  TensorInfo("model.layers.0.mlp.experts.down_proj_blocks", "U8", (2, 8, 1, 16), 256)])
    assert w.fp8_numel == 0
    with pytest.raises(ValueError, match="bf16 checkpoint"):
        w.quantized_fp8()


def test_kv_bytes_per_token():
    glm = REGISTRY["glm-4.5v"].kv
    assert glm.bytes_per_token() == 46 * 2 * 8 * 128 * 2 == 188_416
    assert glm.bytes_per_token(2) == 188_416 // 2
    assert glm.bytes_per_token(16) == 46 * 2 * 1 * 128 * 2  # more GPUs than KV heads: heads replicated
    assert glm.sliding_bytes() == 0
    oss = REGISTRY["gpt-oss-120b"].kv
    assert oss.bytes_per_token() == 18 * 2 * 8 * 64 * 2  # only the 18 full-attention layers grow
    assert oss.sliding_bytes() == 18 * 2 * 8 * 64 * 2 * 128  # the 18 sliding layers hold 128 tokens


def test_tp_splits_all_but_the_replicated_part():
    w = REGISTRY["glm-4.5v"].weights
    assert w.per_gpu(1) == w.total
    assert w.per_gpu(2) == w.replicated + (w.total - w.replicated + 1) // 2
    assert w.replicated > 1.7e9  # the vision tower stays whole on every GPU


def test_gpt_oss_120b_fits_one_80gb_gpu():
    p = REGISTRY["gpt-oss-120b"].plan([H100])
    assert p.verdict == "fits" and p.chosen.tp == 1 and p.chosen.max_context == 131072 and p.advice == []
    c = p.chosen
    budget = H100.free_bytes - (4 * GiB + int(0.05 * H100.total_bytes)) - c.weight_bytes_per_gpu - p.layout.sliding_bytes()
    assert c.kv_tokens == budget // p.layout.bytes_per_token()


def test_gpt_oss_20b_fits_a_24gb_gpu_and_120b_does_not():
    assert REGISTRY["gpt-oss-20b"].plan([RTX4090]).verdict == "fits"
    big = REGISTRY["gpt-oss-120b"].plan([RTX4090])
    assert big.verdict == "does_not_fit" and big.chosen is None
    assert "use gpt-oss-20b" in big.advice
    assert any(a.startswith("needs 4 GPUs like NVIDIA GeForce RTX 4090") for a in big.advice)


def test_glm_bf16_needs_two_h200_or_fp8():
    glm = REGISTRY["glm-4.5v"]
    one = glm.plan([H200])
    assert one.verdict == "does_not_fit"
    assert one.advice[0] == "--quantize fp8 (or use glm-4.5v-fp8)"
    two = glm.plan(gpus(H200, 2))
    assert two.verdict == "fits" and two.chosen.tp == 2 and two.advice == ["use 2 GPUs", "or --quantize fp8 on 1 GPU"]
    quantized = glm.plan([H200], quantize="fp8")
    assert quantized.verdict == "fits" and quantized.chosen.tp == 1
    assert quantized.weights.total == pytest.approx(glm.weights.total / 2, rel=0.03)  # linears halve
    assert glm.plan(gpus(H200, 8)).chosen.tp == 2  # the fewest GPUs that give the full context


def test_glm_fp8_fits_one_h200_and_needs_two_80gb():
    fp8 = REGISTRY["glm-4.5v-fp8"]
    assert fp8.plan([H200]).verdict == "fits"
    assert fp8.plan([H100]).verdict == "does_not_fit"
    p = fp8.plan(gpus(H100, 4))
    assert p.verdict == "fits" and p.chosen.tp == 2 and p.advice == ["use 2 GPUs"]


def test_gpus_before_ampere_and_fp8_before_ada_are_refused():
    # A100s hold GLM-4.5V-FP8's bytes on two GPUs but cannot compute FP8; the bf16 model's advice
    # stops offering --quantize fp8 there; an RTX 4090 (8.9) and GPUs of unknown capability run FP8
    a100 = [GpuInfo("NVIDIA A100-SXM4-80GB", 81920 * MiB, 81000 * MiB, i, (8, 0)) for i in range(4)]
    p = REGISTRY["glm-4.5v-fp8"].plan(a100)
    assert p.verdict == "unsupported" and p.chosen is None and not p.fits
    assert p.summary() == ("FP8 weights need a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
                           "NVIDIA A100-SXM4-80GB is 8.0: use a bf16 or MXFP4 model")
    assert REGISTRY["glm-4.5v"].plan(a100, quantize="fp8").verdict == "unsupported"
    bf16 = REGISTRY["glm-4.5v"].plan(a100)
    assert bf16.verdict == "fits" and bf16.chosen.tp == 4 and bf16.advice == ["use 4 GPUs"]
    assert REGISTRY["gpt-oss-120b"].plan(a100[:1]).verdict == "fits"
    ada = [GpuInfo("NVIDIA RTX 6000 Ada Generation", 49140 * MiB, 48000 * MiB, i, (8, 9)) for i in range(4)]
    assert REGISTRY["glm-4.5v-fp8"].plan(ada).verdict == "fits"
    assert REGISTRY["glm-4.5v-fp8"].plan(gpus(H200, 1)).verdict == "fits"
    v100 = [GpuInfo("Tesla V100-SXM2-32GB", 32768 * MiB, 32000 * MiB, 0, (7, 0))]
    p = REGISTRY["gpt-oss-20b"].plan(v100)
    assert p.verdict == "unsupported" and p.summary().startswith("the kernels need a GPU of compute capability 8.0")
    from localchat.engine import planner
    from localchat.kernels import gpu_facts
    assert (planner.MIN_CAPABILITY, planner.FP8_CAPABILITY) == (gpu_facts.MIN_CAPABILITY, gpu_facts.FP8_CAPABILITY)


def test_tight_memory_gives_a_shorter_context():
    fp8 = REGISTRY["glm-4.5v-fp8"]
    per_token = fp8.kv.bytes_per_token()
    tight = GpuInfo("tight", 143771 * MiB, 0)
    headroom = tight.headroom_bytes
    tight = GpuInfo("tight", tight.total_bytes, headroom + fp8.weights.total + 20_000 * per_token + 77)
    p = fp8.plan([tight])
    assert p.verdict == "fits_reduced" and p.chosen.max_context == 19 * 1024
    assert p.advice == ["--max-context 19456"]
    assert fp8.plan([tight], max_context=16384).verdict == "fits"


def test_no_gpu_and_bad_options():
    p = REGISTRY["gpt-oss-20b"].plan([])
    assert p.verdict == "no_gpu" and not p.fits and "no CUDA GPU" in p.summary()
    with pytest.raises(ValueError, match="bf16 checkpoint"):
        REGISTRY["gpt-oss-20b"].plan([H100], quantize="fp8")
    with pytest.raises(ValueError, match="only 'fp8'"):
        plan(KvLayout(1, 0, 1, 64, 4096), 10, [H100], quantize="int4")


def test_summary_reads_well():
    assert REGISTRY["glm-4.5v"].plan(gpus(H200, 2)).summary() == \
        "fits on 2 GPUs: 101.1 GiB weights per GPU, context 65536 (92 KiB KV per token per GPU); or --quantize fp8 on 1 GPU"
    assert REGISTRY["glm-4.5v"].plan([H200]).summary().startswith("does not fit (200.6 GiB of weights)")


def test_local_gpus_match_torch():
    found = local_gpus()
    if not torch.cuda.is_available():
        assert found == []
    else:
        assert len(found) == torch.cuda.device_count() and all(0 < g.free_bytes <= g.total_bytes for g in found)
