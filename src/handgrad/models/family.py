"""What a model family is, and what every family shares.

A family (GPT-2 in models/gpt2.py, Llama in models/llama.py) is one module that turns an architecture
config into parameters, a forward and a backward pass, and decoding, by calling the backend's ops. Its
model class carries all of it; `Family.of(model class)` is the record the rest of handgrad reads
(models/__init__.py lists them by `model.arch`).

Everything that is not a family's own math is shared: the flat buffers (`flat_layout`,
`flat_views` below), the optimizer (training/optim.py, over the flat buffers), checkpoints
(interop/checkpoint.py, by param_spec names), sampling (models/decode.py) and data parallelism.
"""
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

import numpy as np

from ..backends import get_backend
from ..backends.cpu.documents import check_positions
from ..config import CHOICES
from . import lora as lora_parts
from .bf16_copies import BF16Copies
from .dropout import Dropout
from .head import Head
from .lora_layout import LoRALayout, quantized_names
from .params import flat_layout, flat_views, initialise, padded_rows  # noqa: F401 (initialise: the families')


RECOMPUTE = CHOICES["train.recompute"]  # none: every block's activations kept; block, full: see FlatModel


@dataclass(frozen=True)
class Family:
    """What a family provides, read off its model class by Family.of (the class attribute in brackets):

        arch             [ARCH] the name `model.arch` picks it by ("gpt2", "llama")
        config           [CONFIG] its architecture dataclass (config.py; vocab_size and block_size included)
        param_spec       [param_spec] config -> the one ordered list of (name, shape) that lays out the flat
                         parameter and gradient buffers, checkpoints and state_dict(); the names are
                         the Hugging Face ones (models/gpt2.py says which prefix is dropped)
        num_params       [count_params] config -> the number of parameters, counted without building
                         param_spec (the class's name differs: a model's num_params is its trained count)
        init_params      [init_params] (config, seed[, into]) -> the initial weights as one flat float32 array (NumPy
                         only, so a PyTorch reference can start from them), or into the model (initialise)
        flops_per_token  [flops_per_token] (config, T) -> training FLOPs per token, for MFU
        model            the model class itself; its instances satisfy `CausalLM` below
        activations      [ACTIVATIONS] the class of every buffer one forward/backward of shape (B, T) needs,
                         `activations(ops, config, B, T, dtype)`, then `.alloc_grads(ops, config, dtype)`
                         (training/memory.py counts its bytes by handing it an allocator that only counts)
        kv_cache         [KV_CACHE] the class that holds its keys and values for decoding (models/decode.py)
        hf_architecture  [HF_ARCHITECTURE] the `architectures` entry of a Hugging Face config.json for it
    """
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

    @classmethod
    def of(cls, model):
        """The record of the family whose model class (a FlatModel subclass) is `model`."""
        return cls(arch=model.ARCH, config=model.CONFIG, param_spec=model.param_spec, num_params=model.count_params,
                   init_params=model.init_params, flops_per_token=model.flops_per_token, model=model,
                   activations=model.ACTIVATIONS, kv_cache=model.KV_CACHE, hf_architecture=model.HF_ARCHITECTURE)


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

    def forward(self, idx, targets=None, positions=None, *, grad=False): ...  # mean loss (with targets) or logits
    def forward_loss(self, idx, targets, positions=None): ...  # the loss as the backend's scalar (no host sync)
    def backward(self, grads_ready=None, dloss=None): ...  # gradients of the last forward's loss into flat_grad
    def token_losses(self): ...                         # (B, T) float32 NumPy: the last forward's loss per token
    def zero_grad(self): ...
    def decay_segments(self): ...                       # (start, end, decay?) per tensor, for AdamW
    def state_dict(self): ...                           # {name: array}, under param_spec's names
    def load_state_dict(self, state): ...
    def grads(self): ...                                # {name: array} of the gradients


