"""Short-chunk prefill attention (query heads packed into a tile's rows, keys split over programs)
against the gathered float32 reference of the paged prefill."""
import pytest
import torch

from kernel_checks import PREFILL_MASKS, TOL, cuda_time_us, prefill_case, rel_err
from localchat.kernels.attention_prefill import paged_prefill_attention, paged_prefill_attention_ref
from localchat.kernels.attention_short import short_prefill_attention, short_prefill_attention_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sinks,window", PREFILL_MASKS)
@pytest.mark.parametrize("num_splits,block_m,split_keys", [(1, 16, 0), (3, 16, 0), (4, 32, 0), (4, 16, 32)])
def test_short_prefill_matches_reference(dtype, sinks, window, num_splits, block_m, split_keys):
    # chunks of 3, 1, 6 and 5 queries after prefixes of 34, 19, 0 and 125 keys (pages of 8, 4 heads
    # a KV head, a chunk's rows spanning two row tiles of 16, splits with no key at all); with
    # split_keys 32 the row tiles take 1 to 4 splits by their key count, some finishing their rows
    args = prefill_case([37, 20, 6, 130], [3, 1, 6, 5], 2, 4, 32, 8, dtype, sinks, window)
    out = short_prefill_attention(*args, num_splits=num_splits, split_keys=split_keys, block_m=block_m,
                                  block_n=16)
    assert rel_err(out, short_prefill_attention_ref(*args)) < TOL[dtype]


@pytest.mark.parametrize("programs", [1, 5, None])
@pytest.mark.parametrize("sinks,window", [(True, None), (False, 12)])
def test_short_prefill_mixed_batch(sinks, window, programs):
    # a mixed step as the engine holds it: chunks, decoding sequences of one query and sequences of
    # none (a captured graph's unused slots) in one batch, the work items of all of them taken
    # by one, five or every program in turn, each tile split by its own keys
    ctx_lens, q_lens = [40, 9, 1, 70, 3, 1, 33], [1, 9, 0, 4, 1, 0, 1]
    args = prefill_case(ctx_lens, q_lens, 2, 3, 32, 8, torch.float32, sinks, window)
    out = short_prefill_attention(*args, num_splits=4, split_keys=16, block_m=16, block_n=16, programs=programs)
    assert rel_err(out, short_prefill_attention_ref(*args)) < TOL[torch.float32]


@pytest.mark.parametrize("programs,even", [(2, True), (9, True), (12, True), (40, True), (200, True), (9, False)])
def test_short_prefill_parts_follow_the_batch(programs, even):
    # six row tiles a KV head over 673 tile-keys, split_keys 16, up to 8 parts: with 200 programs
    # parts of 16 keys (8, 3, 1, 8 and 6 parts: the cap, then by keys); with fewer the parts
    # lengthen to the tile-keys over the programs left once each tile has one (40: parts of 20,
    # 12: 113, 9: 225), down to one part a tile, each finishing its own rows (2); not evened, parts
    # of 16 keys whatever the programs
    ctx_lens, q_lens = [300, 41, 1, 200, 90], [1, 9, 1, 2, 1]
    args = prefill_case(ctx_lens, q_lens, 2, 3, 32, 8, torch.float32, True, None)
    out = short_prefill_attention(*args, num_splits=8, split_keys=16, block_m=16, block_n=16, programs=programs,
                                  balanced_parts=even)
    assert rel_err(out, short_prefill_attention_ref(*args)) < TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d,sinks", [(64, 8, 64, True), (96, 8, 128, False)])
@pytest.mark.parametrize("chunk,prefix", [(1, 8192), (16, 8192), (20, 30720), (64, 8192)])
def test_short_prefill_gpu(hq, hkv, d, sinks, chunk, prefix):
    args = prefill_case([prefix + chunk], [chunk], hkv, hq // hkv, d, 16, torch.bfloat16, sinks, None)
    ref = short_prefill_attention_ref(*args)
    assert rel_err(short_prefill_attention(*args), ref) < TOL[torch.bfloat16]
    splits = {n: cuda_time_us(lambda n=n: short_prefill_attention(*args, num_splits=n), iters=10)
              for n in (4, 8, 16, 32)}
    paged = cuda_time_us(lambda: paged_prefill_attention(*args), iters=10)
    best = min(splits, key=splits.get)
    print(f"\nshort prefill hq={hq} d={d}, {chunk} queries after {prefix} keys: paged kernel {paged:.0f} us, "
          f"packed {', '.join(f'{n} splits {t:.0f}' for n, t in splits.items())} us (best {paged / splits[best]:.1f}x)")


@pytest.mark.parametrize("sinks,window", [(True, None), (False, 12)])
def test_batch_shared_with_the_paged_kernel(sinks, window):
    # a captured graph's step shared on the device: sequences of at most 4 queries here, longer ones
    # (and none) on the paged kernel; each call leaves the other's rows as they were
    ctx_lens, q_lens = [40, 30, 9, 70, 3, 33], [1, 12, 4, 0, 2, 5]
    args = prefill_case(ctx_lens, q_lens, 2, 3, 32, 8, torch.float32, sinks, window)
    ref = short_prefill_attention_ref(*args)
    starts = args[5].tolist()
    few = torch.tensor([n <= 4 for s, e in zip(starts, starts[1:]) for n in [e - s] * (e - s)])
    for short, paged in ((short_prefill_attention, paged_prefill_attention),
                         (short_prefill_attention_ref, paged_prefill_attention_ref)):
        out = torch.full_like(ref, float("nan"))
        short(*args, num_splits=4, split_keys=16, block_m=16, block_n=16, out=out, longest_taken=4)
        assert torch.isnan(out[~few]).all() and not torch.isnan(out[few]).any()
        paged(*args, out=out, skip_up_to=4)
        assert rel_err(out, ref) < TOL[torch.float32]
