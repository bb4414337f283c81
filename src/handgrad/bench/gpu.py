"""`handgrad bench ops --device gpu`: each gpu op beside PyTorch eager, torch.compile and (for
attention) scaled_dot_product_attention, in the same run, on the same tensors.

Rows (bench_ops_gpu lists them) cover GPT-2's and the Llama family's ops, each forward and backward,
and AdamW over a GPT-2-sized flat buffer. Before a row is timed, handgrad's output and gradients are
checked against PyTorch eager's: a row that disagrees stops the run with an error, since a benchmark
of a wrong kernel measures nothing. The matmuls are cuBLAS on both sides, so they are not rows here:
the whole step is `handgrad bench train`'s business (results: docs/PERFORMANCE.md, GPU).

Without CUDA, under TRITON_INTERPRET=1, the same code runs at tiny shapes on CPU tensors: that
checks the bench end to end (the tests do), but its times measure Triton's interpreter and mean
nothing, and the report says so.
"""
import json
import time

from ..backends import get_backend
from .common import Clock, check_close
from .gpu_rows import LLAMA_ROWS, ROWS


# (B, T, C, n_head, vocab, AdamW parameters): GPT-2 124M's widths at T 1024 on a GPU; tiny under
# the interpreter (~1.5 ms per Triton program instance there)
CUDA_SHAPE = dict(B=8, T=1024, C=768, NH=12, V=50257, P=124_439_808)
INTERPRET_SHAPE = dict(B=1, T=16, C=64, NH=2, V=100, P=4096)
# the Llama family's rows: smollm2-135m's widths (9 query heads on 3 kv heads, head size 64, SwiGLU
# 1536) on a GPU; under the interpreter 4 heads on 2, head size 16 (the flash kernels' smallest tile)
LLAMA_CUDA_SHAPE = dict(B=8, T=1024, C=576, NH=9, NKV=3, F=1536, theta=100000.0)
LLAMA_INTERPRET_SHAPE = dict(B=1, T=16, C=64, NH=4, NKV=2, F=48, theta=10000.0)
TOLERANCE = {"float32": 2e-3, "bfloat16": 3e-2}  # max |hg - torch| / max |torch|, over outputs and grads


def _compiled(torch, fn, enabled):
    """torch.compile(fn), or None with the reason when compile is off or fails."""
    if not enabled:
        return None, "off (--no-compile)"
    try:
        return torch.compile(fn), None
    except Exception as e:  # noqa: BLE001 - compile's failures are many and all mean "no column"
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:120]


def bench_row(cls, ops, torch, shape, dtype, repeat, compile_torch):
    """Check, then time one op; two result rows (fwd, bwd). On CUDA the timing is CUDA events around
    `repeat` back-to-back calls (one synchronisation per measurement, not per call); torch's backward
    is timed call by call, each after an untimed forward, since autograd needs a fresh graph per
    backward."""
    tdtype = getattr(torch, dtype)
    row = cls(ops, torch, shape, tdtype)
    host = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    err = check_close(row.name, [(label, host(h), host(t)) for label, h, t in row.check_pairs()], TOLERANCE[dtype])
    clock = Clock(torch, torch.cuda.is_available())
    hg = [clock.mean(row.hg_forward, repeat), clock.mean(row.hg_backward, repeat)]
    sides = {"handgrad": hg}
    variants = [("torch", row.torch_fn)]
    fn, why = _compiled(torch, row.torch_fn, compile_torch)
    if fn is not None:
        variants.append(("torch.compile", fn))
    if row.sdpa is not None:
        variants.append(("sdpa", row.sdpa))
    notes = {} if why is None else {"torch.compile": why}
    for name, f in variants:
        leaves = [leaf.detach().clone().requires_grad_(True) for leaf in row.leaves]
        try:
            fwd = clock.mean(lambda: f(*leaves), repeat)
            bwd = clock.backward(lambda: f(*leaves), row.dy, repeat)
        except Exception as e:  # noqa: BLE001 - e.g. compile's backend missing at first call
            notes[name] = f"{type(e).__name__}: {e}".splitlines()[0][:120]
            continue
        sides[name] = [fwd, bwd]
    rows = []
    for i, phase in enumerate(("fwd", "bwd")):
        r = {"name": row.name, "phase": phase, "dtype": dtype, "max_rel_err": err, "repeat": repeat,
             "ms": {k: v[i] * 1e3 for k, v in sides.items()}, "notes": notes}
        r["ratio"] = {k: v[i] / hg[i] for k, v in sides.items() if k != "handgrad"}
        rows.append(r)
    return rows


