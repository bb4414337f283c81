"""What a model family is, and what every family shares.

A family (GPT-2 today, in models/gpt2.py) is one module that turns an architecture config into
parameters, a forward and a backward pass, and decoding, by calling the backend's ops. It
provides, as a `Family` record (models/__init__.py lists them by `model.arch`):

    arch             the name `model.arch` picks it by ("gpt2")
    config           its architecture dataclass (config.py; vocab_size and block_size included)
    param_spec       config -> the one ordered list of (name, shape) that lays out the flat
                     parameter and gradient buffers, checkpoints and state_dict(); the names are
                     the Hugging Face ones (models/gpt2.py says which prefix is dropped)
    num_params       config -> the number of parameters, counted without building param_spec
    init_params      (config, seed) -> the initial weights as one flat float32 array (NumPy only,
                     so a PyTorch reference can start from the same weights)
    flops_per_token  (config, T) -> training FLOPs per token, for MFU
    model            the model class; its instances satisfy `CausalLM` below
    activations      the class of every buffer one forward/backward of shape (B, T) needs,
                     `activations(ops, config, B, T, dtype)`, then `.alloc_grads(ops, config, dtype)`
                     (training/memory.py counts its bytes by handing it an allocator that only counts)
    kv_cache         the class that holds its keys and values for decoding (models/decode.py)
    hf_architecture  the `architectures` entry of a Hugging Face config.json for it

Everything that is not a family's own math is shared: the flat buffers (`flat_layout`,
`flat_views` below), the optimizer (training/optim.py, over the flat buffers), checkpoints
(training/checkpoint.py, by param_spec names), sampling (models/decode.py) and data parallelism.
"""
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np


@dataclass(frozen=True)
class Family:
    arch: str
    config: type
    param_spec: Callable
    num_params: Callable
    init_params: Callable
    flops_per_token: Callable
    model: type
    activations: type
    kv_cache: type
    hf_architecture: str


class CausalLM(Protocol):
    """What the trainer, the optimizer, checkpoints, sampling and verify use of a model."""

    config: Any              # the family's architecture config
    ops: Any                 # the backend module (handgrad.backends.cpu or .gpu)
    backend: str             # "cpu" or "gpu"
    spec: list               # param_spec(config)
    layout: dict             # name -> (offset, shape) in the flat buffers
    num_params: int
    flat_params: Any         # (padded,) float32: the weights, one buffer
    flat_grad: Any           # (padded,) float32: their gradients, the same layout
    p: dict                  # name -> view of flat_params
    g: dict                  # name -> view of flat_grad
    grad_buckets: list       # (start, end) gradient ranges in the order backward() completes them

    def forward(self, idx, targets=None): ...           # mean loss (with targets) or logits (B, T, V)
    def forward_loss(self, idx, targets): ...           # the loss as the backend's scalar (no host sync)
    def backward(self, grads_ready=None): ...           # gradients of the last forward's loss into flat_grad
    def zero_grad(self): ...
    def decay_segments(self): ...                       # (start, end, decay?) per tensor, for AdamW
    def state_dict(self): ...                           # {name: array}, under param_spec's names
    def load_state_dict(self, state): ...
    def grads(self): ...                                # {name: array} of the gradients


def flat_layout(spec):
    """name -> (offset, shape) in the flat buffer, and the total size."""
    offsets, n = {}, 0
    for name, shape in spec:
        offsets[name] = (n, shape)
        n += int(np.prod(shape))
    return offsets, n


def flat_views(flat, layout):
    """name -> a view of `flat` with the tensor's shape."""
    return {name: flat[o:o + int(np.prod(s))].reshape(s) for name, (o, s) in layout.items()}
