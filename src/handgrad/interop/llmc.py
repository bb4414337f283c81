"""llm.c model files (train_gpt2.c's gpt2_124M.bin format) in and out: a 256-int32 header, then
every tensor in llm.c's order, float32 (version 3) or bfloat16 (version 5), vocab padded to 128."""
import os
from pathlib import Path

import numpy as np

from ..models import family_of
from .common import ConvertError, check_weights, make_config
from .hf import bf16_to_f32, f32_to_bf16


LLMC_MAGIC = 20240326
LLMC_VERSIONS = {3: "float32", 5: "bfloat16"}
LLMC_HEADER_INTS = 256
LLMC_PAD = 128  # llm.c pads the vocabulary to a multiple of 128 (50257 -> 50304)


# ---------------------------------------------------------------- llm.c
def _llmc_order(config):
    """(handgrad name pattern, llm.c shape, transpose?) in llm.c's file order; {i} runs over layers."""
    C = config.n_embd
    return [("h.{i}.ln_1.weight", (C,), False), ("h.{i}.ln_1.bias", (C,), False),
            ("h.{i}.attn.c_attn.weight", (3 * C, C), True), ("h.{i}.attn.c_attn.bias", (3 * C,), False),
            ("h.{i}.attn.c_proj.weight", (C, C), True), ("h.{i}.attn.c_proj.bias", (C,), False),
            ("h.{i}.ln_2.weight", (C,), False), ("h.{i}.ln_2.bias", (C,), False),
            ("h.{i}.mlp.c_fc.weight", (4 * C, C), True), ("h.{i}.mlp.c_fc.bias", (4 * C,), False),
            ("h.{i}.mlp.c_proj.weight", (C, 4 * C), True), ("h.{i}.mlp.c_proj.bias", (C,), False)]


def _padded(V):
    return (V + LLMC_PAD - 1) // LLMC_PAD * LLMC_PAD


def read_llmc(path):
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConvertError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) < 4 * LLMC_HEADER_INTS:
        raise ConvertError(f"{path}: {len(raw)} bytes, shorter than llm.c's {4 * LLMC_HEADER_INTS}-byte header")
    h = np.frombuffer(raw, dtype="<i4", count=LLMC_HEADER_INTS)
    if h[0] != LLMC_MAGIC:
        raise ConvertError(f"{path}: header magic {h[0]}, expected {LLMC_MAGIC} (not an llm.c model file)")
    version = int(h[1])
    if version not in LLMC_VERSIONS:
        raise ConvertError(f"{path}: header version {version} is not supported (3 = float32, 5 = bfloat16)")
    maxT, V, L, NH, C, Vp = (int(x) for x in h[2:8])
    if Vp < V:
        raise ConvertError(f"{path}: header padded_vocab_size {Vp} is below vocab_size {V}")
    config = make_config(path, block_size=maxT, vocab_size=V, n_layer=L, n_head=NH, n_embd=C)
    order = _llmc_order(config)
    sizes = [Vp * C, maxT * C] + [L * int(np.prod(s)) for _, s, _ in order] + [C, C]
    count = sum(sizes)
    itemsize = 4 if version == 3 else 2
    expected = 4 * LLMC_HEADER_INTS + count * itemsize
    if len(raw) != expected:
        raise ConvertError(f"{path}: {len(raw)} bytes, but its header's shapes need {expected} "
                           f"({LLMC_VERSIONS[version]}); the file is truncated or not this model")
    flat = np.frombuffer(raw, dtype="<f4" if version == 3 else "<u2", offset=4 * LLMC_HEADER_INTS, count=count)
    flat = flat.astype(np.float32) if version == 3 else bf16_to_f32(flat)
    offsets = np.cumsum([0] + sizes)
    chunk = lambda k: flat[offsets[k]:offsets[k + 1]]
    weights = {"wte.weight": chunk(0).reshape(Vp, C)[:V].copy(), "wpe.weight": chunk(1).reshape(maxT, C).copy()}
    for k, (pattern, shape, transpose) in enumerate(order):
        stacked = chunk(2 + k).reshape(L, *shape)
        for i in range(L):
            weights[pattern.format(i=i)] = np.ascontiguousarray(stacked[i].T if transpose else stacked[i])
    weights["ln_f.weight"], weights["ln_f.bias"] = chunk(len(sizes) - 2).copy(), chunk(len(sizes) - 1).copy()
    return config, weights, {"tokenizer": None, "llmc_version": version, "padded_vocab_size": Vp}


def write_llmc(dst, config, weights, version=3, padded_vocab=None):
    """llm.c's model file: header, then the tensors in llm.c's order, [out, in], wte padded with zeros.
    GPT-2 only: the file has no place for a llama-family or Gemma 3 model's norms, rotary heads, gated
    MLP or q/k norms."""
    if family_of(config).arch != "gpt2":
        what = " with Qwen3's q/k norms" if family_of(config).arch == "llama" and config.qk_norm else ""
        raise ConvertError(f"--format llmc: a {family_of(config).arch} model{what}; llm.c's model file holds GPT-2 "
                           f"models only: use --format hf, gguf or handgrad")
    if version not in LLMC_VERSIONS:
        raise ConvertError(f"llm.c version {version} is not supported (3 = float32, 5 = bfloat16)")
    check_weights(config, weights, "weights")
    C, V, L = config.n_embd, config.vocab_size, config.n_layer
    Vp = padded_vocab if padded_vocab and padded_vocab >= V else _padded(V)
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[:8] = LLMC_MAGIC, version, config.block_size, V, L, config.n_head, C, Vp
    wte = np.zeros((Vp, C), np.float32)
    wte[:V] = weights["wte.weight"]
    parts = [wte, weights["wpe.weight"]]
    for pattern, _, transpose in _llmc_order(config):
        parts += [weights[pattern.format(i=i)].T if transpose else weights[pattern.format(i=i)] for i in range(L)]
    parts += [weights["ln_f.weight"], weights["ln_f.bias"]]
    dst = Path(dst)
    if dst.exists():
        raise ConvertError(f"{dst}: already exists; choose a new output path")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".tmp_{dst.name}_{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            for p in parts:
                p = np.ascontiguousarray(p, dtype=np.float32)
                f.write((p.astype("<f4") if version == 3 else f32_to_bf16(p)).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dst

