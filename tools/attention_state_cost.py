"""Saved-state cost at T=256 (docs/PERFORMANCE.md): attention.py (keeps (B,NH,T,T) probabilities) vs
gqa_attention.py with n_kv_head = n_head (keeps (B,NH,T) logsumexps, recomputes P in the backward). mid's shape."""
import time, numpy as np
from handgrad.backends import cpu as ops
B, T, NH, hs = 8, 256, 8, 64
C = NH * hs
rng = np.random.default_rng(0)
qkv = ops.empty((B, T, 3 * C)); qkv[...] = rng.standard_normal(qkv.shape, dtype=np.float32)
dout = ops.empty((B, T, C)); dout[...] = rng.standard_normal(dout.shape, dtype=np.float32)
out, dqkv = ops.empty((B, T, C)), ops.empty(qkv.shape)
att_p = ops.empty(ops.attention_state_shape(B, NH, T)); att_l = ops.empty(ops.gqa_attention_state_shape(B, NH, T))
def run(f, n=30):
    f(); ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return np.median(ts) * 1e3, min(ts) * 1e3
for rep in range(2):
    a = run(lambda: ops.attention_forward(out, att_p, qkv, NH)); ab = run(lambda: ops.attention_backward(dqkv, dout, qkv, att_p, NH, out=out))
    g = run(lambda: ops.gqa_attention_forward(out, att_l, qkv, NH, NH)); gb = run(lambda: ops.gqa_attention_backward(dqkv, dout, qkv, att_l, NH, NH))
    print(f"probabilities kept: fwd {a[0]:.2f} ms (min {a[1]:.2f}), bwd {ab[0]:.2f} (min {ab[1]:.2f}); state {att_p.nbytes/2**20:.1f} MiB")
    print(f"logsumexp kept:     fwd {g[0]:.2f} ms (min {g[1]:.2f}), bwd {gb[0]:.2f} (min {gb[1]:.2f}); state {att_l.nbytes/2**20:.3f} MiB")
