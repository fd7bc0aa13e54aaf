"""The merge of attention parts (kernels/attention_merge.py) against its torch reference, and
the reference against attention over all keys at once."""
import pytest
import torch

from kernel_checks import DEV, TOL, rel_err
from localchat.kernels.attention_merge import merge_attention_parts, merge_attention_parts_ref


def _part(t, h, d, dtype, heads_first):
    """A part's output [T, H, D] as cuDNN returns it (heads-first memory seen as [T, H, D]) or packed,
    and its log-sum-exp [H, T] spread wide enough that either part may dominate a row."""
    o = torch.randn(h, t, d, device=DEV).to(dtype).transpose(0, 1) if heads_first else \
        torch.randn(t, h, d, device=DEV).to(dtype)
    return o, torch.randn(h, t, device=DEV) * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("two_parts", [True, False])
@pytest.mark.parametrize("sinks", [False, True])
def test_merge_matches_reference(dtype, two_parts, sinks):
    # 45 rows: a partial row block; D 40: not a power of two; rows written into a slice of a larger output
    t, h, d = 45, 3, 40
    a, a_lse = _part(t, h, d, dtype, heads_first=True)
    b, b_lse = _part(t, h, d, dtype, heads_first=False) if two_parts else (None, None)
    s = torch.randn(h, device=DEV) * 3 if sinks else None
    whole = torch.full((t + 7, h, d), float("nan"), device=DEV, dtype=dtype)
    got = merge_attention_parts(whole[5:5 + t], a, a_lse, b, b_lse, s)
    ref = merge_attention_parts_ref(torch.empty(t, h, d, device=DEV, dtype=torch.float32), a, a_lse, b, b_lse, s)
    assert got.data_ptr() == whole[5].data_ptr()
    assert rel_err(got, ref) < TOL[dtype]
    assert torch.isnan(whole[:5]).all() and torch.isnan(whole[5 + t:]).all()  # nothing outside its rows


def test_reference_equals_attention_over_all_keys_with_a_sink():
    h, t, d, n = 2, 5, 8, 11
    q, k, v = torch.randn(h, t, d), torch.randn(h, n, d), torch.randn(h, n, d)
    sink = torch.randn(h)
    scores = q @ k.transpose(1, 2)
    full = torch.softmax(torch.cat([scores, sink[:, None, None].expand(h, t, 1)], -1), -1)[..., :n] @ v
    parts = []
    for keys in (slice(0, 4), slice(4, n)):
        part = scores[..., keys]
        parts += [(torch.softmax(part, -1) @ v[:, keys]).transpose(0, 1), torch.logsumexp(part, -1)]
    got = merge_attention_parts_ref(torch.empty(t, h, d), *parts, sink)
    assert torch.allclose(got, full.transpose(0, 1), atol=1e-5)


def test_mismatched_shapes_are_refused():
    a, a_lse = _part(4, 2, 8, torch.float32, heads_first=False)
    with pytest.raises(ValueError, match="log-sum-exp"):
        merge_attention_parts(torch.empty(4, 2, 8, device=DEV), a, a_lse.t())


@pytest.mark.gpu
@pytest.mark.parametrize("h,d,sinks", [(64, 64, True), (96, 128, False)])
def test_merge_real_shapes_gpu(h, d, sinks):
    from kernel_checks import cuda_time_us

    t = 2048
    a, a_lse = _part(t, h, d, torch.bfloat16, heads_first=True)
    b, b_lse = _part(t, h, d, torch.bfloat16, heads_first=True)
    s = torch.randn(h, device=DEV) * 3 if sinks else None
    out = torch.empty(t, h, d, device=DEV, dtype=torch.bfloat16)
    ref = merge_attention_parts_ref(torch.empty(t, h, d, device=DEV), a, a_lse, b, b_lse, s)
    assert rel_err(merge_attention_parts(out, a, a_lse, b, b_lse, s), ref) < TOL[torch.bfloat16]
    us = cuda_time_us(lambda: merge_attention_parts(out, a, a_lse, b, b_lse, s))
    moved = 3 * t * h * d * 2
    print(f"\nmerge T={t} H={h} D={d}: {us:.1f} us, {moved / us / 1e3:.0f} GB/s")
