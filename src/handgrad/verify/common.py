"""What every check shares: a row of the table, the comparison against the float64 reference,
random inputs, and the tolerances."""
import math
from dataclasses import dataclass

import numpy as np

from ..backends import get_backend


TOL32 = 2e-5   # relative tolerance for float32 ops against a float64 reference
TOL64 = 1e-10  # ... for float64 ops


@dataclass
class Row:
    op: str
    quantity: str
    max_abs: float
    max_rel: float
    tol: float
    ok: bool
    where: tuple = ()

    def line(self):
        mark = "✅" if self.ok else "❌"
        where = f"  worst at {list(self.where)}" if (self.where and not self.ok) else ""
        return f"{self.op:<18} {self.quantity:<28} {self.max_abs:10.2e} {self.max_rel:10.2e} {self.tol:8.0e}  {mark}{where}"


def compare(op, quantity, got, ref, tol):
    """One Row: max abs error, and relative to the largest reference magnitude."""
    got = np.atleast_1d(np.asarray(got, dtype=np.float64))
    ref = np.atleast_1d(np.asarray(ref, dtype=np.float64))
    if got.shape != ref.shape:
        return Row(op, quantity, math.inf, math.inf, tol, False, ("shape", got.shape, ref.shape))
    if got.size == 0:
        return Row(op, quantity, 0.0, 0.0, tol, True)
    diff = np.abs(got - ref)
    diff[np.isnan(diff)] = np.inf
    max_abs = float(diff.max())
    scale = float(np.abs(ref).max())
    max_rel = max_abs / scale if scale > 0 else max_abs
    where = tuple(int(i) for i in np.unravel_index(int(np.argmax(diff)), diff.shape))
    return Row(op, quantity, max_abs, max_rel, tol, bool(max_rel <= tol), where)


# ---------------------------------------------------------------- helpers
def randn(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def torch64(x, requires_grad=False):
    """float64 torch leaf from a numpy array (the exact values handgrad saw)."""
    import torch
    t = torch.from_numpy(np.asarray(x, dtype=np.float64).copy())
    return t.requires_grad_(requires_grad)


def ops_for(backend):
    ops = get_backend(backend)
    return ops if backend == "cpu" else _HostArrays(ops)


class _HostArrays:
    """A device backend's ops called with NumPy arrays, so one check serves every backend: each
    array argument goes to the device (one tensor per array, so in-place calls stay in place),
    the op runs, every array argument is copied back (the ops write their outputs in place), and
    a 0-dim tensor result comes back as a float."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if not callable(fn) or isinstance(fn, type) or name in ("empty", "zeros", "to_numpy", "from_numpy"):
            return fn

        def call(*args, **kwargs):
            import torch
            sent = {}

            def send(a):
                if isinstance(a, tuple):  # rope=(cos, sin)
                    return tuple(map(send, a))
                if not isinstance(a, np.ndarray):
                    return a
                if id(a) not in sent:
                    sent[id(a)] = (a, self._ops.from_numpy(a))
                return sent[id(a)][1]
            result = fn(*map(send, args), **{k: send(v) for k, v in kwargs.items()})
            for host, dev in sent.values():
                if host.flags.writeable:
                    host[...] = self._ops.to_numpy(dev)
            if isinstance(result, torch.Tensor) and result.dim() == 0:
                return float(result)
            return result
        return call


def tol_for(dtype):
    return TOL64 if np.dtype(dtype) == np.float64 else TOL32

