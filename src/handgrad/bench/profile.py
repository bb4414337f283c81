"""`handgrad bench train --profile`: handgrad's step with every op timed (and the part of each spent
in BLAS), grouped by op family, and the FLOPs of attention's per-head kernels for the matmul floor."""
import time
from collections import defaultdict


class Profiler:
    """Wraps a backend module: every op call is timed, by op name. model.ops = Profiler(ops)."""

    PLAIN = ("empty", "zeros", "to_numpy", "from_numpy", "make_chunks")

    def __init__(self, ops):
        self._ops = ops
        self.seconds = defaultdict(float)
        self.calls = defaultdict(int)
        self.blas_seconds = defaultdict(float)  # time inside blas.gemm, by the op that called it
        self.current = None

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if name in self.PLAIN or not callable(fn):
            return fn

        def timed(*args, **kwargs):
            self.current = name
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1
            return out
        return timed

    def timed_gemm(self, gemm):
        """blas.gemm, timed into blas_seconds under the op being run."""
        def timed(a, b, c, beta=0.0):
            t0 = time.perf_counter()
            out = gemm(a, b, c, beta)
            self.blas_seconds[self.current] += time.perf_counter() - t0
            return out
        return timed


def head_kernel_flop(forward, B, T, C, block):
    """FLOPs of the products attention's per-head kernels run (attention.forward_heads,
    backward_heads: all heads, hs NH = C), causal in blocks of `block` query rows. Row block
    [r0, r1): forward S = q k^T and y = P v over keys [0, r1), 2 C (r1 - r0) r1 each; backward
    dP = dy v^T and dq = dS k over the same, dv = P^T dy and dk = dS^T q over rows [r0, T),
    2 C (r1 - r0) (T - r0) each. With one block (T <= block) that is the full T x T."""
    rows = cols = 0
    for r0 in range(0, T, block):
        r1 = min(T, r0 + block)
        rows += (r1 - r0) * r1
        cols += (r1 - r0) * (T - r0)
    return 2 * B * C * (2 * rows if forward else 2 * rows + 2 * cols)


def _family(op):
    if op in ("adamw_update", "global_norm"):
        return "optimizer", "step"
    if op.endswith("_forward_backward"):  # a training forward's loss and its gradient in one call
        return op[:-len("_forward_backward")], "fwd+bwd"
    for phase in ("forward", "backward"):
        if op.endswith("_" + phase):
            return op[: -len(phase) - 1], phase
    return op, "-"


def format_profile(prof):
    total = prof["step_s"]
    fam, fam_blas = defaultdict(float), defaultdict(float)
    for op, v in prof["ops"].items():
        fam[_family(op)] += v["s"]
        fam_blas[_family(op)] += v.get("blas_s", 0.0)
    lines = [f"  handgrad profile ({1e3 * total:.1f} ms per step, op calls timed; 'in BLAS': the part "
             f"inside blas.gemm, which attention's per-head kernels on MKL do not call):",
             f"    {'op family':<20} {'phase':<8} {'ms/step':>8} {'share':>6} {'in BLAS':>8}"]
    for (name, phase), s in sorted(fam.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {name:<20} {phase:<8} {1e3 * s:>8.2f} {100 * s / total:>5.1f}% "
                     f"{1e3 * fam_blas[name, phase]:>8.2f}")
    blas_total = sum(fam_blas.values())
    lines.append(f"    {'all ops':<20} {'':<8} {1e3 * sum(fam.values()):>8.2f} {'':>6} {1e3 * blas_total:>8.2f}"
                 f"  (outside BLAS: {1e3 * (sum(fam.values()) - blas_total):.2f})")
    rest = total - sum(fam.values())
    lines.append(f"    {'outside the ops':<20} {'':<8} {1e3 * rest:>8.2f} {100 * rest / total:>5.1f}%")
    mm = prof.get("matmuls")
    if mm:
        per_head = (f" ({mm['attention_calls']} of them attention's per-head kernels without the softmax)"
                    if mm.get("attention_calls") else "")
        lines.append(f"  matmul floor: the step's {mm['calls']} BLAS calls{per_head} alone, replayed back to back, take "
                     f"{1e3 * mm['s']:.1f} ms ({mm['flop'] / mm['s'] / 1e9:.0f} GFLOP/s of the products as computed), "
                     f"{100 * mm['s'] / total:.0f}% of handgrad's step")
    return lines

