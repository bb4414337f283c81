"""Shared by the gpu backend's tests: the device, tensors on it, and the bf16 error bound.

Without CUDA, conftest.py sets TRITON_INTERPRET=1 and the kernels run in Triton's interpreter on
CPU tensors (keep shapes tiny: ~1.5 ms per program instance). With CUDA the same tests run on the
GPU, and `REAL_GPU` lets a test add realistic sizes.
"""
import pytest
import torch

triton = pytest.importorskip("triton", reason="the gpu backend's tests need triton (pip install -e '.[test]')")

from handgrad.backends.gpu.common import device  # noqa: E402

DEVICE = device()
REAL_GPU = DEVICE.type == "cuda"


def on_device(x, dtype=torch.float32):
    """A tensor (from a tensor or NumPy array) on the backend's device, in dtype."""
    return torch.as_tensor(x).to(device=DEVICE, dtype=dtype).contiguous()


def max_err(got, ref):
    return (got.double().cpu() - ref.double().cpu()).abs().max().item()


def assert_close(got, ref, name, atol, rtol):
    """got within atol + rtol * |ref| of ref everywhere, naming the quantity and the worst element."""
    got, ref = got.double().cpu(), ref.double().cpu()
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = (got - ref).abs() - (atol + rtol * ref.abs())
    if (err > 0).any() or not torch.isfinite(got).all():
        i = int(err.flatten().argmax())
        raise AssertionError(f"{name}: max abs error {max_err(got, ref):.3e}; worst at flat index {i}: "
                             f"got {got.flatten()[i].item():.6e}, expected {ref.flatten()[i].item():.6e} "
                             f"(atol {atol:g}, rtol {rtol:g})")


def assert_bf16_close(got, ref64, torch_bf16, name, factor=3.0, floor=1e-6):
    """flash-attention's test rule: handgrad's bf16 result may be off the float64 reference by at
    most `factor` times PyTorch's own bf16 computation's max error (plus a floor)."""
    bound = factor * max_err(torch_bf16, ref64) + floor
    err = max_err(got, ref64)
    assert err <= bound, f"{name}: bf16 max error {err:.3e} exceeds {factor} x torch bf16's {bound / factor:.3e}"
