"""`handgrad bench products`: a model's matrix products on the libraries that could run them.

For each linear of a preset's model at its benchmark batch (bench train's shapes), the three
products of a training step, x (N, C) and g (N, OC) over the N = B T tokens:

    forward          y  = x W            (N, C) @ (C, OC)
    input gradient   dx = g W^T          (N, OC) @ (OC, C), W read transposed
    weight gradient  dW = x^T g          (C, N) @ (N, OC), x read transposed

each timed on MKL's sgemm, oneDNN's float32 matmul and oneDNN's matmul with bf16 operands
(time_product), checked before it is timed. The totals weigh each product by the time it takes,
as a step does (the lm_head's counted once per step like the others)."""
import json
import time

import numpy as np

from ..backends.cpu import blas, common, onednn
from ..config import load_run_config
from ..machine import BackgroundLoad, cpu_model
from .common import check_close, fmt_load
from .train import SHAPES

SIDES = ("mkl f32", "onednn f32", "onednn bf16")
CHUNKS, WARMUP, MIN_SECONDS = 4, 2, 0.4


def linears(preset):
    """[(name, C, OC, count per step)] of the preset's model, and N = B T, from bench train's shapes."""
    shape = SHAPES[preset]
    m = load_run_config(shape["preset"]).gpt_config(shape["vocab_size"])
    N = shape["batch_size"] * shape["T"]
    C, L, V = m.n_embd, m.n_layer, m.vocab_size
    if hasattr(m, "ffn_hidden"):  # the Llama family
        hs = C // m.n_head
        out = [("qkv", C, (m.n_head + 2 * m.n_kv_head) * hs, L), ("o", m.n_head * hs, C, L),
               ("gate|up", C, 2 * m.ffn_hidden, L), ("down", m.ffn_hidden, C, L)]
    else:
        out = [("c_attn", C, 3 * C, L), ("c_proj", C, C, L), ("c_fc", C, 4 * C, L), ("mlp.c_proj", 4 * C, C, L)]
    return out + [("lm_head", C, V, 1)], N


def _operands(rng, M, K, N, trans_a, trans_b):
    """a (M, K) and b (K, N) float32, each a transposed view where the product reads it so."""
    a = common.aligned_empty((K, M) if trans_a else (M, K))
    b = common.aligned_empty((N, K) if trans_b else (K, N))
    a[...] = rng.standard_normal(a.shape, dtype=np.float32)
    b[...] = rng.standard_normal(b.shape, dtype=np.float32)
    return (a.T if trans_a else a), (b.T if trans_b else b)


def _bf16(x):
    """x's bf16 bits with x's orientation (a transposed view stays one)."""
    return onednn.to_bf16(x.T).T if not x.flags.c_contiguous else onednn.to_bf16(x)


