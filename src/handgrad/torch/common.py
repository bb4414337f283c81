"""What every Function of handgrad.torch shares: the backend a tensor's device picks, tensors as the
backend's arrays without copies, and the checks that turn a bad argument into one clear error."""
import torch

from ..backends import BACKENDS, get_backend


FLOATS = (torch.float32, torch.float64)
# the dtypes each backend's kernels take (the gpu's: float32, and bf16 activations as its models use)
BACKEND_FLOATS = {"cpu": FLOATS, "gpu": (torch.float32, torch.bfloat16)}


# The Functions that pass CUDA tensors to the gpu backend: handgrad.torch.llama's, LoRA's and the
# linear their modules project with. The other GPT-2 ones still refuse them with backend_for's message.
GPU_READY = frozenset({"rmsnorm", "swiglu", "rope", "gqa_attention", "linear", "lora_linear"})

# Which backend a tensor's device type goes to, for the GPU_READY Functions. The tests point "cpu"
# at "gpu" under TRITON_INTERPRET=1, where the gpu backend's tensors are CPU tensors.
DEVICE_BACKEND = {"cpu": "cpu", "cuda": "gpu"}


# How each backend sees a tensor's memory, without a copy. The CPU ops take NumPy arrays (a
# contiguous CPU tensor's .numpy() shares its storage); the gpu ops take the tensors themselves.
_VIEWS = {"cpu": lambda t: t.detach().numpy(), "gpu": lambda t: t.detach()}


def backend_for(device):
    """The handgrad backend module for a torch device ("cpu", "cuda:0", a torch.device), for the
    Functions that pass only CPU tensors (the GPU_READY ones use check_tensors's routing)."""
    kind = torch.device(device).type
    if kind == "cuda":
        raise NotImplementedError(
            "handgrad.torch: CUDA tensors are not passed to the 'cuda' backend (handgrad's gpu backend) by these "
            "autograd Functions yet; train on the GPU with handgrad.GPT(config, backend='gpu') or "
            "`handgrad train --device gpu`, or move the tensors to the CPU with .cpu()")
    if kind not in BACKENDS:
        raise NotImplementedError(
            f"handgrad.torch: tensors on device {str(device)!r} need handgrad's {kind!r} backend, which "
            f"does not exist yet (available: {', '.join(BACKENDS)}); move the tensors and the module "
            f"to the CPU with .cpu()")
    if kind not in _VIEWS:
        raise NotImplementedError(f"handgrad.torch: the {kind!r} backend exists but handgrad.torch does "
                                  f"not pass it tensors yet (add it to handgrad.torch._VIEWS)")
    return get_backend(kind)


def view(t, backend="cpu"):
    """The backend's array view of tensor t (None stays None). t must be contiguous."""
    return None if t is None else _VIEWS[backend](t)


def viewer(ops):
    """view for the backend module check_tensors chose: what a GPU_READY Function calls on each tensor
    it hands the ops."""
    return lambda t: view(t, ops.NAME)


def check_tensors(op, **tensors):
    """The backend for these float tensors (None skipped), after checking that they share one
    device with a handgrad backend and one dtype, float32 or float64."""
    given = {k: t for k, t in tensors.items() if t is not None}
    if len({t.device for t in given.values()}) > 1:
        raise ValueError(f"{op}: all tensors must be on one device, got "
                         + ", ".join(f"{k} on {t.device}" for k, t in given.items()))
    device = next(iter(given.values())).device
    if op in GPU_READY and device.type in DEVICE_BACKEND:
        name = DEVICE_BACKEND[device.type]
        ops = get_backend(name)
    else:
        name, ops = "cpu", backend_for(device)
    floats = BACKEND_FLOATS[name]
    for k, t in given.items():
        if t.dtype not in floats:
            raise TypeError(f"{op}: {k} has dtype {t.dtype}; handgrad's {name} kernels take "
                            + " or ".join(str(f) for f in floats))
    if len({t.dtype for t in given.values()}) > 1:
        raise TypeError(f"{op}: all tensors must have one dtype, got "
                        + ", ".join(f"{k} {t.dtype}" for k, t in given.items()))
    return ops


def check_shape(op, name, t, shape):
    if t is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def contiguous(*ts):
    return [None if t is None else t.contiguous() for t in ts]


def needed_grads(ctx, *grads):
    """Each gradient, or None where autograd did not ask for it."""
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad))


def check_linear_weight(op, weight, bias, C):
    if weight.dim() != 2 or weight.shape[1] != C:
        raise ValueError(f"{op}: weight must have shape (out_features, {C}) (nn.Linear's [out, in] "
                         f"layout), got {tuple(weight.shape)}")
    check_shape(op, "bias", bias, (weight.shape[0],))

