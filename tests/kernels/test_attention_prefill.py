"""Prefill attention over a paged prefix against the gathered float32 reference."""
import pytest
import torch

from kernel_checks import PREFILL_MASKS, TOL, cuda_time_us, prefill_case, rel_err
from localchat.kernels.attention_prefill import paged_prefill_attention, paged_prefill_attention_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sinks,window", PREFILL_MASKS)
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32)])
def test_prefill_matches_reference(dtype, sinks, window, block_m, block_n):
    # cached prefix of 16; no prefix; a single token; a prefix of 61 (key tiles before each
    # query tile that need no causal mask, and one that does)
    args = prefill_case([37, 20, 5, 100], [21, 20, 1, 39], 2, 2, 32, 8, dtype, sinks, window)
    out = paged_prefill_attention(*args, block_m=block_m, block_n=block_n)
    assert rel_err(out, paged_prefill_attention_ref(*args)) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d,sinks,window", [(64, 8, 64, True, 128), (64, 8, 64, True, None),
                                                  (96, 8, 128, False, None)])
def test_prefill_4k_gpu(hq, hkv, d, sinks, window):
    prefix, chunk = 2048, 2048
    args = prefill_case([prefix + chunk], [chunk], hkv, hq // hkv, d, 16, torch.bfloat16, sinks, window)
    assert rel_err(paged_prefill_attention(*args), paged_prefill_attention_ref(*args)) < TOL[torch.bfloat16]
    us = cuda_time_us(lambda: paged_prefill_attention(*args), iters=3)
    keys = (prefix + chunk / 2) if window is None else min(window, prefix + chunk)
    flops = 4 * chunk * keys * hq * d
    print(f"\nprefill attention hq={hq} d={d} window={window}: {us:.0f} us, {flops / us / 1e6:.0f} TFLOP/s")


def test_prefill_tiles_by_head_size_and_shared_memory():
    from localchat.kernels.attention_prefill import prefill_tile
    hopper, ampere, ada = 232448, 166912, 101376
    assert prefill_tile(128, None, hopper) == (128, 128, 8, 2)
    # 128 keys of 128 dims in two stages need more than Ampere's or Ada's shared memory
    assert prefill_tile(128, None, ampere) == prefill_tile(128, None, ada) == (64, 64, 4, 2)
    for shared in (hopper, ampere, ada):
        assert prefill_tile(64, None, shared) == (128, 64, 8, 3)
        assert prefill_tile(64, 128, shared) == (64, 64, 4, 2)  # sliding window: a few key tiles
