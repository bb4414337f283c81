"""PEFT's LoRA adapter format: a directory holding adapter_config.json and adapter_model.safetensors,
as peft's PeftModel.save_pretrained writes it and PeftModel.from_pretrained(base_model, DIR) loads it.

Keys are `base_model.model.` + the Hugging Face base model's module + `.lora_A.weight` (r, in) or
`.lora_B.weight` (out, r), for every family (GPT-2's modules under `transformer.`; its Conv1D base
weights are [in, out], which adapter_config.json's fan_in_fan_out says). target_modules name each
linear by its path inside a block ("self_attn.q_proj", "attn.c_proj"), so GPT-2's two c_proj are
told apart. Norms or embeddings trained beside the adapters (train.lora_train_norms /
lora_train_embeddings) are PEFT's modules_to_save, their tensors under `base_model.model.` + name.

What handgrad reads back is what it writes (read_peft_config). The base model is named as PEFT users
expect it (base_name), while handgrad records beside it, where PEFT does not read, what finds and
checks the base (recorded_base, resolve_base).
"""
import json
import os
from pathlib import Path

import numpy as np

from ..config import LoRAConfig
from ..files import save_safetensors
from ..models import get_family
from .common import ConvertError, prepare_dir, publish_dir, read_json_object
from .published import PUBLISHED, published_name

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
HF_PREFIX = {"gpt2": "transformer.", "llama": "", "gemma3": ""}  # the Hugging Face module names over param_spec's
# adapter_model.safetensors' metadata: the base's weights_digest, the block_size it was taken at, its absolute
# path and the base_model_name_or_path written beside it
BASE_SHA256, BASE_BLOCK_SIZE = "handgrad.base_sha256", "handgrad.base_block_size"
BASE_PATH, BASE_NAME = "handgrad.base_path", "handgrad.base_model_name_or_path"


def _module_leaf(name):
    """A tensor's module as PEFT's modules_to_save names it: "model.norm.weight" -> "norm"."""
    return name.rsplit(".", 1)[0].split(".")[-1]


def is_peft(path):
    return Path(path).is_dir() and (Path(path) / CONFIG_FILE).is_file()


def base_name(base_path, dst):
    """base_model_name_or_path of an adapter written to dst over the base recorded as base_path (a
    published model's name, or a path): the published model's Hugging Face id, else base_path
    relative to dst, so an adapter moves with its base; None for no path (a random base). E.g.
    `HuggingFaceTB/SmolLM2-135M-Instruct` for `smollm2-135m-instruct` (published.py)."""
    if not base_path:
        return None
    if _published(base_path):
        return PUBLISHED[published_name(base_path)].hf_id
    return os.path.relpath(Path(base_path).resolve(), Path(dst).resolve())


def _published(base_path):
    """Whether a base recorded as base_path is a published model's name (not a path of that name)."""
    return published_name(base_path) is not None and not Path(base_path).exists()


def write_peft(dst, arch, lora, tensors, base_path=None, tied=False, base_sha256=None, block_size=None):
    """dst/adapter_config.json and dst/adapter_model.safetensors from a LoRA model's trained tensors
    (`tensors`: model.layout's names -> arrays) over the base at base_path (a path or a published
    model's name) whose weights_digest, at block_size, is base_sha256. Returns (dst, one line saying
    what was written)."""
    cls = get_family(arch).model
    hf = HF_PREFIX[arch]
    saved = sorted({_module_leaf(n) for n in tensors if ".lora_" not in n})
    name = base_name(base_path, dst)
    if tied and any(not cls.is_norm(n) and ".lora_" not in n for n in tensors):
        raise ConvertError("--format peft: this run trained its tied embeddings (train.lora_train_embeddings), which a "
                           "PEFT adapter cannot hold (PEFT copies the embedding, not the lm_head tied to it); export "
                           "the whole model with --merge --format hf instead")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": lora.dropout, "target_modules": [cls.LORA_MODULES[t][0] for t in lora.targets],
              "fan_in_fan_out": cls.FAN_IN_FAN_OUT, "bias": "none", "modules_to_save": saved or None,
              "base_model_name_or_path": name, "inference_mode": True,
              "init_lora_weights": True, "use_rslora": False, "use_dora": False, "layers_to_transform": None,
              "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "revision": None}
    metadata = {"format": "pt"}
    if base_sha256:
        metadata[BASE_SHA256] = base_sha256
        metadata.update({BASE_BLOCK_SIZE: str(block_size)} if block_size else {})
    if base_path and not _published(base_path):
        metadata.update({BASE_PATH: str(Path(base_path).resolve()), BASE_NAME: name})
    tmp = prepare_dir(dst)
    save_safetensors({PREFIX + hf + n: np.ascontiguousarray(a, dtype=np.float32) for n, a in tensors.items()},
                     tmp / WEIGHTS_FILE, metadata=metadata)
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    n = sum(int(np.prod(a.shape)) for a in tensors.values())
    return publish_dir(tmp, dst), (f"wrote a PEFT LoRA adapter ({CONFIG_FILE}, {WEIGHTS_FILE}): r {lora.rank}, "
                                   f"alpha {lora.alpha:g}, {len(lora.targets)} target modules, {n:,} parameters"
                                   + (f", modules_to_save {', '.join(saved)}" if saved else ""))


