"""The fused decoding step (backends' llama_decode_forward, which LlamaKVCache.step and step_rows run)
against the op-by-op step it replaces (LlamaKVCache.fused = False: rmsnorm_linear, rope, the decode
attention, linear, residual and swiglu ops, one call each a layer): the same logits and the same
cache, bit for bit, for float32 and bf16 weights, Llama and Qwen2 (qkv bias), grouped heads that
are not a power of two, one row and rows at different positions in a bigger cache; and its bad
arguments named."""
import numpy as np
import pytest

from handgrad.backends import cpu
from handgrad.backends.cpu import llama_decode
from handgrad.config import LlamaConfig
from handgrad.models.llama import Llama

CONFIGS = {
    "llama": LlamaConfig(block_size=40, vocab_size=203, n_layer=3, n_head=6, n_kv_head=2, n_embd=72,
                         ffn_hidden=120),
    "qwen2": LlamaConfig(block_size=40, vocab_size=203, n_layer=2, n_head=9, n_kv_head=3, n_embd=54,
                         ffn_hidden=100, qkv_bias=True, tie_embeddings=False),
}


def _model(name):
    model = Llama(CONFIGS[name], seed=1)
    rng = np.random.default_rng(0)
    model.params[:] = rng.standard_normal(model.num_params, dtype=np.float32) * np.float32(0.2)
    return model


def _steps(model, fused, dtype, B, idx):
    """Prefill idx[:, :5], then 6 steps; (logits of every step, k cache, v cache)."""
    cache = model.KV_CACHE(model, B, 12, dtype=dtype)
    cache.fused = fused
    cache.prefill(idx[:, :5])
    out = [cache.step(idx[:, t]).copy() for t in range(5, 11)]
    return np.stack(out), cache.k.copy(), cache.v.copy()


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("B", [1, 3])
def test_fused_step_is_the_op_path_bit_for_bit(name, dtype, B):
    model = _model(name)
    idx = np.random.default_rng(1).integers(0, model.config.vocab_size, (B, 11))
    fused, ops = _steps(model, True, dtype, B, idx), _steps(model, False, dtype, B, idx)
    for got, want in zip(fused, ops):
        np.testing.assert_array_equal(got, want)
    assert np.isfinite(fused[0]).all() and np.abs(fused[0]).max() > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_rows_fused_is_the_op_path(dtype):
    """Sequences at different positions in rows of a 4-row cache (serve's batched step)."""
    model = _model("qwen2")
    V = model.config.vocab_size
    rng = np.random.default_rng(2)
    results = []
    for fused in (True, False):
        cache = model.KV_CACHE(model, 4, 20, dtype=dtype)
        cache.fused = fused
        one = model.KV_CACHE(model, 1, 20, dtype=dtype, share=cache)
        lengths = {1: 3, 3: 7, 0: 1}
        for slot, n in lengths.items():
            one.prefill(np.random.default_rng(slot).integers(0, V, (1, n)))
            cache.load_row(slot, one)
        slots, positions = np.array([3, 0, 1]), np.array([7, 1, 3])
        logits = []
        for _ in range(4):
            logits.append(cache.step_rows(rng.integers(0, V, 3), slots, positions).copy())
            positions = positions + 1
        rng = np.random.default_rng(2)
        results.append((np.stack(logits), cache.k.copy(), cache.v.copy()))
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)


def test_bad_arguments_are_named():
    model = _model("llama")
    cache = model.KV_CACHE(model, 1, 12)
    cache.prefill(np.array([[1, 2, 3]]))
    s = cache._bufs(1)
    cache.step(np.array([4]))  # builds the weight views, laid out once (llama_decode_layers)
    laid_out = cache._layers
    cache.step(np.array([5]))
    assert cache._layers is laid_out and isinstance(laid_out, llama_decode.DecodeLayers)
    layers = laid_out.layers
    c = model.config
    args = (cache.k, cache.v, 4, None, model.cos, model.sin, c.n_head, c.n_kv_head, c.norm_eps)
    bad = dict(layers, wo=layers["wo"][:-1])
    with pytest.raises(ValueError, match="wo must be 3 transposed contiguous"):
        cpu.llama_decode_forward(s.x, bad, *args)
    with pytest.raises(ValueError, match="norm2 must hold 3 vectors"):
        cpu.llama_decode_forward(s.x, dict(layers, norm2=layers["norm2"][:-1]), *args)
    with pytest.raises(ValueError, match="do not fit 5 heads"):
        cpu.llama_decode_forward(s.x, laid_out, *args[:6], 5, c.n_kv_head, c.norm_eps)
    with pytest.raises(ValueError, match="pos must be in"):
        cpu.llama_decode_forward(s.x, laid_out, cache.k, cache.v, 12, *args[3:])
    with pytest.raises(ValueError, match="do not fit"):  # another model's caches (4 layers)
        cpu.llama_decode_forward(s.x, laid_out, np.concatenate([cache.k, cache.k[:1]]),
                                 np.concatenate([cache.v, cache.v[:1]]), *args[2:])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_thread_and_a_team_give_the_same_bits(dtype):
    """The step's one parallel region (backends/cpu/team.py) on one thread, where the lone member
    does every part, against two members splitting the products and the heads: one result."""
    import numba
    model = _model("llama")
    idx = np.random.default_rng(3).integers(0, model.config.vocab_size, (3, 11))
    team = _steps(model, True, dtype, 3, idx)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        alone = _steps(model, True, dtype, 3, idx)
    finally:
        numba.set_num_threads(threads)
    for got, want in zip(alone, team):
        np.testing.assert_array_equal(got, want)


def test_the_gpu_block_agrees_with_the_cpu_op():
    """The gpu backend's decoding step (the family's block, op by op; Triton's interpreter without
    CUDA) against the cpu's fused op, through step_rows on Qwen2's shape (qkv bias)."""
    pytest.importorskip("triton")
    config = LlamaConfig(block_size=16, vocab_size=65, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=96,
                         qkv_bias=True, tie_embeddings=False)  # the gpu attention's head size: a power of two >= 16
    cpu_model = Llama(config, seed=1)
    gpu_model = Llama(config, backend="gpu", seed=1)
    gpu_model.load_state_dict(cpu_model.state_dict())
    V = cpu_model.config.vocab_size
    out = []
    for model in (cpu_model, gpu_model):
        cache = model.KV_CACHE(model, 3, 12)
        cache.prefill(np.random.default_rng(4).integers(0, V, (3, 4)))
        out.append(np.stack([cache.step_rows([5 + i, 7, 9], [2, 0, 1], [4 + i, 4 + i, 4 + i]).copy()
                             for i in range(2)]))
    np.testing.assert_allclose(out[1], out[0], rtol=1e-4, atol=1e-4)
