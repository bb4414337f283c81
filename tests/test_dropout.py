"""Dropout's op (backends/cpu/dropout.py): masks from Philox-4x32-10 keyed by (seed, element index),
the same on the serial and parallel copies, equal to an independent NumPy computation and to Triton's
own tl.randint4x (so the gpu backend can draw identical masks), forward and backward against
PyTorch autograd fed the same mask, and the keep rate."""
import numpy as np
import pytest
import torch

from handgrad.backends.cpu import dropout as D

from helpers import forced_kernels

SEED = D.dropout_seed(1337, 7, 1, 2, 0)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 4097, 10_007])
def test_kernel_mask_equals_numpy_on_both_copies(n):
    x = np.linspace(0.5, 2.0, n)
    outs = []
    for copy in ("serial", "parallel"):
        out = np.full_like(x, np.nan)
        with forced_kernels(copy):
            D.dropout_forward(out, x, 0.25, SEED)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])
    keep = D.keep_mask(x.shape, 0.25, SEED)
    np.testing.assert_array_equal(outs[0], np.where(keep, x * (1.0 / 0.75), 0.0))


def test_masks_equal_tritons_randint4x():
    """Triton's tl.randint4x(seed, offset) (run by its interpreter without a GPU) gives the words
    keep_mask compares, a 64-bit seed's high word included."""
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from gpu_helpers import DEVICE

    @triton.jit
    def words(out_ptr, seed, N: tl.constexpr):
        offs = tl.arange(0, N)
        r0, r1, r2, r3 = tl.randint4x(seed, offs)
        tl.store(out_ptr + 4 * offs, r0.to(tl.int64) & 0xFFFFFFFF)
        tl.store(out_ptr + 4 * offs + 1, r1.to(tl.int64) & 0xFFFFFFFF)
        tl.store(out_ptr + 4 * offs + 2, r2.to(tl.int64) & 0xFFFFFFFF)
        tl.store(out_ptr + 4 * offs + 3, r3.to(tl.int64) & 0xFFFFFFFF)

    for seed in (12345, SEED & 0x7FFFFFFFFFFFFFFF):
        out = torch.zeros(64, dtype=torch.int64, device=DEVICE)
        words[(1,)](out, seed, N=16)
        got = out.cpu().numpy().astype(np.uint64)
        for p in (0.1, 0.5, 0.9):
            assert np.array_equal(got >= D.threshold(p), D.keep_mask((64,), p, seed)), (seed, p)


@pytest.mark.parametrize("shape", [(2, 5, 37), (1, 1, 8), (3, 4, 4, 9)])
def test_forward_and_backward_match_autograd_with_the_same_mask(shape):
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal(shape), rng.standard_normal(shape)
    p = 0.2
    out, dx = np.full(shape, np.nan), np.full(shape, np.nan)
    D.dropout_forward(out, x, p, SEED)
    D.dropout_backward(dx, g, p, SEED)
    mask = torch.tensor(D.keep_mask(shape, p, SEED), dtype=torch.float64)
    tx = torch.tensor(x, requires_grad=True)
    ref = tx * mask / (1 - p)  # what torch.nn.functional.dropout computes for this mask
    ref.backward(torch.tensor(g))
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-15, atol=0)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-15, atol=0)
    inplace = x.copy()
    D.dropout_forward(inplace, inplace, p, SEED)
    assert np.array_equal(inplace, out)


def test_keep_rate_seeds_and_arguments():
    n = 200_000
    for p in (0.1, 0.5):
        rate = D.keep_mask((n,), p, SEED).mean()
        assert abs(rate - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n)
    x = np.ones(7, np.float32)
    out = np.empty_like(x)
    D.dropout_forward(out, x, 0.0, SEED)  # p = 0: a copy
    assert np.array_equal(out, x)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\)"):
        D.dropout_forward(out, x, 1.0, SEED)
    seeds = {D.dropout_seed(*args) for args in [(1, 2, 3, 4, 5), (0, 2, 3, 4, 5), (1, 0, 3, 4, 5), (1, 2, 0, 4, 5),
                                               (1, 2, 3, 0, 5), (1, 2, 3, 4, 0)]}
    assert len(seeds) == 6  # every argument moves the mask
    assert not np.array_equal(D.keep_mask((64,), 0.5, 1), D.keep_mask((64,), 0.5, 2))
