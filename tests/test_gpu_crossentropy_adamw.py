"""The gpu backend's fused cross-entropy and AdamW / global norm against PyTorch in float64.

Without CUDA the kernels run in Triton's interpreter (conftest.py), so every launch here is a few
programs: B*T <= 6 rows, a few chunks of parameters. The cross-entropy cases set MAX_BLOCK_V below V
so each row's chunk loop runs several times.
"""
import pytest
import torch
import torch.nn.functional as F

from gpu_helpers import DEVICE, REAL_GPU, assert_bf16_close, assert_close, on_device

from handgrad.backends.gpu import adamw as gpu_adamw
from handgrad.backends.gpu import crossentropy as gpu_ce
from handgrad.backends.gpu.adamw import adamw_update, global_norm, make_chunks
from handgrad.backends.gpu.crossentropy import IGNORE_INDEX, crossentropy_backward, crossentropy_forward


# ---------------------------------------------------------------- cross-entropy
def reference_crossentropy(logits, targets, dloss=None):
    """float64 autograd: (losses, lse, mean, dlogits) with dlogits = d(sum_i dloss_i * loss_i),
    dloss_i = 1/n by default (the mean's gradient)."""
    B, T, V = logits.shape
    z = logits.detach().double().cpu().requires_grad_(True)
    t = targets.cpu().long().reshape(-1)
    losses = F.cross_entropy(z.reshape(-1, V), t, ignore_index=IGNORE_INDEX, reduction="none")
    n = int((t != IGNORE_INDEX).sum())
    mean = losses.sum() / n if n else losses.sum() * 0.0  # the CPU op's rule: 0.0 when all ignored
    if dloss is None:
        mean.backward()
    else:
        (losses * torch.as_tensor(dloss, dtype=torch.float64).reshape(-1)).sum().backward()
    lse = torch.logsumexp(z.detach(), dim=-1)
    return losses.detach().reshape(B, T), lse, mean.detach(), z.grad


