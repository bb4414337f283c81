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


def randn(*shape, seed, scale=1.0, dtype=torch.float32):
    """float64 values exactly representable in dtype (so the reference sees what the kernel sees)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(torch.float64)


def reference(fn, inputs, dy):
    """fn(*inputs) in float64 and the gradients of sum(fn * dy) with respect to every input."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    y = fn(*leaves)
    return y.detach(), torch.autograd.grad(y, leaves, dy)


def empty(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device=DEVICE)


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


def run_gqa(qkv, dout, NH, NKV, **kw):
    """(out, att, dqkv) of the gpu's grouped-query attention forward and backward on qkv and dout,
    every output prefilled with NaN (an element the kernels do not write shows); kw: the ops'."""
    from handgrad.backends.gpu import gqa_attention as GQA
    B, T, W = qkv.shape
    hs = W // (NH + 2 * NKV)
    out = torch.full((B, T, NH * hs), float("nan"), dtype=qkv.dtype, device=qkv.device)
    att = torch.full((B, NH, T), float("nan"), device=qkv.device)
    GQA.gqa_attention_forward(out, att, qkv, NH, NKV, **kw)
    dqkv = torch.full_like(qkv, float("nan"))
    GQA.gqa_attention_backward(dqkv, dout, qkv, att, NH, NKV, out=out, **kw)
    return out, att, dqkv

def assert_trains_like_the_cpu_and_resumes_exactly(data_dir, tmp_path, flags, capsys):
    """`handgrad train ... --device gpu` (flags end with those two flags, 3 steps, a checkpoint at 2, a
    sample at 3): the same losses as on the cpu, and a resume from step 2 rewrites step 3's
    checkpoint byte for byte."""
    import json
    import shutil
    import numpy as np
    from handgrad.cli import main as cli
    run, cpu_run = tmp_path / "gpu", tmp_path / "cpu"
    assert cli(["train", "--data", str(data_dir), "--out", str(run), *flags]) == 0
    assert "--- sample at step 3 ---" in capsys.readouterr().out
    assert cli(["train", "--data", str(data_dir), "--out", str(cpu_run), *flags[:-2]]) == 0
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    cpu_recs = [json.loads(ln) for ln in (cpu_run / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([r["loss"] for r in recs], [r["loss"] for r in cpu_recs], rtol=1e-5)
    final = (run / "ckpt" / "step_00000003" / "model.safetensors").read_bytes()
    shutil.rmtree(run / "ckpt" / "step_00000003")
    assert cli(["train", "--data", str(data_dir), "--out", str(run), "--resume", "--device", "gpu"]) == 0
    assert (run / "ckpt" / "step_00000003" / "model.safetensors").read_bytes() == final


def assert_backends_agree(cpu, gpu, idx, targets):
    """The same model on both backends (same weights), one batch: loss, logits and every gradient."""
    import numpy as np
    losses = []
    for model in (cpu, gpu):
        losses.append(model.forward(idx, targets))
        model.zero_grad()
        model.backward()
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0])
    np.testing.assert_allclose(gpu.forward(idx[:, :5]), cpu.forward(idx[:, :5]), rtol=0, atol=2e-5)
    gc, gg = cpu.grads(), gpu.grads()
    for name in gc:
        scale = max(float(np.abs(gc[name]).max()), 1e-12)
        assert float(np.abs(gg[name] - gc[name]).max()) <= 1e-4 * scale, name


def assert_bf16_model_within_autocast(model, ref_cls, idx, targets, factor=3.0):
    """A bf16 model's loss and whole gradient against float64: at most `factor` times the error of
    PyTorch's own bf16 autocast on the same weights and batch (ref_cls: torch_ref's TorchGPT or
    TorchLlama, built from the model's config and state_dict)."""
    import numpy as np
    loss = model.forward(idx, targets)
    model.zero_grad()
    model.backward()
    ours = model.grads()
    names = sorted(ours)

    def torch_run(dtype, autocast):
        ref = ref_cls(model.config, dtype).load_numpy(model.state_dict())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _, out = ref(torch.from_numpy(idx), torch.from_numpy(targets))
        out.backward()
        grads = ref.grads_numpy()
        return out.item(), np.concatenate([grads[n].ravel() for n in names]).astype(np.float64)
    loss64, g64 = torch_run(torch.float64, False)
    loss_bf, g_bf = torch_run(torch.float32, True)
    flat = np.concatenate([ours[n].ravel() for n in names]).astype(np.float64)
    err_ours, err_torch = np.linalg.norm(flat - g64), np.linalg.norm(g_bf - g64)
    assert err_ours <= factor * err_torch, (err_ours / np.linalg.norm(g64), err_torch / np.linalg.norm(g64))
    assert abs(loss - loss64) <= factor * abs(loss_bf - loss64) + 1e-4 * abs(loss64)


def assert_bf16_close(got, ref64, torch_bf16, name, factor=3.0, floor=1e-6):
    """flash-attention's test rule: handgrad's bf16 result may be off the float64 reference by at
    most `factor` times PyTorch's own bf16 computation's max error (plus a floor)."""
    bound = factor * max_err(torch_bf16, ref64) + floor
    err = max_err(got, ref64)
    assert err <= bound, f"{name}: bf16 max error {err:.3e} exceeds {factor} x torch bf16's {bound / factor:.3e}"
