"""crossentropy_backward with a dloss per row: dloss a (B, T) array w, the gradient of
sum_i w_i loss_i (preference tuning weights each sequence's token losses so), against torch
autograd in float64: float64 and float32 logits, in place and out of place, through a softcap,
bf16 logits (bounded by a multiple of PyTorch's own bf16 error, as test_bf16_cpu.py bounds it);
over awkward shapes (T = 1, V not a multiple of 64, V past the float32 kernels' CHUNK, B*T not a
multiple of the row block), some targets ignored. The single-number path is the same as an array
of that number, bit for bit."""
import numpy as np
import pytest

from handgrad.backends import cpu as ops
from handgrad.backends.cpu import crossentropy
from handgrad.backends.cpu.common import ROWS_PER_BLOCK

from helpers import forced_kernels

torch = pytest.importorskip("torch")
F = torch.nn.functional

F32, F64 = np.float32, np.float64
CAP = 5.0  # logits of scale 4: most of the tanh's range, some saturating (test_geglu_softcap.py's)
BOUND = 2.0  # handgrad's bf16 error <= BOUND x PyTorch autocast's (test_bf16_cpu.py's bound)
TOL = {F64: 1e-12, F32: 1e-6}  # max error relative to the largest reference gradient

SHAPES = [pytest.param((2, 7, 67), id="B2-T7-V67"),
          pytest.param((3, 1, 67), id="T1-V67"),
          pytest.param((1, 37, 1031), id="BT37-V1031"),  # V > CHUNK (512), B*T > and not a multiple of 32
          pytest.param((2, 19, 1000), id="BT38-V1000")]
assert crossentropy.CHUNK < 1000 and 37 % ROWS_PER_BLOCK and 38 % ROWS_PER_BLOCK


def _inputs(shape, dtype, seed):
    """(logits of scale 4, targets with some -1, per-row weights of both signs: NaN on ignored
    rows, which the op must not read, and the reference's weights with 0 there)."""
    rng = np.random.default_rng(seed)
    B, T, V = shape
    z = (rng.standard_normal(shape) * 4.0).astype(dtype)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    targets.flat[::3] = -1
    w = rng.standard_normal((B, T)) * rng.choice([1e-3, 1.0, 30.0], (B, T))
    ref_w = np.where(targets != -1, w, 0.0)
    w[targets == -1] = np.nan
    return z, targets, w, ref_w


def _torch_grad(z, targets, w, cap=None):
    """torch's gradient of sum_i w_i loss_i w.r.t. z in float64 (of the uncapped z with a cap)."""
    V = z.shape[-1]
    tz = torch.from_numpy(np.asarray(z, F64).copy()).requires_grad_(True)
    capped = torch.tanh(tz / cap) * cap if cap else tz
    losses = F.cross_entropy(capped.view(-1, V), torch.from_numpy(targets).long().view(-1), ignore_index=-1,
                             reduction="none")
    (losses * torch.from_numpy(np.asarray(w, F64)).view(-1)).sum().backward()
    return tz.grad.numpy()


def _handgrad_grad(z, targets, dloss, cap=0.0, out_of_place=False):
    """handgrad's dlogits as the model forms them: softcap in place (cap > 0), the loss's forward
    (filling lse), its backward in place, or into a distinct dlogits (then the logits must be
    left as they were)."""
    B, T, _ = z.shape
    buf = z.copy()
    if cap:
        ops.softcap_forward(buf, cap)
    losses = np.empty((B, T), F64 if z.dtype == F64 else F32)
    lse = np.empty((B, T), F64)
    ops.crossentropy_forward(losses, lse, buf, targets)
    if not out_of_place:
        ops.crossentropy_backward(buf, buf, lse, targets, dloss, softcap=cap)
        return buf
    seen = buf.copy()
    d = np.full_like(buf, 7)
    ops.crossentropy_backward(d, buf, lse, targets, dloss, softcap=cap)
    assert np.array_equal(buf, seen), "an out-of-place backward changed the logits"
    return d


def _check(got, ref, tol, where):
    scale = float(np.abs(ref).max())
    err = float(np.abs(np.asarray(got, F64) - ref).max())
    assert err <= tol * scale, f"{where}: max error {err:.3e} > {tol:g} x max |ref| {scale:.3e}"


@pytest.mark.parametrize("cap", [0.0, CAP], ids=["uncapped", "softcap"])
@pytest.mark.parametrize("out_of_place", [False, True], ids=["in-place", "out-of-place"])
@pytest.mark.parametrize("dtype", [F64, F32], ids=["float64", "float32"])
@pytest.mark.parametrize("shape", SHAPES)
def test_per_row_dloss_against_torch(shape, dtype, out_of_place, cap):
    z, targets, w, ref_w = _inputs(shape, dtype, seed=1)
    got = _handgrad_grad(z, targets, w, cap, out_of_place)
    ref = _torch_grad(z, targets, ref_w, cap)
    _check(got, ref, TOL[dtype], "dz")
    assert np.all(got[targets == -1] == 0.0), "ignored rows (NaN weights) must be exact zeros"


@pytest.mark.parametrize("dtype", [F64, F32], ids=["float64", "float32"])
def test_flat_dloss_reads_targets_row_order(dtype):
    """An array of targets.size elements in any shape: read in targets' row order."""
    z, targets, w, _ = _inputs((2, 7, 67), dtype, seed=2)
    want = _handgrad_grad(z, targets, w)
    same = [w.reshape(-1), w.reshape(7, 2), np.asfortranarray(w)] + [w.astype(F32)] * (dtype == F32)
    for flat in same:
        assert np.array_equal(_handgrad_grad(z, targets, flat), want)