def make_case(B, T, V, seed, scale=3.0, ignore=(), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * scale
    targets = torch.randint(0, V, (B, T), generator=g, dtype=torch.int32)
    for b, t in ignore:
        targets[b, t] = IGNORE_INDEX
    return on_device(logits, dtype), on_device(targets, torch.int32)


def run_forward(logits, targets, lse_dtype=torch.float32):
    B, T, _ = logits.shape
    losses = torch.empty(B, T, dtype=torch.float32, device=DEVICE)
    lse = torch.empty(B, T, dtype=lse_dtype, device=DEVICE)
    mean = crossentropy_forward(losses, lse, logits, targets)
    return losses, lse, mean


CE_SHAPES = [  # (B, T, V, MAX_BLOCK_V): V never a multiple of the chunk
    pytest.param(2, 3, 65, 16, id="V65-5chunks"),
    pytest.param(1, 1, 1000, 256, id="V1000-T1"),
    pytest.param(3, 2, 1027, 256, id="V1027-5chunks"),
    pytest.param(2, 1, 1027, 4096, id="V1027-1chunk"),
]


@pytest.mark.parametrize("lse_dtype", [torch.float32, torch.float64], ids=["lse32", "lse64"])
@pytest.mark.parametrize("B, T, V, block", CE_SHAPES)
def test_crossentropy(B, T, V, block, lse_dtype, monkeypatch):
    monkeypatch.setattr(gpu_ce, "MAX_BLOCK_V", block)
    ignore = [(0, 1)] if T > 1 else []
    logits, targets = make_case(B, T, V, seed=V + B, ignore=ignore)
    ref_losses, ref_lse, ref_mean, ref_dlogits = reference_crossentropy(logits, targets)

    losses, lse, mean = run_forward(logits, targets, lse_dtype)
    assert mean.dim() == 0 and mean.device.type == DEVICE.type and mean.dtype == torch.float32
    assert_close(losses, ref_losses, "losses", atol=1e-5, rtol=1e-5)
    assert_close(lse, ref_lse, "lse", atol=1e-5, rtol=1e-6)
    assert_close(mean, ref_mean, "mean loss", atol=1e-5, rtol=1e-5)
    for b, t in ignore:
        assert losses[b, t].item() == 0.0

    dlogits = torch.full_like(logits, float("nan"))  # out of place: every element must be written
    crossentropy_backward(dlogits, logits, lse, targets)
    assert_close(dlogits, ref_dlogits, "dlogits (out of place)", atol=1e-7, rtol=1e-5)
    crossentropy_backward(logits, logits, lse, targets)  # in place, as the model calls it
    assert_close(logits, ref_dlogits, "dlogits (in place)", atol=1e-7, rtol=1e-5)
    for b, t in ignore:
        assert (logits[b, t] == 0).all()


@pytest.mark.parametrize("kind", ["float", "tensor0d", "rows"])
def test_crossentropy_dloss(kind, monkeypatch):
    """dloss replaces 1/n: a number, a device scalar, or one value per row (B, T)."""
    monkeypatch.setattr(gpu_ce, "MAX_BLOCK_V", 64)
    B, T, V = 2, 2, 130
    logits, targets = make_case(B, T, V, seed=7, ignore=[(1, 0)])
    if kind == "rows":
        dloss_ref = torch.tensor([[0.5, -1.0], [2.0, 0.25]], dtype=torch.float64)
        dloss = on_device(dloss_ref)
    else:
        dloss_ref = torch.full((B, T), 0.3, dtype=torch.float64)
        dloss = 0.3 if kind == "float" else on_device(torch.tensor(0.3))
    *_, ref_dlogits = reference_crossentropy(logits, targets, dloss_ref)
    _, lse, _ = run_forward(logits, targets)
    crossentropy_backward(logits, logits, lse, targets, dloss=dloss)
    assert_close(logits, ref_dlogits, f"dlogits (dloss {kind})", atol=1e-7, rtol=1e-5)


def test_crossentropy_all_ignored():
    """Every target -1: losses 0, mean 0.0 (the CPU op's rule; torch's mean would be nan) and
    dlogits all zeros."""
    logits, targets = make_case(2, 2, 65, seed=3, ignore=[(0, 0), (0, 1), (1, 0), (1, 1)])
    losses, lse, mean = run_forward(logits, targets)
    assert mean.item() == 0.0 and (losses == 0).all()
    crossentropy_backward(logits, logits, lse, targets)
    assert (logits == 0).all()


@pytest.mark.parametrize("lse_dtype", [torch.float32, torch.float64], ids=["lse32", "lse64"])
def test_crossentropy_extreme_logits(lse_dtype, monkeypatch):
    """Logits of +-1e4 (exp would overflow without the running max) stay finite and accurate. With a
    float32 lse the backward's probabilities carry a relative error up to ~eps32 * |lse| (6e-8 *
    1e4), hence the looser tolerance there."""
    monkeypatch.setattr(gpu_ce, "MAX_BLOCK_V", 64)
    B, T, V = 1, 3, 200
    logits, targets = make_case(B, T, V, seed=11, scale=1.0)
    logits = torch.sign(logits) * 1e4 + logits  # +-1e4 plus a spread of a few units
    targets[0, 0] = int(logits[0, 0].argmax())  # one row whose target is the dominant logit
    ref_losses, ref_lse, ref_mean, ref_dlogits = reference_crossentropy(logits, targets)
    losses, lse, mean = run_forward(logits, targets, lse_dtype)
    assert_close(losses, ref_losses, "losses", atol=2e-3, rtol=1e-6)
    if lse_dtype == torch.float32:  # rounded to float32: half an ulp of 1e4 is 5e-4
        assert_close(lse, ref_lse, "lse", atol=0.0, rtol=1e-7)
    else:  # max + log(sum) kept apart from the rounding of 1e4: only log(sum)'s float32 error
        assert_close(lse, ref_lse, "lse", atol=5e-7, rtol=0.0)
    assert_close(mean, ref_mean, "mean loss", atol=2e-3, rtol=1e-6)
    crossentropy_backward(logits, logits, lse, targets)
    rtol = 1e-3 if lse_dtype == torch.float32 else 1e-5
    assert_close(logits, ref_dlogits, "dlogits", atol=1e-7, rtol=rtol)


def test_crossentropy_bf16(monkeypatch):
    """bf16 logits (read as float32): errors against float64 within 3x torch's own bf16 errors."""
    monkeypatch.setattr(gpu_ce, "MAX_BLOCK_V", 128)
    B, T, V = 2, 3, 300
    logits64, targets = make_case(B, T, V, seed=5, ignore=[(1, 2)], dtype=torch.float64)
    ref_losses, _, ref_mean, ref_dlogits = reference_crossentropy(logits64, targets)
    zb = logits64.cpu().to(torch.bfloat16).requires_grad_(True)
    tl_losses = F.cross_entropy(zb.reshape(-1, V), targets.cpu().long().reshape(-1),
                                ignore_index=IGNORE_INDEX, reduction="none")
    tl_mean = tl_losses.sum() / int((targets != IGNORE_INDEX).sum())
    tl_mean.backward()

    logits = logits64.to(torch.bfloat16)
    losses, lse, mean = run_forward(logits, targets)
    assert_bf16_close(losses, ref_losses, tl_losses.detach().reshape(B, T), "losses")
    assert_bf16_close(mean, ref_mean, tl_mean.detach(), "mean loss")
    crossentropy_backward(logits, logits, lse, targets)
    assert logits.dtype == torch.bfloat16
    assert_bf16_close(logits, ref_dlogits, zb.grad, "dlogits")


# ---------------------------------------------------------------- AdamW and the global norm
SHAPES = [(96, 100), (100,), (24, 40), (40,), (7,)]  # (96, 100) spans two chunks of CHUNK = 8192


@pytest.fixture(autouse=True)
def device_block(monkeypatch):
    """The GPU's BLOCK here, so each program's loop over its chunk runs several steps (the interpreter
    takes a chunk in one step elsewhere: adamw.BLOCK)."""
    monkeypatch.setattr(gpu_adamw, "BLOCK", gpu_adamw.DEVICE_BLOCK)


def layout(shapes):
    """[(start, end, decay)] of each tensor in the flat buffer; decay on 2-D tensors only."""
    segments, off = [], 0
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        segments.append((off, off + n, len(s) >= 2))
        off += n
    return segments, off


def shard_segments(segments, lo, hi):
    """optim.AdamW's rule: each tensor's part inside [lo, hi), relative to lo."""
    return [(max(a, lo) - lo, min(b, hi) - lo, d) for a, b, d in segments if a < hi and b > lo]


def torch_adamw(flat, segments, shapes, lr, betas, eps, wd):
    """torch.optim.AdamW over float64 views of the flat buffer; weight decay on 2-D tensors only."""
    params = [flat[a:b].clone().reshape(s).requires_grad_(True) for (a, b, _), s in zip(segments, shapes)]
    groups = [{"params": [p for p, (_, _, d) in zip(params, segments) if d], "weight_decay": wd},
              {"params": [p for p, (_, _, d) in zip(params, segments) if not d], "weight_decay": 0.0}]
    return params, torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)


