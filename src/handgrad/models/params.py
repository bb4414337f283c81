"""The flat parameter buffers every family lays its tensors out in, and the initial weights.

`flat_layout(spec, rows)` gives each (name, shape) of a param_spec its offset in one flat buffer (a
tensor named in rows reserving that many rows, its padding after its own: model.vocab_pad's);
`flat_views(flat, layout)` the tensors as views of it. `initialise(spec, seed, rule, into)` draws a
family's initial weights tensor by tensor from one numpy Generator, a chunk at a time: a chunked
draw gives the same numbers as one draw of the whole tensor, so a tensor held as bf16 (a frozen
LoRA base, models/lora.py) is filled and a digest of the weights hashed without ever holding a
float32 copy of the largest tensor. `kept_copy` picks the views of an activation buffer that bf16
products keep narrowed.
"""
import numpy as np

from ..backends import get_backend

CHUNK = 1 << 20  # values drawn (and narrowed or hashed) at a time: 4 MiB of float32 scratch


def padded_rows(rows, multiple):
    """rows rounded up to a multiple of `multiple` (model.vocab_pad's lm_head rows; 1: rows itself)."""
    return -(-rows // multiple) * multiple


def flat_layout(spec, rows=None):
    """name -> (offset, shape) in the flat buffer, and the total size. rows: name -> the rows its
    tensor reserves (at least shape[0]): the shape stays the tensor's own, the rows past it follow
    it in the buffer (a padded vocabulary's zero rows, models/head.py)."""
    offsets, n = {}, 0
    for name, shape in spec:
        offsets[name] = (n, shape)
        n += (max(int(shape[0]), (rows or {}).get(name, 0)) * int(np.prod(shape[1:]))) if len(shape) else 1
    return offsets, n


def flat_views(flat, layout):
    """name -> a view of `flat` with the tensor's shape."""
    return {name: flat[o:o + int(np.prod(s))].reshape(s) for name, (o, s) in layout.items()}


def initialise(spec, seed, rule, into=None, digest=None):
    """A family's initial weights, tensor by tensor in spec's order from one numpy Generator:
    rule(name, shape) is 1.0, 0.0 or ("normal", std). into: None (returns one flat array), or name
    -> the array to fill in place with the same draws: float32, or uint16 (bf16 bit patterns: the
    draws narrowed to bf16, a chunk at a time). digest: a hashlib object fed what
    models/lora.py's weights_digest hashes of these weights (as float32, before any narrowing)."""
    layout, n = flat_layout(spec)
    host = np.zeros(n, dtype=np.float32) if into is None else None
    into = flat_views(host, layout).__getitem__ if into is None else into
    rng = np.random.default_rng(seed)
    scratch = None
    for name, (_, shape) in layout.items():
        out, how = into(name), rule(name, shape)
        if digest is not None:
            digest.update(f"{name}:{tuple(shape)};".encode())
        flat = out.reshape(-1)
        if flat.dtype == np.float32 and digest is None:  # drawn in place: no scratch
            if isinstance(how, tuple):
                rng.standard_normal(dtype=np.float32, out=flat)
                flat *= np.float32(how[1])
            else:
                flat[...] = how
            continue
        scratch = np.empty(CHUNK, np.float32) if scratch is None else scratch
        for i in range(0, flat.size, CHUNK):
            part = scratch[:min(CHUNK, flat.size - i)]
            if isinstance(how, tuple):
                rng.standard_normal(dtype=np.float32, out=part)
                part *= np.float32(how[1])
            else:
                part[...] = how
            if digest is not None:
                digest.update(part.data)
            if flat.dtype == np.uint16:
                get_backend("cpu").to_bf16(part, flat[i:i + part.size])
            else:
                flat[i:i + part.size] = part
    return host


def kept_copy(full, narrow, i):
    """(block i's output as the forward writes it, the bf16 copy kept of it or None), for a family's
    Activations buffer that bf16 products keep narrowed: full[i] where none is kept (narrow None);
    otherwise full's one slot (the forward's only) and narrow[i]."""
    return (full[i], None) if narrow is None else (full[0], narrow[i])


def byte_view(raw, dtype, shape, offset=0):
    """shape's elements of dtype from byte `offset` of the byte buffer raw (None where raw is: a
    memory count's allocator, training/memory.py), for Activations buffers that share bytes."""
    if raw is None:
        return None
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return raw[offset:offset + n].view(dtype).reshape(shape)
