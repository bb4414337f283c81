"""handgrad.torch's Llama Functions and Modules on the gpu backend: CUDA tensors go to its Triton
kernels. Without CUDA the kernels run in Triton's interpreter on CPU tensors, so these tests point
the CPU device at the gpu backend (common.DEVICE_BACKEND) and compare against PyTorch autograd in
float64 and against the same Functions on the cpu backend; with CUDA they use CUDA tensors."""
import pytest
import torch

from gpu_helpers import DEVICE, REAL_GPU, assert_close, randn, reference

import handgrad.torch as H
from handgrad import torch_ref
from handgrad.torch import common

F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture
def on_gpu_backend(monkeypatch):
    """The device type of DEVICE routed to the gpu backend (on CUDA it already is); yields the
    names of the backends the Functions asked for, so a test can see the gpu kernels ran."""
    monkeypatch.setitem(common.DEVICE_BACKEND, DEVICE.type, "gpu")
    asked, real = [], common.get_backend
    monkeypatch.setattr(common, "get_backend", lambda name: (asked.append(name), real(name))[1])
    yield asked


def _run(fn, inputs, dy, dtype):
    """fn over leaves made from the float64 inputs in dtype on DEVICE: output and input gradients."""
    leaves = [x.to(DEVICE, dtype).requires_grad_(True) for x in inputs]
    y = fn(*leaves)
    grads = torch.autograd.grad(y, leaves, dy.to(DEVICE, dtype))
    return y.detach(), grads


# (name, handgrad Function call, the PyTorch expression, input shapes)
T, NH, NKV, HS = 5, 4, 2, 16
COS, SIN = (t.to(torch.float64) for t in H.rope_cache(8, HS))
CASES = [
    ("rms_norm", lambda x, w: H.rms_norm(x, w, 1e-5), lambda x, w: torch_ref.rmsnorm(x, w, 1e-5),
     [(2, T, 48), (48,)], (2, T, 48)),
    ("swiglu", H.swiglu, torch_ref.swiglu, [(2, T, 2 * 24)], (2, T, 24)),
    ("rope, offset 3", lambda x: H.rope(x, *_tables(x), NH + NKV, offset=3),
     lambda x: torch_ref.rope(x, COS, SIN, NH + NKV, offset=3), [(2, T, (NH + NKV) * HS)], (2, T, (NH + NKV) * HS)),
    ("gqa_attention", lambda qkv: H.gqa_attention(qkv, NH, NKV), lambda qkv: torch_ref.gqa_attention(qkv, NH, NKV),
     [(2, T, (NH + 2 * NKV) * HS)], (2, T, NH * HS)),
    ("linear", lambda x, w, b: H.linear(x, w, b), torch.nn.functional.linear, [(2, T, 24), (40, 24), (40,)],
     (2, T, 40)),
]


def _tables(x):
    """The RoPE tables on x's device, float32 (the gpu kernels read float32 tables)."""
    return COS.to(x.device, F32), SIN.to(x.device, F32)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_llama_function_on_the_gpu_backend_matches_autograd(case, on_gpu_backend):
    name, hg, ref, shapes, out_shape = case
    inputs = [randn(*s, seed=i, scale=0.5 if len(s) == 1 else 1.0) for i, s in enumerate(shapes)]
    if name == "rms_norm":
        inputs[1] = 1.0 + inputs[1]
    dy = randn(*out_shape, seed=99)
    y_ref, g_ref = reference(ref, inputs, dy)
    y, grads = _run(hg, inputs, dy, F32)
    assert y.device.type == DEVICE.type and y.dtype == F32
    assert on_gpu_backend and set(on_gpu_backend) == {"gpu"}, on_gpu_backend
    assert_close(y, y_ref, f"{name} y", 1e-5, 1e-4)
    for i, (g, r) in enumerate(zip(grads, g_ref)):
        assert_close(g, r, f"{name} d{i}", 1e-4, 1e-4)