def test_make_chunks():
    chunks = make_chunks([(0, 10000, True), (10000, 10003, False), (10003, 10003, True)])
    assert chunks.dtype == torch.int64 and chunks.device.type == DEVICE.type
    C = gpu_adamw.CHUNK
    assert chunks.cpu().tolist() == [[0, C, 1], [C, 10000, 1], [10000, 10003, 0]]
    assert make_chunks([]).shape == (0, 3)


@pytest.mark.parametrize("shard", [False, True], ids=["whole", "shard"])
def test_global_norm(shard):
    """Over the whole buffer (its padding excluded) and over a shard [lo, hi) cutting two tensors."""
    segments, N = layout(SHAPES)
    g = torch.randn(N + 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # + padding
    lo, hi = (5000, N - 3) if shard else (0, N)
    chunks = make_chunks(shard_segments(segments, lo, hi))
    norm = global_norm(on_device(g)[lo:], chunks)
    assert norm.dim() == 0 and norm.dtype == torch.float32 and norm.device.type == DEVICE.type
    assert_close(norm, torch.linalg.vector_norm(g[lo:hi]), "global norm", atol=0.0, rtol=2e-6)
    assert global_norm(on_device(g), make_chunks([])).item() == 0.0


@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
def test_adamw_against_torch(scale_kind):
    """5 steps, weight decay on the 2-D tensors, grad_scale folded in, bf16 weight copy written."""
    lr, betas, eps, wd, grad_scale = 1e-2, (0.9, 0.95), 1e-8, 0.1, 0.5
    segments, N = layout(SHAPES)
    gen = torch.Generator().manual_seed(2)
    flat = torch.randn(N, generator=gen, dtype=torch.float64)
    ref_params, ref_opt = torch_adamw(flat, segments, SHAPES, lr, betas, eps, wd)

    params, m, v = on_device(flat), on_device(torch.zeros(N)), on_device(torch.zeros(N))
    params_bf16 = torch.empty(N, dtype=torch.bfloat16, device=DEVICE)
    chunks = make_chunks(segments)
    scale = grad_scale if scale_kind == "float" else on_device(torch.tensor(grad_scale))
    for step in range(1, 6):
        g = torch.randn(N, generator=gen, dtype=torch.float64).float().double()  # exact in float32
        for p, (a, b, _) in zip(ref_params, segments):
            p.grad = (g[a:b] * grad_scale).reshape(p.shape)
        ref_opt.step()
        adamw_update(params, on_device(g), m, v, chunks, step, lr, betas[0], betas[1], eps, wd, scale,
                     params_bf16=params_bf16)
    ref = torch.cat([p.detach().reshape(-1) for p in ref_params])
    assert_close(params, ref, f"params after 5 steps (grad_scale {scale_kind})", atol=1e-6, rtol=1e-5)
    ref_m = torch.cat([ref_opt.state[p]["exp_avg"].reshape(-1) for p in ref_params])
    ref_v = torch.cat([ref_opt.state[p]["exp_avg_sq"].reshape(-1) for p in ref_params])
    assert_close(m, ref_m, "m", atol=1e-7, rtol=1e-5)
    assert_close(v, ref_v, "v", atol=1e-9, rtol=1e-5)
    assert torch.equal(params_bf16.cpu(), params.cpu().to(torch.bfloat16)), "params_bf16 != params.to(bfloat16)"


def test_adamw_shard():
    """ZeRO-1: params[lo:hi] with segments relative to lo, lo and hi inside tensors; the elements
    outside the slice (and the padding) stay untouched."""
    lr, betas, eps, wd = 1e-2, (0.9, 0.999), 1e-8, 0.1
    segments, N = layout(SHAPES)
    lo, hi = 5000, N - 3  # inside (96, 100) and inside (7,)
    gen = torch.Generator().manual_seed(4)
    flat = torch.randn(N + 5, generator=gen, dtype=torch.float64)
    g = torch.randn(N + 5, generator=gen, dtype=torch.float64).float().double()
    ref_params, ref_opt = torch_adamw(flat, segments, SHAPES, lr, betas, eps, wd)
    for p, (a, b, _) in zip(ref_params, segments):
        p.grad = g[a:b].reshape(p.shape)
    ref_opt.step()
    ref = torch.cat([p.detach().reshape(-1) for p in ref_params])

    params, grads = on_device(flat), on_device(g)
    m, v = on_device(torch.zeros(hi - lo)), on_device(torch.zeros(hi - lo))
    chunks = make_chunks(shard_segments(segments, lo, hi))
    adamw_update(params[lo:hi], grads[lo:hi], m, v, chunks, 1, lr, betas[0], betas[1], eps, wd, 1.0)
    assert_close(params[lo:hi], ref[lo:hi], "params in the shard", atol=1e-6, rtol=1e-5)
    assert torch.equal(params[:lo].cpu(), flat[:lo].float()) and torch.equal(params[hi:].cpu(), flat[hi:].float())


@pytest.mark.skipif(not REAL_GPU, reason="a realistic size: too slow for the interpreter")
def test_realistic_sizes():
    """GPT-2 small's vocabulary and a 10M-parameter buffer, on a real GPU only."""
    logits, targets = make_case(4, 64, 50257, seed=0, ignore=[(0, 0)])
    ref_losses, ref_lse, ref_mean, ref_dlogits = reference_crossentropy(logits, targets)
    losses, lse, mean = run_forward(logits, targets)
    assert_close(mean, ref_mean, "mean loss", atol=1e-5, rtol=1e-5)
    crossentropy_backward(logits, logits, lse, targets)
    assert_close(logits, ref_dlogits, "dlogits", atol=1e-9, rtol=1e-4)
    g = torch.randn(10_000_019, dtype=torch.float64)
    chunks = make_chunks([(0, 6_000_000, True), (6_000_000, 10_000_019, False)])
    norm = global_norm(on_device(g), chunks)
    assert_close(norm, torch.linalg.vector_norm(g), "global norm", atol=0.0, rtol=1e-5)
