"""crossentropy_forward_backward, on the gpu llm.c's fused classifier (on the cpu the two calls): the
loss, the log-sum-exps and the mean loss's dlogits written over the logits in one pass, the same bits as
crossentropy_forward then crossentropy_backward (awkward V, ignored rows, softcap, the first V
columns of a wider buffer), and a training step's forward (grad=True) that uses it gives the
gradients of the unfused step. Without CUDA the gpu rows run in Triton's interpreter."""
import numpy as np
import pytest
import torch

from handgrad.backends import get_backend
from handgrad.config import GPTConfig, LlamaConfig
from handgrad.models.gpt2 import GPT
from handgrad.models.llama import Llama


def _inputs(V, width, seed):
    rng = np.random.default_rng(seed)
    z = np.full((2, 5, width), np.nan, np.float32)
    z[..., :V] = rng.standard_normal((2, 5, V)).astype(np.float32) * 4
    tgt = rng.integers(0, V, (2, 5)).astype(np.int32)
    tgt[0, 1] = tgt[1, 4] = -1
    return z, tgt


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("V,width,softcap", [(77, 77, 0.0), (1, 1, 0.0), (77, 128, 0.0), (300, 300, 7.0),
                                             (5000, 5056, 0.0)])
def test_fused_equals_forward_then_backward(backend, V, width, softcap):
    ops = get_backend(backend)
    z, tgt = _inputs(V, width, seed=V)
    out = []
    for fused in (False, True):
        buf = ops.from_numpy(z.copy())
        view = buf[..., :V]
        losses, lse = ops.empty((2, 5), np.float32), ops.empty((2, 5), ops.LSE_DTYPE)
        t = ops.from_numpy(tgt.copy())
        if softcap:
            ops.softcap_forward(buf, softcap)
        cap = {"softcap": softcap} if softcap else {}
        if fused:
            mean = ops.crossentropy_forward_backward(losses, lse, view, t, **cap)
        else:
            mean = ops.crossentropy_forward(losses, lse, view, t)
            ops.crossentropy_backward(view, view, lse, t, **cap)
        out.append((float(mean), ops.to_numpy(losses).copy(), ops.to_numpy(lse).copy(), ops.to_numpy(buf).copy()))
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)
    d = out[1][3]
    assert np.isnan(d[..., V:]).all() and not np.isnan(d[..., :V]).any()
    x = torch.tensor(z[..., :V], dtype=torch.float64, requires_grad=True)
    capped = softcap * torch.tanh(x / softcap) if softcap else x
    ref = torch.nn.functional.cross_entropy(capped.reshape(-1, V), torch.tensor(tgt).long().view(-1), ignore_index=-1)
    ref.backward()
    np.testing.assert_allclose(d[..., :V], x.grad.numpy(), rtol=0, atol=2e-6)
    assert abs(out[1][0] - ref.item()) <= 1e-5 * abs(ref.item())


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_a_given_dloss_for_every_row(backend):
    """A chunk's call (models/head.py): dloss one number for every row (the whole batch's 1/n), the same
    bits as the two calls with that dloss; anything but one number is refused."""
    ops = get_backend(backend)
    z, tgt = _inputs(300, 320, seed=3)
    dloss = np.float32(1 / 37)
    w = ops.from_numpy(np.array([dloss])) if backend == "gpu" else float(dloss)
    out = []
    for fused in (False, True):
        buf, t = ops.from_numpy(z.copy()), ops.from_numpy(tgt.copy())
        view = buf[..., :300]
        losses, lse = ops.empty((2, 5), np.float32), ops.empty((2, 5), ops.LSE_DTYPE)
        if fused:
            ops.crossentropy_forward_backward(losses, lse, view, t, w)
        else:
            ops.crossentropy_forward(losses, lse, view, t)
            ops.crossentropy_backward(view, view, lse, t, w)
        out.append(ops.to_numpy(buf).copy())
    np.testing.assert_array_equal(out[0], out[1])
    if backend == "gpu":
        with pytest.raises(ValueError, match="dloss must be None or a 1-element tensor"):
            ops.crossentropy_forward_backward(losses, lse, view, t, ops.from_numpy(np.ones((2, 5), np.float32)))


def test_cpu_float64_logits_fall_back_to_the_two_kernels():
    ops = get_backend("cpu")
    z, tgt = _inputs(33, 33, seed=1)
    z64 = z.astype(np.float64)
    a, b = z64.copy(), z64.copy()
    la, lb = np.empty((2, 5), np.float32), np.empty((2, 5), np.float32)
    ea, eb = np.empty((2, 5)), np.empty((2, 5))
    assert ops.crossentropy_forward_backward(la, ea, a, tgt) == ops.crossentropy_forward(lb, eb, b, tgt)
    ops.crossentropy_backward(b, b, eb, tgt)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("cls,config", [
    (GPT, GPTConfig(block_size=16, vocab_size=77, n_layer=1, n_head=2, n_embd=32)),
    (Llama, LlamaConfig(block_size=16, vocab_size=77, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, ffn_hidden=48,
                        tie_embeddings=False))])
def test_a_training_forward_uses_it_with_the_unfused_gradients(backend, cls, config):
    """forward(grad=True) (a training step's) against forward(grad=False): the same loss and every
    gradient bit for bit; and a backward(dloss=...) after a fused forward is refused."""
    rng = np.random.default_rng(0)
    idx, tgt = rng.integers(0, 77, (2, 11)), rng.integers(0, 77, (2, 11))
    tgt[1, :3] = -1
    out = []
    for grad in (False, True):
        model = cls(config, backend=backend, seed=4)
        loss = float(model.forward(idx, tgt, grad=grad))
        model.zero_grad()
        model.backward()
        out.append((loss, {k: np.array(v) for k, v in model.grads().items()}))
    assert out[0][0] == out[1][0]
    for k, g in out[0][1].items():
        np.testing.assert_array_equal(out[1][1][k], g, err_msg=k)
    model.forward(idx, tgt, grad=True)
    with pytest.raises(RuntimeError, match="formed the mean loss's gradient already"):
        model.backward(dloss=np.ones((2, 11), np.float32))