@pytest.mark.parametrize("case", CASES[:4], ids=[c[0] for c in CASES[:4]])
def test_llama_function_bf16_within_pytorchs_own_bf16_error(case, on_gpu_backend):
    """bf16 activations: handgrad's error against float64 at most 3x (+ a floor) that of the same
    PyTorch expression run on bf16 tensors."""
    name, hg, ref, shapes, out_shape = case
    inputs = [randn(*s, seed=10 + i, scale=0.5 if len(s) == 1 else 1.0, dtype=BF16) for i, s in enumerate(shapes)]
    if name == "rms_norm":
        inputs[1] = (1.0 + inputs[1]).to(BF16).double()
    dy = randn(*out_shape, seed=98, dtype=BF16)
    y_ref, g_ref = reference(ref, inputs, dy)
    y, grads = _run(hg, inputs, dy, BF16)
    ref_bf16 = ref if name != "rope, offset 3" else (
        lambda x: torch_ref.rope(x, COS.to(x.device, BF16), SIN.to(x.device, BF16), NH + NKV, offset=3))
    yt, gt = _run(ref_bf16, inputs, dy, BF16)
    for label, got, theirs, exact in [("y", y, yt, y_ref)] + [(f"d{i}", g, t, r) for i, (g, t, r)
                                                               in enumerate(zip(grads, gt, g_ref))]:
        if name == "rms_norm" and label == "d1":
            continue  # the weight's gradient: handgrad keeps it float32 in the models; here it is a bf16 leaf
        theirs_err = (theirs.double().cpu() - exact).abs().max().item()
        mine = (got.double().cpu() - exact).abs().max().item()
        assert mine <= 3 * theirs_err + 1e-2 * exact.abs().max().item(), (name, label, mine, theirs_err)


def test_gpu_and_cpu_backends_agree_through_the_modules(on_gpu_backend):
    """transformers-shaped modules (CausalSelfAttention with grouped heads, SwiGLU's MLP, RMSNorm),
    the same weights, on the gpu backend and on the cpu backend: outputs and every gradient."""
    torch.manual_seed(0)
    C = NH * HS
    mods = [H.RMSNorm(C, eps=1e-5), H.CausalSelfAttention(C, NH, n_kv_head=NKV), H.SwiGLU(C, 40)]
    x = torch.randn(2, T, C)

    def run(device):
        out = {}
        xs = x.to(device).requires_grad_(True)
        h = xs
        for m in mods:
            m.to(device)
            m.zero_grad(set_to_none=True)
            h = m(h)
        h.backward(torch.ones_like(h))
        out["y"] = h.detach().cpu()
        out["dx"] = xs.grad.cpu()
        for i, m in enumerate(mods):
            for n, p in m.named_parameters():
                out[f"{i}.{n}"] = p.grad.cpu()
        return out

    gpu = run(DEVICE)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(common.DEVICE_BACKEND, "cpu", "cpu")
        cpu = run(torch.device("cpu"))
    assert gpu.keys() == cpu.keys()
    for k in gpu:
        scale = cpu[k].abs().max().item() + 1e-6
        assert (gpu[k] - cpu[k]).abs().max().item() <= 1e-4 * scale, k


def test_the_gpu_backend_refuses_float64_and_float64_tables(on_gpu_backend):
    x = torch.zeros(1, 2, 32, dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match="gpu kernels take torch.float32 or torch.bfloat16"):
        H.swiglu(x)
    cos, sin = (t.to(DEVICE, torch.float64) for t in H.rope_cache(4, 16))
    with pytest.raises(TypeError, match="torch.float32 on the gpu backend"):
        H.rope(torch.zeros(1, 2, 32, device=DEVICE), cos, sin, 2)


@pytest.mark.skipif(REAL_GPU, reason="checks the CPU route")
def test_cpu_tensors_still_go_to_the_cpu_backend():
    """Without the tests' routing, a CPU tensor runs on the cpu kernels (float64 allowed)."""
    assert H.swiglu(torch.zeros(1, 2, 8, dtype=torch.float64)).dtype == torch.float64