def bf16(x):
    return ops.to_bf16(np.ascontiguousarray(x, dtype=F32))


@pytest.mark.parametrize("cap", [0.0, CAP], ids=["uncapped", "softcap"])
@pytest.mark.parametrize("shape", [(1, 37, 1031), (2, 19, 203)], ids=["BT37-V1031", "BT38-V203"])
def test_bf16_logits_cut_into_blocks(shape, cap, monkeypatch):
    """bf16 logits are widened a block of rows at a time (made 8 rows here, so the blocks cut the
    weights): the gradient is that of the float32 kernels on their widened values, narrowed, bit
    for bit; and within BOUND x PyTorch autocast's bf16 error of torch's float64 gradient."""
    monkeypatch.setattr(crossentropy, "bf16_block_rows", lambda: 8)
    z, targets, w, ref_w = _inputs(shape, F32, seed=3)
    z = ops.from_bf16(bf16(z))  # the lm_head's bf16 output, on every side
    dz16 = _handgrad_grad(bf16(z), targets, w, cap)
    # the float32 path on the widened values (capped and widened as the bf16 path caps them),
    # its gradient narrowed into a bf16 dlogits
    z32 = z.copy()
    if cap:
        capped16 = bf16(z)
        ops.softcap_forward(capped16, cap)
        z32 = ops.from_bf16(capped16)
    lse, losses = np.empty(shape[:2], F64), np.empty(shape[:2], F32)
    ops.crossentropy_forward(losses, lse, z32, targets)
    d16 = np.empty(shape, np.uint16)
    ops.crossentropy_backward(d16, z32, lse, targets, w, softcap=cap)
    assert np.array_equal(dz16, d16)

    ref = _torch_grad(z, targets, ref_w, cap)
    tz = torch.tensor(z, requires_grad=True)  # torch autocast's path: bf16 logits, the loss in float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = tz.to(torch.bfloat16)
        capped = (torch.tanh(x / cap) * cap if cap else x).float()
        pt_losses = F.cross_entropy(capped.view(-1, shape[-1]), torch.from_numpy(targets).long().view(-1),
                                    ignore_index=-1, reduction="none")
    (pt_losses * torch.tensor(ref_w, dtype=torch.float32).view(-1)).sum().backward()
    e_hg = float(np.abs(ops.from_bf16(dz16).astype(F64) - ref).max())
    e_pt = float(np.abs(tz.grad.double().numpy() - ref).max())
    scale = float(np.abs(ref).max())
    assert e_hg <= BOUND * e_pt and e_hg > 1e-6 * scale, \
        f"handgrad {e_hg:.3e}  pytorch {e_pt:.3e}  (|ref| max {scale:.2e})"


@pytest.mark.parametrize("cap", [0.0, CAP], ids=["uncapped", "softcap"])
@pytest.mark.parametrize("dtype", [F64, F32, np.uint16], ids=["float64", "float32", "bf16"])
def test_single_number_is_an_array_of_it(dtype, cap, monkeypatch):
    """dloss None (1/n), the number 1/n and a (B, T) array full of 1/n give the same bits."""
    monkeypatch.setattr(crossentropy, "bf16_block_rows", lambda: 8)
    z, targets, _, _ = _inputs((2, 19, 1000), F32 if dtype == np.uint16 else dtype, seed=4)
    if dtype == np.uint16:
        z = bf16(z)
    n = int((targets != -1).sum())
    want = _handgrad_grad(z, targets, None, cap)
    for dloss in (1.0 / n, np.float64(1.0 / n), np.full(targets.shape, 1.0 / n), np.full(1, 1.0 / n)):
        assert np.array_equal(_handgrad_grad(z, targets, dloss, cap), want)
        assert np.array_equal(_handgrad_grad(z, targets, dloss, cap, out_of_place=True), want)


@pytest.mark.parametrize("dtype", [F64, F32], ids=["float64", "float32"])
def test_serial_and_parallel_copies_agree(dtype):
    """The shapes above run the kernels' serial copies (common.kernel); forced onto each copy,
    per-row weights give the same bits."""
    z, targets, w, _ = _inputs((3, 37, 101), dtype, seed=5)
    got = {}
    for copy in ("serial", "parallel"):
        with forced_kernels(copy):
            got[copy] = [_handgrad_grad(z, targets, w, cap) for cap in (0.0, CAP)]
    for a, b in zip(got["serial"], got["parallel"]):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("dtype", [F64, F32, np.uint16], ids=["float64", "float32", "bf16"])
def test_wrong_size_dloss_raises(dtype):
    """A dloss array neither one element nor targets' size: ValueError naming targets' shape,
    before dlogits is written."""
    z = np.zeros((2, 3, 67), dtype)
    lse, targets = np.zeros((2, 3)), np.zeros((2, 3), np.int32)
    d = np.full_like(z, 7)
    for bad in (np.ones((2, 4)), np.ones(5), np.ones((3, 2, 1, 2))):
        with pytest.raises(ValueError, match=r"\(2, 3\)"):
            ops.crossentropy_backward(d, z, lse, targets, bad)
        assert np.all(d == 7)
