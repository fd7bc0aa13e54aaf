"""Row-streaming dense GEMV (one or two tokens) against the float32 reference."""
import pytest
import torch

from kernel_checks import cuda_time_us, rel_err
from localchat.kernels.row_gemv import dense_gemv, dense_gemv_ref

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
