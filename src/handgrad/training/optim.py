"""AdamW and gradient clipping over the model's flat buffers (the math is in the backend's adamw op)."""
import numpy as np


class AdamW:
    """torch.optim.AdamW semantics; weight decay only on tensors with 2+ dimensions.

    State is two flat buffers (m, v) and the step count. They cover the parameters [lo, hi) of
    the model's flat buffer: all of them, or with `shard=(lo, hi)` one data-parallel rank's slice
    (ZeRO stage 1: each rank keeps and updates only its slice's moments).
    """

    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, shard=None):
        self.model = model
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.lo, self.hi = shard if shard is not None else (0, model.num_params)
        ops = model.ops
        self.m = ops.zeros((self.hi - self.lo,))
        self.v = ops.zeros((self.hi - self.lo,))
        # each tensor's part inside [lo, hi), in offsets relative to lo (padding past num_params
        # belongs to no tensor and is never updated)
        segments = [(max(a, self.lo) - self.lo, min(b, self.hi) - self.lo, decay)
                    for a, b, decay in model.decay_segments() if a < self.hi and b > self.lo]
        self.chunks = ops.make_chunks(segments)
        self.t = 0  # optimizer steps taken

    def state(self):
        """The optimizer's scalars, for a checkpoint's JSON (the moments go to safetensors)."""
        return {"t": self.t, "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay}

    def load_state(self, state):
        self.t = int(state["t"])

    def step(self, lr=None, grad_scale=1.0):
        """Apply one update from model.grad to the parameters [lo, hi); grad_scale multiplies the
        gradients first (clipping, averaging over accumulation steps and ranks)."""
        self.t += 1
        b1, b2 = self.betas
        model = self.model
        bf16 = model.flat_params16  # the bf16 products' copy (cpu; None otherwise), written in the same pass
        extra = {} if bf16 is None else {"params_bf16": bf16[self.lo:self.hi]}
        self.model.ops.adamw_update(model.flat_params[self.lo:self.hi], model.flat_grad[self.lo:self.hi],
                                    self.m, self.v, self.chunks, self.t, self.lr if lr is None else lr,
                                    b1, b2, self.eps, self.weight_decay, grad_scale, **extra)
        if bf16 is not None:
            # a shard's update leaves the rest of the copy stale until the weights are gathered
            full = (self.lo, self.hi) == (0, model.num_params)
            model.weights16_updated() if full else model.weights_changed()

    def step_on_device(self, hyper):
        """One update with its scalars decided on the device (gpu backend): hyper, written by
        ops.prepare_update, holds lr, grad_scale, the bias corrections and whether to apply the step
        at all. self.t does not move here: the device counts the steps applied (see DeviceLoop)."""
        b1, b2 = self.betas
        model = self.model
        model.ops.adamw_update(model.flat_params[self.lo:self.hi], model.flat_grad[self.lo:self.hi],
                               self.m, self.v, self.chunks, None, None, b1, b2, self.eps, self.weight_decay,
                               hyper=hyper)


def grad_norm(model, chunks, lo=0):
    """Global L2 norm of the gradients in `chunks` (offsets relative to lo), float64 accumulation."""
    return model.ops.global_norm(model.flat_grad[lo:], chunks)


def clip_scale(norm, max_norm):
    """The factor torch.nn.utils.clip_grad_norm_ applies: min(1, max_norm / (norm + 1e-6)).
    norm may be a device scalar (the gpu backend's global_norm); it is read here."""
    norm = float(norm)
    if max_norm is None or max_norm <= 0 or not np.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))