class FlatModel(Head, LoRALayout, BF16Copies, Dropout):
    """What every family's model shares: the flat parameter and gradient buffers laid out by
    param_spec, state_dict and load_state_dict, zero_grad, token checks, the activations of the
    last (B, T), and forward(). Mixed in: the head (models/head.py), where the frozen tensors of a
    LoRA model lie (models/lora_layout.py), the bf16 copy of the weights (models/bf16_copies.py)
    and dropout (models/dropout.py). A family's model (models/gpt2.py's GPT) is a subclass giving:

        ARCH, HF_ARCHITECTURE its model.arch name and Hugging Face's (Family's arch, hf_architecture)
        CONFIG, ACTIVATIONS   its config class and its Activations class
        KV_CACHE              its decoding cache class (models/decode.py)
        param_spec, init_params, count_params, flops_per_token   (staticmethods) the family's
                              functions (Family's fields of those names; count_params: num_params)
        head_name(config)     (staticmethod) the tensor the lm_head's product reads (GPT-2's tied wte)
        WRITTEN_FIRST         name suffixes of the weight matrices whose gradient the first backward
                              after zero_grad() writes by one GEMM (see zero_grad)
        _grad_buckets()       (start, end) gradient ranges in the order backward() completes them
        _layers_forward(a)    the forward from a.idx to a.logits
        backward(grads_ready) the gradients of the last forward's mean loss
    """

    def __init__(self, config, backend="cpu", seed=0, *, buffer_multiple=1, dtype="float32", lora=None,
                 dropout=0.0, loss_chunk=0, recompute="none", quant="none", vocab_pad=1):
        """buffer_multiple: the flat buffers (`flat_params`, `flat_grad`) are allocated zero-padded
        to a multiple of it, so data-parallel ranks can split them into equal shards; `params` and
        `grad` are their first num_params elements.
        dtype: "float32", or "bfloat16" mixed precision, float32 weights, gradients, optimizer
        state and statistics in both backends. On the gpu the activations are bf16; on the cpu
        the matrix products take bf16 operands (a bf16 copy of the weights, `flat_params16`, and each
        product's input narrowed by the kernel that writes it) and accumulate in float32 through
        oneDNN (a CPU without AVX512_BF16 or AMX: widened to float32 for the float32 BLAS), everything
        else staying float32. With lora, the frozen base matrices are held as bf16 only (`frozen16`).
        lora: a config.LoRAConfig: the base weights frozen (in `frozen_params`), adapters trained
        (models/lora.py); None: every weight trains.
        dropout: model.dropout, applied while `training` is set (set_training); off in evaluation
        and sampling.
        seed: the initialisation's; None leaves the weights zero, for a caller that loads them all.
        loss_chunk: the loss forms the logits of at most this many rows (of B*T) at a time, never
        the whole (B, T, V) (head_forward); 0: all rows at once.
        recompute: "none", "block" or "full": the forward keeps each block's output and one block's
        inner buffers, which the backward refills by running the block's forward again (bit for bit).
        Under block a Llama keeps its blocks' attention results too and runs only their qkv and MLP
        inputs again; under full it keeps nothing else (GPT-2 keeps nothing else under either).
        quant: a model without adapters whose block matrices are held quantized (lora.base_quant's
        choices; models/lora_layout.py), frozen: decoding from a quantized file or --quant. A LoRA
        model takes lora.base_quant instead.
        vocab_pad: the lm_head's rows (GPT-2's tied wte) held padded to a multiple of this (model.vocab_pad;
        1: none), as llm.c pads GPT-2's 50,257 to 50,304: the logits' rows then have an aligned length.
        The padded rows are zeros that stay zeros (their logits are 0, the loss reads only the first
        vocab_size, so their gradient is 0), and model.p, state_dict, checkpoints and exports hold the
        real vocab_size rows. A model whose lm_head trains only (no LoRA, no quantized base)."""
        if not isinstance(config, self.CONFIG):
            raise ValueError(f"config must be a handgrad {self.CONFIG.__name__}, got {type(config).__name__}")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        self._init_dropout(dropout)
        if loss_chunk < 0:
            raise ValueError(f"loss_chunk must be >= 0 rows (0: all of them), got {loss_chunk!r}")
        if quant not in CHOICES["train.base_quant"]:
            raise ValueError(f"quant must be one of {', '.join(CHOICES['train.base_quant'])}, got {quant!r}")
        held = lora.base_quant if lora is not None else quant
        if held != "none" and backend != "cpu":
            raise ValueError(f"train.base_quant {held}: a quantized base is the cpu backend's; on the gpu train "
                             f"over the base as loaded (train.base_quant none)")
        if not (isinstance(vocab_pad, (int, np.integer)) and vocab_pad >= 1):
            raise ValueError(f"vocab_pad must be an int >= 1 (1: no padding), got {vocab_pad!r}")
        if vocab_pad > 1 and (lora is not None or quant != "none"):
            raise ValueError(f"vocab_pad {vocab_pad}: a padded vocabulary needs the lm_head to train (no LoRA, no "
                             f"quantized base); use vocab_pad 1")
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
        self.config, self.ops, self.backend, self.lora = config, get_backend(backend), backend, lora
        self.base_quant = lora.base_quant if lora is not None else quant
        self.dtype, self.loss_chunk, self.recompute = dtype, int(loss_chunk), recompute
        self.head_rows = padded_rows(config.vocab_size, int(vocab_pad))  # the lm_head's rows as held
        self.bf16_products = dtype == "bfloat16" and backend == "cpu"
        padded = self._init_buffers(buffer_multiple)
        self._init_bf16_copies(padded)
        self._acts, self._ready_for_backward = None, False
        self._grads_zero = True  # the gradient buffer starts at zero
        # the gradients that backward adds into even on its first pass after zero_grad(); the weight
        # matrices listed in WRITTEN_FIRST are overwritten by it instead (see zero_grad)
        self._accumulated_segments = [(o, int(np.prod(s))) for name, (o, s) in self.layout.items()
                                      if not name.endswith(self.WRITTEN_FIRST)]
        self.grad_buckets = self._grad_buckets() if lora is None and not self.quant else self._block_buckets()
        if seed is not None:  # None: the caller loads every weight next (from_pretrained); no init to overwrite
            self._init_weights(seed)
        else:
            self.weights_changed()
        self.adapters = lora_parts.adapter_records(self) if lora is not None else []

    def _init_buffers(self, buffer_multiple):
        """model.spec, what trains, laid out in flat_params and flat_grad (zero-padded to a multiple
        of buffer_multiple; returns that length), the frozen tensors in theirs (models/lora_layout.py);
        p and g naming the tensors."""
        if self.lora is None:  # every weight trains, but for a quantized model's matrices (held apart, frozen)
            self.spec, self.lora_blocks = self.param_spec(self.config), []
            held = quantized_names(self.spec, head=True) if self.base_quant != "none" else set()
            frozen = [(n, s) for n, s in self.spec if n in held]
            self.spec = [(n, s) for n, s in self.spec if (n, s) not in frozen]
        else:
            self.spec, frozen, self.lora_blocks = lora_parts.split_spec(type(self), self.config, self.lora)
        head = self.head_name(self.config)
        self.layout, self.num_params = flat_layout(self.spec, {head: self.head_rows})
        # the padded rows' elements: in num_params (the buffers' length), no parameter's
        self.num_padding = (self.head_rows - self.config.vocab_size) * self.config.n_embd
        padded = -(-self.num_params // buffer_multiple) * buffer_multiple
        self.flat_params = self.ops.zeros((padded,))
        self.flat_grad = self.ops.zeros((padded,))
        self.params, self.grad = self.flat_params[:self.num_params], self.flat_grad[:self.num_params]
        self._init_frozen(frozen)
        self.g = flat_views(self.grad, self.layout)
        return padded

    def head_weights(self, w):
        """(W, dW) for the head's product (head_forward): the lm_head of the products' weights w (model.p,
        or p16 with bf16 products) as its transposed (C, V) view, and its gradient's (None where frozen).
        With a padded vocabulary they run over all head_rows rows of the flat buffers (the zero rows
        past vocab_size included), so the logits come out head_rows wide."""
        name = self.head_name(self.config)
        if self.head_rows == self.config.vocab_size:
            return w[name].T, self.grad_t(name)
        o, (V, C) = self.layout[name]
        flat = self.flat_params16 if self.bf16_products and w is not self.p else self.params
        return (flat[o:o + self.head_rows * C].reshape(self.head_rows, C).T,
                self.grad[o:o + self.head_rows * C].reshape(self.head_rows, C).T)

    # ----------------------------------------------------------------- parameters
    def _init_weights(self, seed):
        """init_params' weights into the parameter views on the cpu (no second copy); the gpu's via the host."""
        self.weights_changed()
        if self.backend == "cpu":
            self._draw_weights(seed)
        else:
            host = self.init_params(self.config, seed)
            for name, value in flat_views(host, flat_layout(self.param_spec(self.config))[0]).items():
                self.p[name][...] = self.ops.from_numpy(value)
        if self.lora is not None:
            lora_parts.init_adapters(self, seed)

    def _block_buckets(self):
        """grad_buckets from the trained tensors' names (a LoRA model): the head's (after the last
        block), blocks L-1 .. 0, the embeddings'; each contiguous in model.spec, possibly empty."""
        spans, seen_block = {}, False
        for name, (o, shape) in self.layout.items():
            l = lora_parts.layer_of(name)
            seen_block = seen_block or l is not None
            key = l if l is not None else (self.config.n_layer if seen_block else -1)
            lo, hi = spans.get(key, (o, o))
            spans[key] = (min(lo, o), max(hi, o + int(np.prod(shape))))
        end = self.num_params
        order = [self.config.n_layer] + list(reversed(range(self.config.n_layer))) + [-1]
        return [spans.get(k, (end, end)) for k in order]

    @property
    def base_names(self):
        """param_spec's names: the tensors of the plain model (a LoRA model's base, frozen or trained)."""
        return [name for name, _ in self.param_spec(self.config)]

    def lora_adapters(self, a, l, group):
        """The adapter records of block l's `group` product, their xs buffers (in activations a) and
        dropout seeds set for this forward; () for a model without adapters there."""
        if not self.adapters:
            return ()
        ads = self.adapters[l].get(group, ())
        for ad in ads:
            ad.xs = a.lora_xs[l, ad.index]
            ad.dropout = self.lora.dropout if self.training else 0.0
            ad.seed = self.dropout_seed(l, lora_parts.SITE_LORA + ad.index)
        return ads

    @contextmanager
    def adapters_off(self):
        """Inside, the model computes its base alone: a LoRA model's adapters are skipped (PEFT's
        disable_adapter; DPO's reference model, training/dpo.py). Nothing is copied."""
        adapters, self.adapters = self.adapters, []
        try:
            yield self
        finally:
            self.adapters = adapters

    def plain(self):
        """A model of the same family and backend without adapters, computing what this one does
        (the adapters folded into its weights): what decoding and exports take."""
        model = type(self)(self.config, backend=self.backend, seed=None)  # no draw: every weight is loaded
        if self.lora is None:
            model.load_state_dict(self.state_dict())
        else:  # one merged tensor at a time: no second copy of every weight beside the new model
            model.load_state_dict(lora_parts.merged_weights(self, lazy=True))
        return model

    def merged_state_dict(self):
        """The weights of the plain model this one computes (a LoRA model's adapters folded into
        its base weights; otherwise state_dict())."""
        return self.state_dict() if self.lora is None else lora_parts.merged_weights(self)

    def decay_segments(self):
        """(start, end, decay) per tensor: weight decay applies to tensors with 2+ dimensions."""
        return [(o, o + int(np.prod(s)), len(s) >= 2) for _, (o, s) in self.layout.items()]

    def state_dict(self):
        """Copies of the weights under param_spec's (Hugging Face) names and layouts, and a LoRA
        model's adapters under theirs (models/lora.py)."""
        return {name: self.weight(name) for name in self.p}

    def weight(self, name):
        """A float32 NumPy copy of tensor `name` (a bf16 frozen base's widened, exactly; a quantized
        one's dequantized)."""
        if name in self.quant:
            w = self.quant[name].with_dtype(np.float32).dequantize()
            return np.ascontiguousarray(w.T) if self.FAN_IN_FAN_OUT else w
        x = self.ops.to_numpy(self.p[name])
        return get_backend("cpu").from_bf16(x) if x.dtype == np.uint16 else x.copy()

    def grads(self):
        """Copies of the gradients, under the same names and layouts as state_dict()."""
        if self._grads_zero:
            self.grad[:] = 0  # zero_grad() left the written-first gradients for the next backward
        return {name: self.ops.to_numpy(view).copy() for name, view in self.g.items()}

    def load_state_dict(self, state, names=None):
        """Copy weights in from a dict of arrays; missing, extra or mis-shaped names are rejected.
        names: the tensors `state` must hold (default every one of model.p); a LoRA model's
        checkpoint holds model.layout's (what trains), its base param_spec's."""
        want = list(self.p if names is None else names)
        missing = [n for n in want if n not in state]
        extra = [n for n in state if n not in want]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
            if extra:
                parts.append(f"unexpected {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
            raise ValueError("load_state_dict: " + "; ".join(parts))
        for name in want:  # shape and dtype only: a lazily read tensor (interop/gguf.py) is read once, below
            arr, view = state[name], self.p[name]
            arr = arr if hasattr(arr, "shape") and hasattr(arr, "dtype") else np.asarray(arr)
            if tuple(arr.shape) != tuple(view.shape):
                raise ValueError(f"load_state_dict: {name} has shape {tuple(arr.shape)}, "
                                 f"expected {tuple(view.shape)}")
            if not np.issubdtype(arr.dtype, np.floating):
                raise ValueError(f"load_state_dict: {name} has dtype {arr.dtype}, expected a float type")
        self._write_weights(state, want)
        self.weights_changed()

    def zero_grad(self):
        """Start the next backward from zero gradients.

        The weight matrices' gradients (WRITTEN_FIRST: for GPT-2 wte and every block's four matmul
        weights, 97-99% of the buffer) are not cleared here: the next backward writes each of them
        by one GEMM instead of adding (accumulate=False). Only the rest (biases, norm gains, wpe) is
        zeroed now. That
        saves a pass over the whole buffer: for GPT-2 124M a 500 MB memset, ~55 ms of a ~1.2 s
        step. Until that backward runs, `model.grad` holds stale values in those matrices, as
        torch's default zero_grad(set_to_none=True) leaves no gradient; grads() returns zeros.
        """
        for o, n in self._accumulated_segments:
            self.grad[o:o + n] = 0
        self._grads_zero = True

    # ----------------------------------------------------------------- forward / backward
    def _check_tokens(self, name, x, allow_ignore):
        if not isinstance(x, np.ndarray):
            x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}")
        if x.ndim != 2:
            raise ValueError(f"{name} must have shape (B, T), got shape {x.shape}")
        B, T = x.shape
        if B < 1 or T < 1:
            raise ValueError(f"{name} must have B >= 1 and T >= 1, got shape {x.shape}")
        if T > self.config.block_size:
            raise ValueError(f"{name} has T = {T}, above block_size {self.config.block_size}; "
                             f"use at most {self.config.block_size} positions")
        V = self.config.vocab_size
        lo = -1 if allow_ignore else 0
        bad = (x < lo) | (x >= V)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            allowed = f"-1 (ignore) or [0, {V})" if allow_ignore else f"[0, {V})"
            raise ValueError(f"{name}{list(where)} = {int(x[where])} is outside {allowed}")
        return x

    def _activations(self, B, T):
        a = self._acts
        if a is None or (a.B, a.T) != (B, T):
            a = self._acts = None  # release the old set before allocating the new one
            rows = min(self.loss_chunk, B * T) if self.loss_chunk else None
            config = replace(self.config, vocab_size=self.head_rows)  # the logits' width: the lm_head's rows
            a = self._acts = self.ACTIVATIONS(self.ops, config, B, T, self._act_dtype(),
                                              products=np.uint16 if self.bf16_products else np.float32,
                                              logit_rows=rows, recompute=recompute_mode(self.recompute))
            a.lora_xs = None if self.lora is None else self.ops.empty(  # each adapter's s x A, per block
                (self.config.n_layer, max(map(len, self.lora_blocks)), B, T, self.lora.rank), self._act_dtype())
            a.dbranch = None  # a dropped branch's gradient (model.dropout), made at its first use
        return a

    # ----------------------------------------------------------------- what the families call
    def lora_linear(self, out, inp, a, l, group):
        """Add block l's `group` adapters onto the frozen product in out (no-op without any)."""
        ads = self.lora_adapters(a, l, group)
        if ads:
            self.ops.lora_forward(out, inp, ads)

    def lora_linear_grad(self, dinp, dout, inp, a, l, group):
        """Their backward: adapter gradients, and their part of dinp added to the frozen product's."""
        ads = self.lora_adapters(a, l, group)
        if ads:
            self.ops.lora_backward(dinp, dout, inp, ads)

    def grad_t(self, name):
        """The transposed gradient view of an [out, in] weight, or None where it is frozen."""
        g = self.g.get(name)
        return None if g is None else g.T

    def _act_dtype(self):
        if self.dtype == "bfloat16" and not self.bf16_products:
            import torch
            return torch.bfloat16
        return np.float32

    def forward(self, idx, targets=None, positions=None, *, grad=False):
        """idx (B, T) integer token ids. With targets (B, T) (-1 = ignore) returns the mean loss as
        a float and keeps what backward() needs; without, returns logits (B, T, V) (a copy).
        positions (B, T): packed rows (data/chat_data.py's packed chat data), each token's position in its
        own document: RoPE (or GPT-2's wpe) reads it, and attention stays inside each document
        (backends/cpu/documents.py says what is valid); None: one sequence a row, positions 0 .. T-1.
        grad=True: a backward() follows (a training step's forward), so the chunked loss may form
        the hidden state's gradient now (head_loss); the gradients are the same bits either way."""
        if targets is not None:
            # the gpu's loss is a device scalar: float() waits for it
            return float(self.forward_loss(idx, targets, positions, grad=grad))
        a = self.stage(idx, positions=positions)
        self._narrow_weights()
        self._layers_forward(a)
        self._ready_for_backward = False
        return self.head_logits(a)

    def forward_loss(self, idx, targets, positions=None, *, grad=False):
        """forward(idx, targets, positions, grad=grad) without reading the loss: the backend's scalar
        (a float on the cpu, a 0-dim device tensor on the gpu, so the host does not wait for the GPU)."""
        return self.forward_staged(self.stage(idx, targets, positions), grad=grad)

    def stage(self, idx, targets=None, positions=None, into=None):
        """Check idx, targets and positions and copy them into the activations of their shape (or
        `into`, which must have it): a step's one host-to-device transfer. Returns those activations,
        a.packed saying whether this forward's rows are packed documents (a.positions then holds
        them)."""
        idx = self._check_tokens("idx", idx, allow_ignore=False)
        if targets is not None:
            targets = self._check_tokens("targets", targets, allow_ignore=True)
            if targets.shape != idx.shape:
                raise ValueError(f"targets must have the shape of idx {idx.shape}, got {targets.shape}")
        if positions is not None:
            positions = check_positions(positions, *idx.shape)
        a = self._activations(*idx.shape) if into is None else into
        if (a.B, a.T) != idx.shape:
            raise ValueError(f"idx has shape {idx.shape}, the activations being filled ({a.B}, {a.T})")
        self.ops.upload_tokens(a.idx, idx)
        if targets is not None:
            self.ops.upload_tokens(a.targets, targets)
        a.packed = positions is not None
        if a.packed:
            if getattr(a, "positions", None) is None:
                a.positions = self.ops.empty(idx.shape, np.int32)
            self.ops.upload_tokens(a.positions, positions)
        return a

    def token_losses(self):
        """The last forward's loss of each token, (B, T) float32 NumPy: lse - z[target], 0 where the
        target is -1 (minus the log-probability of each target token)."""
        if self._acts is None or not self._ready_for_backward:
            raise RuntimeError("token_losses() needs a forward(idx, targets) with targets first")
        return self.ops.to_numpy(self._acts.losses).astype(np.float32, copy=True)

    def documents(self, a):
        """The attention, RoPE and position ops' keywords for the rows staged in a: {"positions": ...}
        for packed documents, else none (each row one sequence)."""
        return {"positions": a.positions} if getattr(a, "packed", False) else {}

    def forward_staged(self, a, *, grad=False):
        """The forward over the tokens and targets stage() put into a; returns the mean loss as the
        backend's scalar and keeps what backward() needs (grad: as forward's). Touches only device
        memory (no host transfer, no allocation after the first call), so a CUDA graph can capture it."""
        self._narrow_weights()
        self._layers_forward(a)
        loss = self.head_loss(a, grad)
        self._acts = a
        self._ready_for_backward = True
        return loss


def recompute_mode(recompute):
    """train.recompute as a family's Activations takes it: False (none), or "block" or "full"."""
    return False if recompute == "none" else recompute


class TrainingBlock:
    """What a family's block_forward reads and writes in a training forward, beside the buffers
    (which the family's subclass finds in the activations a): the weights (norms and biases
    float32 in p, the products' matrices in w: their bf16 copies with bf16 products), the model's
    adapters beside each product (their inputs kept for the backward), and dropout. The same block
    runs for decoding with models/decode.py's DecodeBlock instead."""

    def __init__(self, model, a):
        self.model, self.a, self.p, self.w, self.proj = model, a, model.p, model.p16, a.proj

    def adapters(self, l, group, x):
        return self.model.lora_adapters(self.a, l, group)

    def lora(self, out, inp, l, group):
        self.model.lora_linear(out, inp, self.a, l, group)

    def drop(self, x, l, site):
        self.model.drop(x, l, site)

