"""AdamW and gradient clipping over the model's flat buffers (the math is in the backend's adamw op)."""
import numpy as np


class AdamW:
    """torch.optim.AdamW semantics; weight decay only on tensors with 2+ dimensions.

    State is two flat buffers the size of the parameters (m, v) and the step count.
    """

    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        self.model = model
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        ops = model.ops
        self.m = ops.zeros((model.num_params,))
        self.v = ops.zeros((model.num_params,))
        self.chunks = ops.make_chunks(model.decay_segments())
        self.t = 0  # optimizer steps taken

    def state(self):
        """The optimizer's scalars, for a checkpoint's JSON (the moments go to safetensors)."""
        return {"t": self.t, "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay}

    def load_state(self, state):
        self.t = int(state["t"])

    def step(self, lr=None, grad_scale=1.0):
        """Apply one update from model.grad; grad_scale multiplies the gradients first (clipping,
        averaging over accumulation steps)."""
        self.t += 1
        b1, b2 = self.betas
        self.model.ops.adamw_update(self.model.params, self.model.grad, self.m, self.v, self.chunks,
                                    self.t, self.lr if lr is None else lr, b1, b2, self.eps,
                                    self.weight_decay, grad_scale)


def grad_norm(model, chunks):
    """Global L2 norm of all gradients (float64 accumulation)."""
    return model.ops.global_norm(model.grad, chunks)


def clip_scale(norm, max_norm):
    """The factor torch.nn.utils.clip_grad_norm_ applies: min(1, max_norm / (norm + 1e-6))."""
    if max_norm is None or max_norm <= 0 or not np.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
