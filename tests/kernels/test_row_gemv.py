"""Row-streaming dense GEMV (one or two tokens) against the float32 reference."""
import pytest
import torch

from kernel_checks import cuda_time_us, rel_err
from localchat.kernels.rmsnorm import add_rms_norm_ref
from localchat.kernels.row_gemv import PreNorm, dense_gemv, dense_gemv_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_gemv(m, dtype, bias):
    n, k = 37, 70  # N not a multiple of the row block, K not a multiple of the K step
    w = (torch.randn(n, k, device=DEV) / 8).to(dtype)
    x = torch.randn(m, k, device=DEV).to(dtype)
    b = torch.randn(n, device=DEV).to(dtype) if bias else None
    out = dense_gemv(x, w, b)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, dense_gemv_ref(x, w, b)) < (1e-5 if dtype == torch.float32 else 8e-3)


def test_dense_gemv_strided_rows_and_errors():
    w = torch.randn(24, 40, device=DEV)
    rows = w[::2]  # every other row: row stride 80, still contiguous along K
    x = torch.randn(1, 40, device=DEV)
    assert rel_err(dense_gemv(x, rows), dense_gemv_ref(x, rows)) < 1e-5
    with pytest.raises(ValueError, match="K-contiguous"):
        dense_gemv(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="M <= 4"):
        dense_gemv(torch.randn(5, 40, device=DEV), w)



@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
def test_dense_gemv_with_norm(m, dtype, residual):
    # the RMSNorm inside the GEMV: against its reference, and against add_rms_norm followed by
    # the GEMV (which rounds the normed rows to dtype first); the residual stream is written by
    # one program and must come out exactly as add_rms_norm's
    n, k, eps = 37, 70, 1e-5
    w = (torch.randn(n, k, device=DEV) / 8).to(dtype)
    x = torch.randn(m, k, device=DEV).to(dtype)
    res = torch.randn(m, k, device=DEV).to(dtype) if residual else None
    g = (1 + torch.randn(k, device=DEV) / 4).to(dtype)
    b = torch.randn(n, device=DEV).to(dtype)
    norm = PreNorm(g, eps, res)
    torch.empty(4 * m * (n + k), device=DEV).fill_(float("nan"))  # poison what the allocator hands out next
    out, new_res = dense_gemv(x, w, b, norm=norm)
    ref, ref_res = dense_gemv_ref(x, w, b, norm=norm)
    assert out.shape == (m, n) and new_res.shape == (m, k)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 8e-3)
    normed, two_res = add_rms_norm_ref(x, res, g, eps, weight_first=True)
    assert torch.equal(new_res, ref_res) and torch.equal(new_res, two_res)
    assert rel_err(out, dense_gemv_ref(normed, w, b)) < (1e-5 if dtype == torch.float32 else 2e-2)
    if residual:  # the residual reaches the product, not only the stream
        assert rel_err(out, dense_gemv(x, w, b, norm=PreNorm(g, eps, None))[0]) > 1e-2

@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(2880, 4096), (5120, 2880), (128, 2880), (201088, 2880)])
def test_dense_gemv_gpu(n, k):
    """gpt-oss o_proj, fused q/k/v, router and lm_head, bf16: against the reference and timed
    against cuBLAS."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
    for m in (1, 2):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        assert rel_err(dense_gemv(x, w), dense_gemv_ref(x, w)) < 8e-3
        ours = cuda_time_us(lambda: dense_gemv(x, w))
        cublas = cuda_time_us(lambda: torch.nn.functional.linear(x, w))
        print(f"\ndense_gemv M={m} N={n} K={k}: {ours:.1f} us ({2 * n * k / ours / 1e3:.0f} GB/s), "
              f"cuBLAS {cublas:.1f} us")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(5120, 2880), (201088, 2880)])
def test_dense_gemv_with_norm_gpu(n, k):
    """gpt-oss q/k/v and lm_head with the norm in front, bf16, one token."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
    x, res = (torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    norm = PreNorm(torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5, 1e-5, res)
    out, new_res = dense_gemv(x, w, norm=norm)
    ref, ref_res = dense_gemv_ref(x, w, norm=norm)
    assert rel_err(out, ref) < 8e-3 and torch.equal(new_res, ref_res)
