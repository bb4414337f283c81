"""What a training run will hold in memory, counted before anything is built, and a refusal (one
line) when the machine cannot hold it.

The count per process: the flat parameter and gradient buffers (float32), AdamW's two moments
(float32; a 1/world_size slice under ZeRO-1), every activation buffer of one (batch_size,
block_size) forward and backward, the ops' scratch buffers (Activations.scratch_bytes), and the
runtime itself (Python, NumPy, Numba's compiled kernels, the BLAS). The activations are counted by
handing the family's Activations class an allocator that only adds up sizes, so the count follows
the model's own buffers. The runtime is a measured constant, RUNTIME_BYTES: the peak resident memory
of a `tiny` run (0.1M parameters), 270 MB on the 2-core Intel Xeon (tests/test_memory.py checks the
whole count against measured runs).
"""
import math
import os
from dataclasses import replace

import numpy as np

from ..backends import get_backend
from ..eval.score import MAX_LOGITS, MAX_TOKENS
from ..models.family import recompute_mode
from ..models.lora import group_widths, split_spec
from ..models.lora_layout import quantized_names
from ..models.params import padded_rows
from .rundir import TrainError

RUNTIME_BYTES = 270 * 2**20  # the process with nothing of the model in it (measured; see above)


class _CountingOps:
    """The backend's `empty` for the Activations class, adding up bytes instead of allocating."""

    def __init__(self, ops):
        self.ops, self.bytes = ops, 0

    def __getattr__(self, name):  # shapes and dtypes (attention_state_shape, LSE_DTYPE, ...): the backend's
        return getattr(self.ops, name)

    def empty(self, shape, dtype=np.float32):
        try:
            itemsize = np.dtype(dtype).itemsize
        except TypeError:  # a torch dtype (the gpu's bfloat16 activations)
            itemsize = dtype.itemsize
        self.bytes += math.prod(shape) * itemsize
        return None