def bench_adamw(ops, torch, shape, repeat):
    """handgrad's fused AdamW (one kernel over the flat buffer) against torch.optim.AdamW's fused
    (CUDA) or foreach implementation over the same number of parameters, as 12 tensors."""
    P = shape["P"]
    dev = ops.device()
    g = torch.Generator(device="cpu").manual_seed(4)
    params, grads = (torch.randn(P, generator=g).to(dev) for _ in range(2))
    m, v = torch.zeros_like(params), torch.zeros_like(params)
    chunks = ops.make_chunks([(0, P, True)])
    step = [0]

    def hg():
        step[0] += 1
        ops.adamw_update(params, grads, m, v, chunks, step[0], 1e-4, 0.9, 0.95, 1e-8, 0.1)

    tparams = [torch.nn.Parameter(t) for t in params.detach().clone().chunk(12)]
    for t, gr in zip(tparams, grads.chunk(12)):
        t.grad = gr.clone()
    kind = "fused" if torch.cuda.is_available() else "foreach"
    opt = torch.optim.AdamW(tparams, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **{kind: True})
    clock = Clock(torch, torch.cuda.is_available())
    t_hg, t_torch = clock.mean(hg, repeat), clock.mean(opt.step, repeat)
    return [{"name": f"adamw P={P:,}", "phase": "step", "dtype": "float32", "max_rel_err": None, "repeat": repeat,
             "ms": {"handgrad": t_hg * 1e3, f"torch ({kind})": t_torch * 1e3}, "notes": {},
             "ratio": {f"torch ({kind})": t_torch / t_hg}}]


def bench_ops_gpu(repeat, as_json, dtype="bfloat16", compile_torch=True):
    """`handgrad bench ops --device gpu`: every row, then a table or JSON. Rows: layernorm, GELU with
    its bias fused, causal attention (the flash kernels), fused softmax + cross-entropy at GPT-2's
    widths; RMSNorm, RoPE, grouped-query attention (beside SDPA with enable_gqa, which reads the kv
    heads without repeating them), the same with RoPE fused into its kernels (as the model trains:
    torch rotates first) and SwiGLU at the Llama family's (smollm2-135m's); AdamW (bench_adamw)."""
    from ..backends.gpu.common import GPUUnavailable, device, interpreting
    from ..torch_ref import require_torch
    torch = require_torch()
    try:
        device()
    except GPUUnavailable as e:
        raise SystemExit(f"bench ops --device gpu: {e}") from None
    ops = get_backend("gpu")
    shape = INTERPRET_SHAPE if interpreting() else CUDA_SHAPE
    llama_shape = LLAMA_INTERPRET_SHAPE if interpreting() else LLAMA_CUDA_SHAPE
    repeat = repeat or (2 if interpreting() else 50)
    t_start = time.perf_counter()
    rows = []
    for cls in ROWS:
        rows += bench_row(cls, ops, torch, shape, dtype, repeat, compile_torch)
    for cls in LLAMA_ROWS:
        rows += bench_row(cls, ops, torch, llama_shape, dtype, repeat, compile_torch)
    rows += bench_adamw(ops, torch, shape, repeat)
    result = {"backend": "gpu", "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "interpreter": interpreting(), "torch": torch.__version__, "triton": _triton_version(),
              "dtype": dtype, "shape": shape, "llama_shape": llama_shape, "tolerance_rel": TOLERANCE[dtype], "rows": rows,
              "seconds": time.perf_counter() - t_start}
    print(json.dumps(result, indent=2, default=float) if as_json else format_table(result))
    return 0


def _triton_version():
    import triton
    return triton.__version__


def format_table(result):
    s, ls = result["shape"], result["llama_shape"]
    lines = [f"device   {result['device']}; torch {result['torch']}, triton {result['triton']}; "
             f"activations {result['dtype']}",
             f"shape    B {s['B']}, T {s['T']}, C {s['C']}, heads {s['NH']}, vocab {s['V']}; AdamW over {s['P']:,}",
             f"llama    B {ls['B']}, T {ls['T']}, C {ls['C']}, heads {ls['NH']} on {ls['NKV']} kv heads, SwiGLU "
             f"{ls['F']}, rope_theta {ls['theta']:g}"]
    if result["interpreter"]:
        lines.append("WARNING: TRITON_INTERPRET=1 on the CPU: every kernel ran in Triton's interpreter, so these "
                     "times measure the interpreter, not the kernels (a functional run only)")
    cols = []
    for r in result["rows"]:
        cols += [k for k in r["ms"] if k not in cols]
    lines += ["", f"{'row':<30} {'phase':<5} " + " ".join(f"{c:>15}" for c in cols) + f" {'check':>8}"]
    for r in result["rows"]:
        cells = []
        for c in cols:
            if c not in r["ms"]:
                cells.append(f"{'-':>15}")
            elif c == "handgrad":
                cells.append(f"{r['ms'][c]:>12.3f} ms")
            else:
                cells.append(f"{r['ms'][c]:>8.3f} {r['ratio'][c]:>5.2f}x")
        err = "" if r["max_rel_err"] is None else f"{r['max_rel_err']:.1e}"
        lines.append(f"{r['name']:<30} {r['phase']:<5} " + " ".join(cells) + f" {err:>8}")
    notes = {k: v for r in result["rows"] for k, v in r["notes"].items()}
    lines += ["", "each torch column: its time in ms, then its time / handgrad's (> 1: handgrad faster); "
                  "torch's bwd: its backward alone, a fresh forward made untimed before each",
              f"check = max |handgrad - torch eager| / max |torch eager| over the output and gradients "
              f"(tolerance {result['tolerance_rel']:g})"]
    lines += [f"{k}: not timed, {v}" for k, v in notes.items()]
    lines.append(f"total {result['seconds']:.0f} s")
    return "\n".join(lines)

