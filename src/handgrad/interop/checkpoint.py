"""Checkpoints: RUN_DIR/ckpt/step_{N:08d}/ holding

    model.safetensors   the weights, under model.state_dict()'s Hugging Face names; a LoRA run's
                        only what trains (model.layout: its adapters, and norms or embeddings where
                        trained), its frozen base named in state.json's "base"
    optim.safetensors   AdamW's moments: exp_avg.{name} and exp_avg_sq.{name}
    state.json          step, config, optimizer scalars, every RNG state, the data position,
                        the SHA-256 of both tensor files (checked on load) and a CRC-32 of every
                        tensor (to name the damaged tensor when a file's SHA-256 does not match)

Each is written into a temporary directory, fsynced, then renamed into place, so a checkpoint
directory either is complete or does not exist. Nothing is ever pickled.
"""
import hashlib
import json
import os
import re
import shutil
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from ..config import LoRAConfig
from ..files import save_safetensors
from ..models import family_of, get_family


CKPT_DIR = "ckpt"
_NAME = re.compile(r"^step_(\d{8})$")


class CheckpointError(ValueError):
    """A missing, incomplete or corrupt checkpoint; the message names the file."""


def checkpoint_dir(run_dir, step):
    return Path(run_dir) / CKPT_DIR / f"step_{step:08d}"


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _crc32(arr):
    return zlib.crc32(np.ascontiguousarray(arr).data)


def _damaged_tensor(path, crcs):
    """The first tensor of a safetensors file whose CRC-32 differs from the saved one, or why none
    can be named (a file too damaged to parse)."""
    try:
        tensors = load_file(str(path))
    except Exception:  # noqa: BLE001 - any parse failure means the header or sizes are broken
        return "the file is truncated or its header is damaged"
    for name, crc in crcs.items():
        if name not in tensors:
            return f"tensor {name} is missing"
        if _crc32(tensors[name]) != crc:
            return f"tensor {name} differs from what was saved"
    return "its bytes differ outside the tensors (header or padding)"


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _split(flat, model):
    return {name: np.asarray(flat[o:o + int(np.prod(s))]).reshape(s) for name, (o, s) in model.layout.items()}


def _write_checkpoint(final, files, doc):
    """Write files ({name: {tensor name: array}}) and state.json (doc, plus both checksums) into a
    temporary directory beside `final`, fsync, then rename it to `final`."""
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(".tmp_step_*"):  # left by a process killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.parent / f".tmp_{final.name}_{os.getpid()}"
    tmp.mkdir()
    try:
        for f, tensors in files.items():
            save_safetensors(tensors, tmp / f, metadata={"format": "handgrad"})
        doc = dict(doc, sha256={f: _sha256(tmp / f) for f in files},
                   crc32={f: {n: _crc32(a) for n, a in t.items()} for f, t in files.items()})
        (tmp / "state.json").write_text(json.dumps(doc, indent=1))
        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
        if final.exists():  # re-saving a step (a resumed run that stopped at the same step)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def save_checkpoint(run_dir, step, model, optimizer, state):
    """Write checkpoint `step` atomically (prune_checkpoints then removes the oldest).

    `state` is a JSON-able dict (config, RNG states, data position); step and the optimizer's
    scalars are added here. Returns the checkpoint's directory. A LoRA run's state names its frozen
    base in "base" by where it came from and the SHA-256 of its weights (models/lora.py's
    base_digest); a llama run started from a pretrained model records that model's context_length
    (its exports give it: a RoPE model is not cut to the block_size it trained on).
    """
    weights = {n: model.ops.to_numpy(model.p[n]) for n in model.layout}  # views on the cpu: no copy of the weights
    moments = {f"exp_avg.{n}": a for n, a in _split(model.ops.to_numpy(optimizer.m), model).items()}
    moments.update({f"exp_avg_sq.{n}": a for n, a in _split(model.ops.to_numpy(optimizer.v), model).items()})
    final = _write_checkpoint(checkpoint_dir(run_dir, step),
                              {"model.safetensors": weights, "optim.safetensors": moments},
                              dict(state, step=step, optimizer=optimizer.state()))
    return final


def prune_checkpoints(run_dir, keep):
    """Delete all but the newest `keep` checkpoints; returns the deleted directories."""
    old = [path for _, path in list_checkpoints(run_dir)[:-keep]]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def save_weights(run_dir, step, config, weights, info=None):
    """A weights-only checkpoint (no optimizer state): what `handgrad convert` writes. It loads
    with load_model (sample, --init-from) but cannot be --resume'd."""
    from dataclasses import asdict
    doc = dict(info or {}, step=step, arch=family_of(config).arch, model_config=asdict(config), weights_only=True)
    return _write_checkpoint(checkpoint_dir(run_dir, step),
                             {"model.safetensors": {k: np.ascontiguousarray(v, dtype=np.float32)
                                                    for k, v in weights.items()}}, doc)


