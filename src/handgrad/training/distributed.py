"""Data parallelism on torch.distributed: gloo between CPU processes, NCCL between GPUs.

`torchrun --nproc_per_node N -m handgrad train ...` starts N copies of the trainer; torchrun sets
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Each rank reads its
own rows of every global batch, runs forward and backward on them, and then:

  zero_stage 0   the gradient buffer is all-reduced (SUM) in per-block buckets, each started as
                 soon as the backward has finished that block; every rank applies the same AdamW
                 update to the whole buffer.
  zero_stage 1   the buffer is reduce-scattered: rank r receives the sum of its 1/N slice, keeps
                 AdamW moments for that slice only, updates it, and the weights are all-gathered.

The 1/N of the mean is folded into AdamW's grad_scale (no extra pass over the buffer). Without
WORLD_SIZE > 1 nothing here imports torch: a single process needs neither torch nor torchrun.
"""
import os
from datetime import timedelta

import numpy as np


class DistributedError(ValueError):
    """A rank lost contact with the others, or the process group could not start."""


_LOST = []  # set when a collective failed: the process group can no longer be shut down cleanly


def exit_if_lost(code):
    """After a lost peer, leave at once: tearing the broken process group down can abort or hang
    (gloo's destructor with work in flight), and nothing is left to save."""
    if _LOST:
        import sys
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _env_int(name, default):
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"environment variable {name}={value!r} is not an integer; launch with "
                               f"torchrun, which sets it") from None


class DataParallel:
    """This process's place among the ranks, and the collectives one training step needs.

    With world_size 1 every collective is a no-op and torch is never imported.
    """

    def __init__(self, device="cpu", timeout_s=300.0):
        self.rank = _env_int("RANK", 0)
        self.world_size = _env_int("WORLD_SIZE", 1)
        self.local_rank = _env_int("LOCAL_RANK", 0)
        self.local_world_size = _env_int("LOCAL_WORLD_SIZE", self.world_size)
        self.timeout_s = timeout_s
        self.is_main = self.rank == 0
        self._pending = []  # async all-reduces started during the backward
        self._dist = None
        if self.world_size > 1:
            self._init_process_group(device)

    def _init_process_group(self, device):
        try:
            import torch.distributed as dist

            import torch
        except ImportError:
            raise DistributedError("WORLD_SIZE > 1 (a torchrun launch) needs PyTorch for torch.distributed: "
                                   "pip install torch (a single process needs neither)") from None
        if not dist.is_available():
            raise DistributedError(f"this PyTorch build ({torch.__version__}) has no torch.distributed; "
                                   f"install one that has")
        backend = "gloo"
        if device == "gpu":
            from ..backends.gpu.common import interpreting
            if not interpreting():  # (under Triton's interpreter the gpu backend's tensors are on the CPU)
                backend = "nccl"
                torch.cuda.set_device(self.local_rank)  # one GPU per local rank

        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(var):
                raise DistributedError(f"WORLD_SIZE is {self.world_size} but {var} is not set; launch with "
                                       f"torchrun --nproc_per_node N -m handgrad train ...")
        try:
            dist.init_process_group(backend, rank=self.rank, world_size=self.world_size,
                                    timeout=timedelta(seconds=self.timeout_s))
        except (RuntimeError, ValueError) as e:
            raise DistributedError(f"rank {self.rank}: cannot join the process group at "
                                   f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
                                   f"({_first_line(e)})") from None
        self._torch, self._dist = torch, dist

    # ------------------------------------------------------------ helpers
    def _tensor(self, array):
        """A torch view (no copy) of a backend buffer: NumPy arrays are wrapped, tensors pass."""
        return self._torch.from_numpy(array) if isinstance(array, np.ndarray) else array

    def _collective(self, what, fn):
        try:
            return fn()
        except RuntimeError as e:  # gloo/NCCL errors, DistBackendError and timeouts included
            _LOST.append(what)
            raise DistributedError(
                f"rank {self.rank}: lost contact with the other ranks during {what} ({_first_line(e)}); "
                f"another rank died, or hung past train.dist_timeout ({self.timeout_s:g} s)") from None

    def shard(self, padded_size):
        """This rank's [lo, hi) of a flat buffer padded to a multiple of world_size."""
        n = padded_size // self.world_size
        return self.rank * n, (self.rank + 1) * n

    def rows(self, batch_size):
        """This rank's rows of a global batch of world_size * batch_size sequences."""
        return slice(self.rank * batch_size, (self.rank + 1) * batch_size)

    # ------------------------------------------------------------ collectives
    def grads_ready(self, model):
        """A model.backward(grads_ready=...) hook (zero_stage 0): all-reduce each finished bucket
        while the backward computes the next. None for one process."""
        if self._dist is None:
            return None
        grad = self._tensor(model.flat_grad)

        def start(lo, hi):
            work = self._collective("the gradient all-reduce",
                                    lambda: self._dist.all_reduce(grad[lo:hi], async_op=True))
            self._pending.append(work)
        return start

    def finish_gradients(self, model, zero_stage):
        """Complete the reduction of the gradient buffer: wait for the buckets (stage 0), or
        reduce-scatter it so this rank's slice holds the sum over ranks (stage 1)."""
        if self._dist is None:
            return
        pending, self._pending = self._pending, []
        for work in pending:
            self._collective("the gradient all-reduce", work.wait)
        if zero_stage == 1:
            grad = self._tensor(model.flat_grad)
            lo, hi = self.shard(grad.numel())
            self._collective("the gradient reduce-scatter",
                             lambda: self._dist.reduce_scatter_tensor(grad[lo:hi], grad))

    def gather(self, part, full):
        """All-gather every rank's equal slice `part` into `full` (part may be full's own slice:
        the ZeRO-1 weights after each rank updated its own)."""
        if self._dist is None:
            full[:] = part
            return full
        self._collective("an all-gather", lambda: self._dist.all_gather_into_tensor(self._tensor(full),
                                                                                    self._tensor(part)))
        return full

    def broadcast(self, array, src=0):
        """Overwrite `array` on every rank with rank src's."""
        if self._dist is not None:
            self._collective("a broadcast", lambda: self._dist.broadcast(self._tensor(array), src))
        return array

    def sum(self, values):
        """Sum float64 scalars over the ranks (one small all-reduce): losses, squared norms, flags."""
        values = np.asarray(values, dtype=np.float64)
        if self._dist is None:
            return values
        out = values.copy()
        self._collective("a scalar all-reduce", lambda: self._dist.all_reduce(self._tensor(out)))
        return out

    def agree(self, value, what):
        """Check every rank holds the same integer `value` (the step resumed from, say)."""
        if self._dist is None:
            return
        vals = np.array([value, -value], dtype=np.float64)
        out = vals.copy()
        self._collective("a check", lambda: self._dist.all_reduce(self._tensor(out), op=self._dist.ReduceOp.MAX))
        if out[0] != value or -out[1] != value:
            raise DistributedError(f"rank {self.rank}: {what} is {value} here but {int(-out[1])}..{int(out[0])} "
                                   f"across the ranks; every rank must see the same run directory")

    def close(self):
        if self._dist is not None and self._dist.is_initialized():
            self._dist.destroy_process_group()


def _first_line(e):
    """The gist of a backend's error: its first line, up to the first sentence's end."""
    text = str(e).strip().splitlines()
    return text[0].split(". ")[0][:300] if text else type(e).__name__