def estimate(family, config, batch_size, block_size, backend="cpu", dtype="float32", world_size=1, zero_stage=0,
             lora=None, loss_chunk=0, recompute="none", sample_tokens=0, eval_tasks=False, stored_bytes=None,
             vocab_pad=1):
    """{part: bytes} of one process of a run; config is the family's architecture config. lora (a
    LoRAConfig): gradients and moments of what trains only, the frozen base beside the parameters,
    and in the activations each adapter's s x A per block and the lora ops' workspaces (s g B^T, and
    with lora_dropout the dropped input and its gradient, one of each per input width). loss_chunk: the
    logits of that many rows, not of the whole batch (train.loss_chunk). recompute: train.recompute's
    (block, full: one block's inner buffers and every block's output; models/family.py).
    sample_tokens: the tokens each sample between steps decodes (0: no sampling); eval_tasks:
    whether tasks are scored between steps (both add the part `decoding`: _decoding_bytes). A LoRA run whose lora.base_quant holds the base's
    block matrices quantized counts their blocks (q8_0: 34 bytes a block of 32, q4_0: 18; keep:
    stored_bytes, the file's bytes of them) and the one dequantized copy of the largest product's
    matrix (quant_bytes). vocab_pad: the lm_head's rows held padded to a multiple of it (model.vocab_pad):
    its padding in the weights, gradients and moments, and logits that wide."""
    n, frozen, xs = family.num_params(config), 0, 0
    head_rows = padded_rows(config.vocab_size, vocab_pad)
    n += (head_rows - config.vocab_size) * config.n_embd
    wide = replace(config, vocab_size=head_rows)  # the activations': logits head_rows wide
    act_bytes = 2 if dtype == "bfloat16" and backend != "cpu" else 4
    if lora is not None:
        trained, frozen_spec, blocks = split_spec(family.model, config, lora)
        n = sum(math.prod(s) for _, s in trained)
        frozen = 4 * sum(math.prod(s) for _, s in frozen_spec)
        N = batch_size * block_size
        widths = {t.fan_in for block in blocks for t in block}
        xs = (config.n_layer * max(map(len, blocks)) + 1) * N * lora.rank * act_bytes
        xs += 2 * N * sum(widths) * act_bytes if lora.dropout else 0
        if dtype == "bfloat16" and backend == "cpu":
            # the frozen matrices held as bf16 only; the lora ops widen a bf16 input and output
            # gradient into float32 scratch (the widest input, the widest adapted product), a block
            # of rows at a time
            frozen -= 2 * sum(math.prod(s) for _, s in frozen_spec if len(s) >= 2)
            out_widths = group_widths(family.model, config)
            xs += get_backend(backend).lora.bf16_scratch_bytes(
                N, max(widths), max(out_widths[t.group] for block in blocks for t in block), lora.dropout)
        if lora.base_quant != "none":
            held, scratch = quant_bytes(family, config, lora.base_quant, stored_bytes)
            item = 2 if dtype == "bfloat16" and backend == "cpu" else 4
            matrices = sum(math.prod(s) for n, s in frozen_spec if n in quantized_names(frozen_spec))
            frozen += held - item * matrices + item * scratch
    padded = -(-n // world_size) * world_size
    ops = get_backend(backend)
    act_dtype, products = np.float32, np.float32
    if dtype == "bfloat16" and backend == "cpu":  # bf16 products: float32 activations, bf16 product inputs
        products = np.uint16
    elif dtype == "bfloat16":
        import torch
        act_dtype = torch.bfloat16
    counter = _CountingOps(ops)
    rows = min(loss_chunk, batch_size * block_size) if loss_chunk else None
    acts = family.activations(counter, wide, batch_size, block_size, act_dtype, products=products, logit_rows=rows,
                              recompute=recompute_mode(recompute))
    acts.alloc_grads(counter, wide, act_dtype)
    scratch = family.activations.scratch_bytes(ops, wide, batch_size, block_size)  # the ops' workspaces
    if products is np.uint16:  # bf16 logits: each block of rows widened for the cross-entropy
        scratch += ops.crossentropy.bf16_scratch_bytes(config.vocab_size)
    if products is np.uint16 and not ops.products_path():  # widened products: their float32 tiles
        scratch += ops.blas.widen_scratch_bytes() + ops.blas.widen.bf16_out_scratch_bytes(head_rows)
    bf16_copy = 2 * padded if products is np.uint16 else 0  # the products' bf16 copy of the weights
    parts = {"parameters": 4 * padded + frozen + bf16_copy, "gradients": 4 * padded,
             "AdamW moments": 8 * (padded // world_size if zero_stage == 1 else padded),
             "activations": counter.bytes + scratch + xs}
    if sample_tokens or eval_tasks:
        parts["decoding"] = _decoding_bytes(family, config, lora, dtype == "bfloat16" and backend == "cpu",
                                            sample_tokens, eval_tasks)
    if backend == "cpu":
        parts["runtime"] = RUNTIME_BYTES
    return parts


def quant_bytes(family, config, base_quant, stored_bytes=None):
    """(bytes of the block matrices held quantized, elements of the largest product's matrix, the one
    dequantized at a time: a fused q|k|v or gate|up; GPT-2's twice, its Conv1D layout a second copy):
    q8_0 and q4_0 from their blocks, keep from stored_bytes (the file's)."""
    spec = family.param_spec(config)
    names = quantized_names(spec)
    elements = sum(math.prod(s) for n, s in spec if n in names)
    held = stored_bytes if base_quant == "keep" else elements // 32 * {"q8_0": 34, "q4_0": 18}[base_quant]
    widths = group_widths(family.model, config)
    fan_in = {g: 0 for g in widths}
    for module, group in family.model.LORA_MODULES.values():
        shape = dict(spec)[family.model.block_prefix(0) + module + ".weight"]
        fan_in[group] = shape[0] if family.model.FAN_IN_FAN_OUT else shape[1]
    copies = 2 if family.model.FAN_IN_FAN_OUT else 1  # a Conv1D's dequantized copy and its transposed one
    return held, copies * max(widths[g] * fan_in[g] for g in widths)


def _decoding_bytes(family, config, lora, bf16_base, sample_tokens, eval_tasks):
    """What sampling or scoring between two steps holds beside the run: the larger of the sample's
    KV cache (one row of the prompt and sample_tokens positions, fed one position a call) and the
    task scorer's two caches (eval/score.py: each at most MAX_TOKENS positions a call and MAX_LOGITS
    logits; a bound, reached by batches of long rows), and in a LoRA run the adapters' scratch for
    the rows of one call (_adapter_bytes). A LoRA model decodes through its adapters, beside its base
    as it holds it: no merged copy, which would be a float32 model (1.84 GiB for qwen2.5-0.5b). Only
    the main process samples and scores."""
    cache = family.model.KV_CACHE
    sampling = scoring = 0
    if sample_tokens:
        sampling = _cache_bytes(cache, config, min(config.block_size, sample_tokens + 1), 1)
        sampling += _adapter_bytes(family, config, lora, bf16_base, 1)
    if eval_tasks:
        scoring = 2 * _cache_bytes(cache, config, MAX_TOKENS, MAX_TOKENS, MAX_LOGITS)
        scoring += _adapter_bytes(family, config, lora, bf16_base, MAX_TOKENS)
    return max(sampling, scoring)


def _adapter_bytes(family, config, lora, bf16_base, rows):
    """The scratch of a LoRA model's adapters decoding `rows` positions a call (backends' lora_forward):
    each xs and a group's stacked xs (r numbers a row per adapter), and over a bf16 base the adapter
    input widened to float32 (the widest input). 0 without adapters."""
    if lora is None:
        return 0
    _, _, blocks = split_spec(family.model, config, lora)
    per_group = max((sum(t.group == u.group for u in block) for block in blocks for t in block), default=0)
    widest = max((t.fan_in for block in blocks for t in block), default=0) if bf16_base else 0
    return 4 * rows * (lora.rank * (1 + per_group) + widest)


def _cache_bytes(cache, config, positions, rows_per_call, logits=None):
    """Bytes of a float32 KV cache (the class `cache`, models/decode.py) of `positions` positions whose
    calls run at most rows_per_call positions and return `logits` logits (default rows_per_call x V):
    keys, values and the buffers its _bufs and _head grow to, from the class's own widths."""
    heads, hs = cache.kv_shape(config)
    logits = rows_per_call * config.vocab_size if logits is None else logits
    widths = sum(cache.buffer_widths(config).values()) + sum(cache.head_widths(config).values())
    return 4 * (2 * config.n_layer * heads * hs * positions + rows_per_call * (widths + 1) + logits)


def available_bytes(backend="cpu"):
    """Memory this process can still take: the host's MemAvailable (within a cgroup's limit), or
    the GPU's free memory on the gpu backend with CUDA. None where it cannot be read."""
    if backend == "gpu":
        import torch
        if torch.cuda.is_available():
            return torch.cuda.mem_get_info()[0]
    avail = None
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            avail = min(avail or math.inf, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def describe(parts):
    """'1.23 GiB (parameters 0.1, gradients 0.1, ...)'"""
    gib = lambda b: b / 2**30
    return (f"{gib(sum(parts.values())):.2f} GiB ("
            + ", ".join(f"{k} {gib(v):.2f}" for k, v in parts.items()) + ")")


def check_memory(parts, config, backend="cpu", processes=1, available=None, vocab_size=0):
    """TrainError naming what to lower when `processes` copies of the run need more than there is.
    vocab_size: the model's (config.model's may be 0: the data's)."""
    need = sum(parts.values()) * processes - parts.get("decoding", 0) * (processes - 1)  # the main one decodes
    have = available_bytes(backend) if available is None else available
    if have is not None and need > have:
        m, t = config.model, config.train
        biggest = max(parts, key=parts.get)
        lower = ("train.batch_size, model.block_size or model.n_layer" if biggest == "activations"
                 else "model.n_layer or model.n_embd (or the vocabulary)")
        logits = t.batch_size * m.block_size * (vocab_size or m.vocab_size) * 4
        if not t.loss_chunk and biggest == "activations" and logits > parts["activations"] / 8:
            lower += f", or set train.loss_chunk (the logits, {logits / 2**30:,.2f} GiB, formed 1024 rows at a time)"
        if t.recompute == "none" and biggest == "activations":
            lower += (", or set train.recompute block or full (each block's activations formed again in the "
                      "backward; full keeps the least)")
        elif t.recompute == "block" and biggest == "activations" and m.arch != "gpt2":
            lower += ", or set train.recompute full (the attention's results formed again too)"
        if not t.lora_rank and biggest != "activations":
            lower += ", or train LoRA adapters (train.lora_rank 8) instead of every weight"
        if t.lora_rank and t.dtype == "float32" and backend == "cpu" and biggest == "parameters":
            lower += ", or hold the frozen base as bf16 (train.dtype bfloat16)"
        if t.lora_rank and t.base_quant not in ("q4_0", "keep") and backend == "cpu" and biggest == "parameters":
            lower += ", or hold the frozen base quantized (train.base_quant q4_0: 18 bytes a block of 32 weights)"
        if parts.get("decoding", 0) > need / 8:
            lower += (f", or sample and score nothing between steps (train.sample_interval 0, no train.eval_tasks: "
                      f"{parts['decoding'] / 2**30:,.2f} GiB)")
        where = "GPU memory" if backend == "gpu" and not os.environ.get("TRITON_INTERPRET") else "memory"
        each = f" ({processes} processes)" if processes > 1 else ""
        raise TrainError(f"the run needs {need / 2**30:,.2f} GiB of {where}{each} but {have / 2**30:,.2f} GiB is "
                         f"available (n_layer {m.n_layer}, n_embd {m.n_embd}, batch_size {t.batch_size}, "
                         f"block_size {m.block_size}; most of it {biggest}); lower {lower}")
    return need
