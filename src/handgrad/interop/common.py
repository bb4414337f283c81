"""What every format reader and writer shares: the error type, the check of a weights dict
against the model's spec, and writing a directory whole (into a temporary one, then renamed)."""
import json
import os
import shutil
from pathlib import Path

from ..models import family_of, get_family


class ConvertError(ValueError):
    """A model file or directory that cannot be read or written; the message names the file."""


def check_weights(config, weights, where):
    """Every tensor of the family's param_spec(config) present with its shape, nothing else."""
    spec = dict(family_of(config).param_spec(config))
    for name, shape in spec.items():
        if name not in weights:
            raise ConvertError(f"{where}: tensor {name} is missing")
        if tuple(weights[name].shape) != tuple(shape):
            raise ConvertError(f"{where}: tensor {name} has shape {tuple(weights[name].shape)}, "
                               f"expected {tuple(shape)} for this config")
    extra = sorted(set(weights) - set(spec))
    if extra:
        raise ConvertError(f"{where}: unexpected tensor {extra[0]}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))


def make_config(where, arch="gpt2", **fields):
    """The architecture config of family `arch` from fields, or a ConvertError naming `where`."""
    try:
        return get_family(arch).config(**fields)
    except (TypeError, ValueError) as e:
        raise ConvertError(f"{where}: {e}") from None


def describe(config):
    """One line of a config's architecture, for convert's report."""
    n = family_of(config).num_params(config)
    line = (f"{n / 1e6:.2f}M parameters, {family_of(config).arch}, n_layer {config.n_layer}, n_head {config.n_head}, "
            f"n_embd {config.n_embd}, vocab {config.vocab_size}, block_size {config.block_size}")
    if hasattr(config, "n_kv_head"):
        line += (f", n_kv_head {config.n_kv_head}, ffn_hidden {config.ffn_hidden}, rope_theta {config.rope_theta:g}"
                 f", {'tied' if config.tie_embeddings else 'untied'}" + (", qkv bias" if config.qkv_bias else "")
                 + (f", qk norm, head_dim {config.head_dim}" if config.qk_norm else "")
                 + (f", llama3 rope scaling {config.rope_scaling}" if config.rope_scaling else ""))
    if hasattr(config, "sliding_window_pattern"):  # gemma3's local and global layers
        line += (f", sliding_window {config.sliding_window}, sliding_window_pattern {config.sliding_window_pattern}, "
                 f"local rope_theta {config.rope_local_base_freq:g}, query_pre_attn_scalar "
                 f"{config.query_pre_attn_scalar:g}"
                 + (f", final_logit_softcapping {config.final_logit_softcapping:g}"
                    if config.final_logit_softcapping else ""))
    return line


def prepare_dir(dst):
    """dst as a fresh directory, written through a temporary sibling by publish_dir."""
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConvertError(f"{dst}: already exists and is not empty; choose a new output path")
    tmp = dst.with_name(f".tmp_{dst.name}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish_dir(tmp, dst):
    dst = Path(dst)
    if dst.is_dir():
        dst.rmdir()  # empty (checked by prepare_dir)
    os.rename(tmp, dst)
    return dst


def read_json_object(f):
    """The JSON object in file f; a ConvertError naming f where it cannot be read or is not an object."""
    try:
        doc = json.loads(Path(f).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{f}: cannot read it as JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ConvertError(f"{f}: expected a JSON object")
    return doc