def read_peft_config(path):
    """adapter_config.json as (LoRAConfig-ready fields, base_model_name_or_path), refusing what
    handgrad's LoRA cannot express: anything but LoRA (not DoRA, not rsLoRA) with one rank and alpha
    for every module and bias "none" is refused with a line naming the key."""
    f = Path(path) / CONFIG_FILE
    doc = read_json_object(f)
    if doc.get("peft_type") != "LORA":
        raise ConvertError(f"{f}: peft_type {doc.get('peft_type')!r}; handgrad reads LoRA adapters (LORA) only")
    for key, ok in (("use_dora", False), ("use_rslora", False), ("bias", "none")):
        if doc.get(key, ok) not in (ok, None):
            raise ConvertError(f"{f}: {key} {doc.get(key)!r} is not supported (handgrad's LoRA has {key} {ok!r})")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform"):
        if doc.get(key):
            raise ConvertError(f"{f}: {key} {doc.get(key)!r}: handgrad's LoRA has one rank and alpha on every block")
    r, alpha = doc.get("r"), doc.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ConvertError(f"{f}: r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ConvertError(f"{f}: lora_alpha must be a positive number, got {alpha!r}")
    targets = doc.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets:
        raise ConvertError(f"{f}: target_modules must be a list of module names, got {targets!r}")
    dropout = doc.get("lora_dropout") or 0.0
    return {"rank": r, "alpha": float(alpha), "targets": targets, "dropout": float(dropout),
            "modules_to_save": doc.get("modules_to_save") or []}, doc.get("base_model_name_or_path")


def _short_names(cls, targets, where):
    """PEFT target_modules (suffixes of module names) -> the family's train.lora_targets names."""
    short = []
    for t in targets:
        hits = [s for s, (module, _) in cls.LORA_MODULES.items() if module == t or module.endswith("." + t)]
        if not hits:
            raise ConvertError(f"{where}: target_modules entry {t!r} is no linear of a block that handgrad can adapt "
                               f"({', '.join(m for m, _ in cls.LORA_MODULES.values())})")
        short += [s for s in hits if s not in short]
    return tuple(s for s in cls.LORA_MODULES if s in short)


def read_peft(path, fields, arch, config):
    """(LoRAConfig, {param name: array}) of the adapter at path, whose adapter_config.json
    read_peft_config read into `fields`, for a base of family `arch` and architecture config (the
    tensors' shapes are checked when a model takes them: load.lora_model)."""
    from safetensors.numpy import load_file
    cls = get_family(arch).model
    where = Path(path) / CONFIG_FILE
    targets = _short_names(cls, fields["targets"], where)
    saved = set(fields["modules_to_save"])
    norms = {n for n, _ in cls.param_spec(config) if cls.is_norm(n)}
    lora = LoRAConfig(rank=fields["rank"], alpha=fields["alpha"], targets=targets, dropout=fields["dropout"],
                      train_norms=any(_module_leaf(n) in saved for n in norms),
                      train_embeddings=bool(saved - {_module_leaf(n) for n in norms}))
    f = Path(path) / WEIGHTS_FILE
    try:
        raw = load_file(str(f))
    except Exception as e:  # noqa: BLE001 - a missing or damaged file: safetensors' own error types
        raise ConvertError(f"{f}: cannot read safetensors ({e})") from None
    hf = PREFIX + HF_PREFIX[arch]
    tensors = {}
    for key, arr in raw.items():
        if not key.startswith(hf):
            raise ConvertError(f"{f}: key {key} does not start with {hf!r} (an adapter for another architecture?)")
        name = key[len(hf):]
        tensors[name] = arr.astype(np.float32)  # float16 / bfloat16 adapters too
    return lora, tensors


def recorded_base(path):
    """What the adapter at path records of its base beside base_model_name_or_path: {"sha256",
    "block_size", "path", "name"}, those it has; {} for an adapter PEFT wrote (or a weights file
    read_peft will refuse). They live in adapter_model.safetensors' metadata, which PEFT does not
    read, so its config loads without a warning: the SHA-256 of the base's weights (models/lora.py:
    weights_digest, at the recorded block_size) and the base's absolute path."""
    from safetensors import safe_open
    try:
        with safe_open(str(Path(path) / WEIGHTS_FILE), framework="numpy") as f:
            meta = f.metadata() or {}
    except Exception:  # noqa: BLE001 - a missing or damaged file: read_peft says so, naming it
        return {}
    out = {"sha256": meta.get(BASE_SHA256), "path": meta.get(BASE_PATH), "name": meta.get(BASE_NAME)}
    if (meta.get(BASE_BLOCK_SIZE) or "").isdigit():
        out["block_size"] = int(meta[BASE_BLOCK_SIZE])
    return {k: v for k, v in out.items() if v}


def resolve_base(path, base, recorded=None):
    """Where the base model of the adapter at path lies: base_model_name_or_path as a path (absolute,
    or relative to the adapter, then to the working directory), a published model (its Hugging Face
    id or name), or, while base_model_name_or_path is still the one exported, the absolute path
    recorded beside it (`recorded`: recorded_base's; an adapter moved without its base); else a
    ConvertError saying what to do. The base found must then have the recorded digest (interop/load.py
    checks it)."""
    where = Path(path) / CONFIG_FILE
    if not base:
        raise ConvertError(f"{where}: base_model_name_or_path is empty; set it to the base model's directory")
    for candidate in ([Path(base)] if Path(base).is_absolute() else [Path(path) / base, Path(base)]):
        if candidate.exists():
            return candidate
    if published_name(base) is not None:
        return published_name(base)
    recorded = recorded or {}
    if recorded.get("path") and recorded.get("name") == base and Path(recorded["path"]).exists():
        return Path(recorded["path"])
    raise ConvertError(f"{where}: base model {base!r} is not on this machine (handgrad downloads nothing); put the "
                       f"base model's directory there, or set base_model_name_or_path to where it lies")