def list_checkpoints(run_dir):
    """[(step, path)] of the complete checkpoints (those with a state.json), oldest first."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _NAME.match(d.name)
        if m and (d / "state.json").is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def read_state(ckpt_dir):
    """state.json of a checkpoint, after checking both tensor files against their SHA-256."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / "state.json"
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {ckpt_dir} is not a complete checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt JSON ({e})") from None
    for name, digest in state.get("sha256", {}).items():
        f = ckpt_dir / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing")
        if _sha256(f) != digest:
            detail = _damaged_tensor(f, state.get("crc32", {}).get(name, {}))
            raise CheckpointError(f"{f}: checksum mismatch (truncated or corrupted): {detail}")
    return state


def _load_tensors(path):
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors ({e})") from None


def resolve(path):
    """A run directory (its newest complete checkpoint) or a checkpoint directory -> the latter."""
    path = Path(path)
    if (path / "state.json").is_file():
        return path
    ckpts = list_checkpoints(path)
    if not ckpts:
        if not path.exists():
            raise CheckpointError(f"{path}: no such run or checkpoint directory")
        raise CheckpointError(f"{path}: no complete checkpoint in {path / CKPT_DIR}; train first")
    return ckpts[-1][1]


def load_model(path, backend="cpu", base=None, quant=None):
    """The model (of the family state.json names) with the weights of a checkpoint, or of a run
    directory's newest checkpoint. A LoRA run's comes back as a LoRA model: base(model, ref) loads
    its frozen base weights first (load.py's load_base). quant: the block matrices held quantized
    (a LoRA run's base_quant replaced; None: as the run holds them)."""
    ckpt = resolve(path)
    state = read_state(ckpt)
    try:
        family = get_family(state.get("arch", "gpt2"))  # checkpoints before model.arch are GPT-2's
        config = family.config(**state["model_config"])
        lora = LoRAConfig(**dict(state["lora"], targets=tuple(state["lora"]["targets"]))) if state.get("lora") else None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{ckpt / 'state.json'}: not a model this handgrad can build ({e}); "
                              f"use a checkpoint written by handgrad train") from None
    if lora is not None and quant is not None:
        lora = replace(lora, base_quant=quant)
    model = family.model(config, backend=backend, lora=lora,
                         **({"quant": quant} if lora is None and quant is not None else {}))
    if lora is not None:
        if base is None:
            raise CheckpointError(f"{ckpt}: a LoRA checkpoint; its base model must be loaded with it")
        base(model, state["base"])
    _load_weights(ckpt, model)
    return model


def load_weights(ckpt_dir):
    """The weights of a checkpoint (checked by read_state first) as {name: array}."""
    return _load_tensors(Path(ckpt_dir) / "model.safetensors")


def _load_weights(ckpt_dir, model):
    path = Path(ckpt_dir) / "model.safetensors"
    try:
        model.load_state_dict(load_weights(ckpt_dir), names=model.layout)  # a LoRA model's: what trains
    except CheckpointError:
        raise
    except ValueError as e:  # missing, extra or mis-shaped tensors
        raise CheckpointError(f"{path}: {e}; the weights do not fit the model_config in state.json (files mixed "
                              f"up or edited); use an intact checkpoint") from None


def restore(ckpt_dir, model, optimizer, base=None):
    """Load a checkpoint's weights and AdamW state into `model` and `optimizer`; return state.json.
    A LoRA checkpoint's base weights first, by base(model, state["base"])."""
    ckpt_dir = Path(ckpt_dir)
    state = read_state(ckpt_dir)
    if state.get("weights_only"):
        raise CheckpointError(f"{ckpt_dir}: a weights-only checkpoint (made by handgrad convert) has no optimizer "
                              f"state to resume; start a new run with --init-from {ckpt_dir.parent.parent}")
    if model.lora is not None:
        if not state.get("base"):
            raise CheckpointError(f"{ckpt_dir / 'state.json'}: no base model recorded for this LoRA run's adapters")
        base(model, state["base"])
    _load_weights(ckpt_dir, model)
    moments = _load_tensors(ckpt_dir / "optim.safetensors")
    for key, flat in (("exp_avg", optimizer.m), ("exp_avg_sq", optimizer.v)):
        # the flat moments' length (ZeRO-1's stand-in: the buffers' padded length); a padded
        # vocabulary's rows and that padding hold no moments (zeros)
        host = np.zeros(flat.shape[0], dtype=np.float32)
        for name, (o, shape) in model.layout.items():
            arr = moments.get(f"{key}.{name}")
            if arr is None or tuple(arr.shape) != tuple(shape):
                raise CheckpointError(f"{ckpt_dir / 'optim.safetensors'}: {key}.{name} missing or mis-shaped")
            host[o:o + arr.size] = arr.reshape(-1)
        flat[:] = model.ops.from_numpy(host)
    optimizer.load_state(state["optimizer"])
    return state

