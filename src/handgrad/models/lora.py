"""LoRA inside a family's model: which tensors train, where the adapters live, and the adapter
records the ops take (backends' lora.py, lora_forward, says what one holds).

A model built with `lora=LoRAConfig(...)` (FlatModel) keeps two flat buffers: flat_params /
flat_grad, what trains (the adapters, and the norms or the embeddings where train_norms /
train_embeddings say so), laid out by model.spec; and frozen_params, the base weights, with no
gradient buffer, no AdamW moments and no weight-gradient product in the backward (with bf16
products on the cpu, frozen16 holds the frozen matrices as bf16 only; models/lora_layout.py lays
them out). model.p still names every tensor, model.g only the trained ones.

A family says which linears can carry adapters: LORA_MODULES, {short name: (module path in a
block, fused group)}. A fused group is one product of the family's forward (Llama's q|k|v and
gate|up are one matrix each); its adapters sit on the group's output columns in module order."""
import hashlib
import re
from types import SimpleNamespace

import numpy as np

_LAYER = re.compile(r"^(?:model\.layers|h)\.(\d+)\.")
SITE_LORA = 8  # dropout sites from 8 on: one per target (model sites 0-7 are models/dropout.py's)


def layer_of(name):
    """The block index of a parameter name (Hugging Face's model.layers.{l}. or GPT-2's h.{l}.), or None."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def _module_shape(model_cls, base, module):
    """(in, out) features of a block's linear from its base weight's shape."""
    shape = base[module + ".weight"]
    return (shape[0], shape[1]) if model_cls.FAN_IN_FAN_OUT else (shape[1], shape[0])


def split_spec(model_cls, config, lora):
    """(trained spec, frozen spec, adapters) for a LoRA model of this family: the param_spec tensors
    that train or stay frozen, the adapters inserted after each block's tensors, and per block the
    adapters as [(short, group, module, lo, hi)] (lo:hi its columns of the group's product).

    The adapters are PEFT's tensors under PEFT's names without its `base_model.model.` prefix: for
    each targeted linear `{module}.lora_A.weight` (r, in) and `{module}.lora_B.weight` (out, r), right
    after the block's own tensors, so each block's trained tensors are one contiguous range of the
    flat buffers (the data-parallel gradient buckets)."""
    base = model_cls.param_spec(config)
    shapes = dict(base)
    unknown = [t for t in lora.targets if t not in model_cls.LORA_MODULES]
    if unknown:
        raise ValueError(f"train.lora_targets: {unknown[0]!r} is not a linear of this family; choose from "
                         f"{','.join(model_cls.LORA_MODULES)}")

    def trains(name):
        if layer_of(name) is None and not model_cls.is_norm(name):
            return lora.train_embeddings  # embeddings, positions, an untied lm_head
        return lora.train_norms and model_cls.is_norm(name)

    per_block = []
    for l in range(config.n_layer):
        prefix, cols, blocks = model_cls.block_prefix(l), {}, []
        for short, (module, group) in model_cls.LORA_MODULES.items():
            fan_in, fan_out = _module_shape(model_cls, shapes, prefix + module)
            lo = cols.get(group, 0)
            cols[group] = lo + fan_out
            if short in lora.targets:
                blocks.append(SimpleNamespace(short=short, group=group, module=prefix + module, lo=lo,
                                              hi=lo + fan_out, fan_in=fan_in, fan_out=fan_out))
        per_block.append(blocks)
    trained, frozen = [], []
    for i, (name, shape) in enumerate(base):
        (trained if trains(name) else frozen).append((name, shape))
        l = layer_of(name)
        if l is not None and (i + 1 == len(base) or layer_of(base[i + 1][0]) != l):  # the block's last tensor
            for t in per_block[l]:
                trained += [(t.module + ".lora_A.weight", (lora.rank, t.fan_in)),
                            (t.module + ".lora_B.weight", (t.fan_out, lora.rank))]
    return trained, frozen, per_block


def group_widths(model_cls, config):
    """{fused group: its product's output width} for a block of this family (q|k|v, gate|up, ...)."""
    shapes, widths = dict(model_cls.param_spec(config)), {}
    for module, group in model_cls.LORA_MODULES.values():
        widths[group] = widths.get(group, 0) + _module_shape(model_cls, shapes, model_cls.block_prefix(0) + module)[1]
    return widths


def initial_adapters(lora_blocks, rank, seed):
    """{name: array} of new adapters, as PEFT initialises them: lora_A ~ U(-1/sqrt(in), 1/sqrt(in))
    (kaiming_uniform_(a=sqrt(5))), lora_B = 0, so a new adapter leaves the model's outputs unchanged.
    NumPy only (a PyTorch side can start from them)."""
    rng, out = np.random.default_rng([seed, 0x10A]), {}
    for blocks in lora_blocks:
        for t in blocks:
            bound = 1.0 / np.sqrt(t.fan_in)
            out[t.module + ".lora_A.weight"] = rng.uniform(-bound, bound, (rank, t.fan_in)).astype(np.float32)
            out[t.module + ".lora_B.weight"] = np.zeros((t.fan_out, rank), np.float32)
    return out


def init_adapters(model, seed):
    """The model's adapters set to initial_adapters'."""
    for name, value in initial_adapters(model.lora_blocks, model.lora.rank, seed).items():
        model.p[name][...] = model.ops.from_numpy(value)


def adapter_records(model):
    """Per block, {group: [adapter record]} as the ops take them (their xs and seed are set per forward)."""
    lora, records = model.lora, []
    for blocks in model.lora_blocks:
        groups = {}
        for i, t in enumerate(blocks):
            a, b = t.module + ".lora_A.weight", t.module + ".lora_B.weight"
            groups.setdefault(t.group, []).append(SimpleNamespace(
                lo=t.lo, hi=t.hi, lora_a=model.p[a].T, lora_b=model.p[b].T, dlora_a=model.g[a].T,
                dlora_b=model.g[b].T, scale=lora.scale, dropout=lora.dropout, seed=0, xs=None, index=i))
        records.append(groups)
    return records


def decode_records(model):
    """Per block, {group: [adapter record]} for decoding (models/decode.py): the adapters' views,
    no gradients, no dropout; each record's xs is the decode cache's scratch, set per call."""
    return [{group: [SimpleNamespace(lo=ad.lo, hi=ad.hi, lora_a=ad.lora_a, lora_b=ad.lora_b, scale=ad.scale,
                                     dropout=0.0, seed=0, xs=None) for ad in ads]
             for group, ads in groups.items()} for groups in model.adapters]


def merged_weights(model, lazy=False):
    """The base weights with every adapter folded in, W + (alpha / r) B A (in the base layout:
    [out, in], or GPT-2's Conv1D [in, out]), under param_spec's names: a plain model's state_dict.
    lazy: each tensor is computed when it is read (np.asarray), for load_state_dict, which reads
    them one at a time: a plain model is then made without a second float32 copy of every weight
    (2 GB for a 0.5B model)."""
    adapters = {t.module + ".weight": t for blocks in model.lora_blocks for t in blocks}
    if lazy:
        return {name: _MergedTensor(model, name, adapters.get(name)) for name in model.base_names}
    return {name: _merged(model, name, adapters.get(name)) for name in model.base_names}


def _merged(model, name, t):
    """A float32 copy of base tensor `name`, with adapter t (or None) folded in."""
    w = model.weight(name)
    if t is not None:
        a = model.ops.to_numpy(model.p[t.module + ".lora_A.weight"]).astype(np.float64)
        b = model.ops.to_numpy(model.p[t.module + ".lora_B.weight"]).astype(np.float64)
        delta = model.lora.scale * (b @ a)  # (out, in)
        w += (delta.T if model.FAN_IN_FAN_OUT else delta).astype(np.float32)
    return w


class _MergedTensor:
    """One tensor of merged_weights(lazy=True): its shape and dtype now, its values when read."""
    dtype = np.dtype(np.float32)

    def __init__(self, model, name, adapter):
        self.model, self.name, self.adapter = model, name, adapter
        self.shape = tuple(model.p[name].shape)

    def __array__(self, dtype=None, copy=None):
        w = _merged(self.model, self.name, self.adapter)
        return w if dtype is None else w.astype(dtype, copy=False)


def weights_digest(spec, weights):
    """SHA-256 over a model's weights (spec: its param_spec, names and shapes in order; weights: name
    -> array, hashed as float32 bytes)."""
    h = hashlib.sha256()
    for name, shape in spec:
        h.update(f"{name}:{tuple(shape)};".encode())
        h.update(np.ascontiguousarray(weights[name], dtype=np.float32).data)
    return h.hexdigest()


def base_digest(model):
    """weights_digest of the base weights a LoRA model holds: what a LoRA checkpoint records of its
    base, checked when the base is loaded. A base held as bf16 (train.dtype bfloat16 on the cpu)
    reports the digest of the float32 weights it was narrowed from, taken as they were drawn or
    loaded (model.base_sha256), so a run's record is the same in either dtype."""
    if model.base_sha256 is not None:
        return model.base_sha256
    return weights_digest(model.param_spec(model.config), {n: model.weight(n) for n in model.base_names})


def lora_flops_per_token(family, config, lora, T):
    """Training FLOPs per token of a LoRA run: the family's count (6 per matrix parameter, plus
    attention) less the weight-gradient product of every frozen matrix (2 of its 6: the forward's
    product and the input gradient's remain), plus 6 per adapter parameter. A frozen tied or
    untied lm_head saves its weight gradient too; embeddings that train keep theirs."""
    trained, frozen, _ = split_spec(family.model, config, lora)
    saved = sum(int(np.prod(s)) for n, s in frozen if len(s) == 2 and family.model.is_product(n, config))
    adapters = sum(int(np.prod(s)) for n, s in trained if ".lora_" in n)
    return family.flops_per_token(config, T) - 2 * saved + 6 * adapters