def time_product(M, K, N, trans_a=False, trans_b=False, seed=0):
    """{side: median seconds} of one (M, K) @ (K, N) product on each side, checked first.

    The sides: MKL's sgemm (float32; blas.blas_gemm, what handgrad runs on Intel's CPUs), oneDNN's
    matmul in float32, and oneDNN's matmul with bf16 operands and float32 accumulation (onednn.py;
    the operands narrowed beforehand, outside the timing: what `train.dtype = "bfloat16"` feeds it).
    float32 is checked against float64 at 1e-4 of the largest value, bf16 against float64 products
    of the same bf16 operands at 1e-4. The sides alternate in chunks (common.race); a row's GFLOP/s
    is 2 M K N over its median time."""
    rng = np.random.default_rng(seed)
    a, b = _operands(rng, M, K, N, trans_a, trans_b)
    a16, b16 = _bf16(a), _bf16(b)
    c = common.aligned_empty((M, N))
    calls = {"mkl f32": lambda: blas.blas_gemm(a, b, c), "onednn f32": lambda: onednn.gemm(a, b, c),
             "onednn bf16": lambda: onednn.gemm(a16, b16, c)}
    rows = slice(0, min(M, 16))
    ref32 = a[rows].astype(np.float64) @ b.astype(np.float64)
    ref16 = onednn.from_bf16(a16[rows]).astype(np.float64) @ onednn.from_bf16(b16).astype(np.float64)
    for side, call in calls.items():
        call()
        check_close(f"products {M}x{K}x{N} on {side}", [("c", c[rows], ref16 if "bf16" in side else ref32)])
    one = {side: min(_once(call) for _ in range(WARMUP)) for side, call in calls.items()}
    repeat = max(2, int(MIN_SECONDS / max(sum(one.values()), 1e-6)))
    times = {side: [] for side in calls}
    for _ in range(CHUNKS):
        for side, call in calls.items():
            times[side] += [_once(call) for _ in range(-(-repeat // CHUNKS))]
    return {side: float(np.median(t)) for side, t in times.items()}


def _once(call):
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def bench_products(presets, as_json=False):
    """Time every preset's products; print a table per preset (or one JSON object). Returns 0."""
    unknown = [p for p in presets if p not in SHAPES]
    if unknown:
        raise SystemExit(f"bench products: unknown preset {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    try:
        onednn.load()
    except onednn.OneDNNError as e:
        raise SystemExit(f"bench products: {e}") from None
    results = []
    with BackgroundLoad() as load:
        for preset in presets:
            lins, N = linears(preset)
            rows, total = [], {s: 0.0 for s in SIDES}
            flops_total = 0.0
            for name, C, OC, count in lins:
                for phase, (M, K, Nn, ta, tb) in (("forward", (N, C, OC, False, False)),
                                                 ("input grad", (N, OC, C, False, True)),
                                                 ("weight grad", (C, N, OC, True, False))):
                    t = time_product(M, K, Nn, ta, tb)
                    flops = 2.0 * M * K * Nn
                    rows.append({"linear": name, "phase": phase, "M": M, "K": K, "N": Nn, "count": count,
                                 "gflops": {s: flops / t[s] / 1e9 for s in SIDES}})
                    for s in SIDES:
                        total[s] += count * t[s]
                    flops_total += count * flops
            results.append({"preset": preset, "tokens": N, "rows": rows,
                            "step_products_s": total, "step_gflops": {s: flops_total / total[s] / 1e9 for s in SIDES}})
    out = {"cpu": cpu_model(), "bf16_path": onednn.bf16_path(), "onednn": onednn.version(), "blas": blas.name(),
           "background_cores": load.cores, "results": results}
    if as_json:
        print(json.dumps(out))
        return 0
    for r in results:
        print(f"\n{r['preset']}: the products of one training step at {r['tokens']} tokens (GFLOP/s)")
        print(f"  {'linear':12s} {'product':12s} {'M x K x N':>20s}  " + "  ".join(f"{s:>12s}" for s in SIDES))
        for row in r["rows"]:
            dims = f"{row['M']}x{row['K']}x{row['N']}"
            print(f"  {row['linear']:12s} {row['phase']:12s} {dims:>20s}  "
                  + "  ".join(f"{row['gflops'][s]:12.0f}" for s in SIDES))
        s = r["step_products_s"]
        print(f"  a step's products: " + ", ".join(f"{k} {s[k] * 1e3:.0f} ms ({r['step_gflops'][k]:.0f} GFLOP/s)"
                                                 for k in SIDES)
              + f"; bf16 / mkl f32 {s['mkl f32'] / s['onednn bf16']:.2f}x, onednn f32 / mkl f32 "
                f"{s['mkl f32'] / s['onednn f32']:.2f}x")
    print(f"\nmachine {out['cpu']}; bf16 path {out['bf16_path']}; oneDNN {out['onednn']}; handgrad's float32 BLAS "
          f"{out['blas']}; background load {fmt_load(load.cores)} cores")
    return 0
