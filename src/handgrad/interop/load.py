"""Any format in, a model out: format detection and the readers behind `from_pretrained`,
`handgrad train --init-from`, `handgrad sample` and `handgrad convert` (hf.py, hf_llama.py, hf_gemma3.py,
llmc.py, llama2c.py, gguf.py, peft.py, and handgrad runs through checkpoint.py).

Every format is read into one common form, (config, weights): the config a family's architecture
config (GPTConfig, LlamaConfig or Gemma3Config), the weights a dict of float32 arrays under the family's
param_spec names and layouts (llama: Hugging Face LlamaForCausalLM's own; gemma3: Gemma3ForCausalLM's;
gpt2: Hugging Face GPT-2's: Conv1D weights [in, out], no `transformer.` prefix, no lm_head). `handgrad convert`
(convert.py) writes every format from that form, so no reader knows about any writer.

A published model's name (published.py: `smollm2-135m-instruct`) stands for its file wherever a
path is taken, unless a file or directory of that name exists. Nothing is ever unpickled: a
pytorch_model.bin is refused with the command that converts it."""
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..data.gguf_tokenizer import GGUF_MAGIC, read_gguf_metadata
from ..files import write_atomic
from ..models import family_of
from ..models.family import flat_layout, flat_views
from ..models.lora import base_digest, split_spec, weights_digest
from ..models.sampling import FIELDS, SampleError, check_sampling
from .checkpoint import CheckpointError, load_model, load_weights, read_state, resolve
from .common import ConvertError, check_weights, make_config, read_json_object
from .gguf import read_gguf
from .hf import read_hf
from .hf_gemma3 import is_hf_gemma, read_hf_gemma3
from .hf_llama import is_hf_llama, read_hf_llama
from .llama2c import is_llama2c, read_llama2c, size_mismatch
from .llmc import LLMC_MAGIC, read_llmc
from .peft import is_peft, read_peft, read_peft_config, recorded_base, resolve_base
from .published import PUBLISHED, model_ref, resolve_model


# ---------------------------------------------------------------- detection and the common form
def detect_format(path):
    """'hf', 'llmc', 'llama2c', 'gguf', 'peft' or 'handgrad' for a path (or a published model's
    name), or a ConvertError saying what it is not.

    * hf: a directory with config.json and model.safetensors (or shards listed in
      model.safetensors.index.json); GPT-2 (hf.py: a `transformer.` prefix optional, the attn.bias
      buffers ignored, a stored lm_head.weight must equal wte) or, where config.json names
      LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM, the llama family (hf_llama.py); where it
      names Gemma3ForCausalLM (or Gemma3ForConditionalGeneration, its language model), gemma3 (hf_gemma3.py).
      float32, float16 and bfloat16 tensors are read.
    * llmc: llm.c's model file: a 256 x int32 header (magic 20240326, version 3 = float32 or
      5 = bfloat16), tensors in nn.Linear's [out, in] layout, wte padded to Vp rows.
    * llama2c: llama2.c's legacy model file (7 x int32 header, q/k rows in interleaved-pair RoPE
      order), told by its header and exact size, or a directory holding one as model.bin.
    * gguf: a GGUF file of architecture llama, qwen2, qwen3 or gemma3, dequantized as the model reads it
      (gguf.py).
    * peft: a PEFT adapter directory; handgrad: a run directory (its newest checkpoint) or a
      checkpoint directory."""
    path = Path(resolve_model(path))
    if not path.exists():
        raise ConvertError(f"{path}: no such file or directory")
    if path.is_file():
        if path.name == "config.json":
            return detect_format(path.parent)
        with open(path, "rb") as f:
            first = f.read(8).ljust(8, b"\0")
        head = np.frombuffer(first, dtype="<i4")
        if first[:4] == GGUF_MAGIC:
            return "gguf"
        if path.suffix.lower() == ".gguf":
            raise ConvertError(f"{path}: not a GGUF file (it starts with {first[:4]!r}, not {GGUF_MAGIC!r}); the file "
                               f"is corrupt or not a model: download it again")
        if head[0] == LLMC_MAGIC:
            return "llmc"
        if is_llama2c(path):
            return "llama2c"
        if (reason := size_mismatch(path)) is not None:
            raise ConvertError(reason)
        raise ConvertError(f"{path}: not an llm.c model file (magic {head[0]}, expected {LLMC_MAGIC}) nor a "
                           f"llama2.c one; pass a GGUF file, an llm.c or llama2.c .bin model, a Hugging Face model "
                           f"directory or a handgrad run")
    if (path / "state.json").is_file() or (path / "ckpt").is_dir():
        return "handgrad"
    if is_peft(path):
        return "peft"
    if (path / "config.json").is_file():
        try:
            doc = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            doc = None
        if isinstance(doc, dict) and "train" in doc and "model" in doc and "model_type" not in doc:
            return "handgrad"  # a run directory without a checkpoint yet
        return "hf"
    if is_llama2c(path):  # a directory holding model.bin, as an export writes it
        return "llama2c"
    raise ConvertError(f"{path}: neither a Hugging Face model directory (no config.json) nor a handgrad run "
                       f"(no ckpt/ or state.json)")


def foreign_format(path):
    """'hf', 'llmc', 'llama2c', 'gguf' or 'peft' where path is plainly one of those, else None (no error): lets a
    command that takes handgrad runs also take the other formats, keeping its own errors for
    everything else."""
    try:
        fmt = detect_format(path)
    except ConvertError:
        return None
    return fmt if fmt != "handgrad" else None


def load_pretrained(path, merge=True):
    """(config, weights, info) from any supported format; info says the format and where a
    tokenizer.json lies (or None). A LoRA adapter (a PEFT directory, a handgrad LoRA run) comes
    with its base model: merge=True gives the weights with the adapter folded in (the model it
    computes); merge=False the base's, and info["adapter"] = {"lora": LoRAConfig, "tensors": what
    trains, under model.layout's names, "base": the base's record (path, sha256)}."""
    path = resolve_model(path)
    fmt = detect_format(path)
    config, weights, info = {"hf": _read_hf, "llmc": read_llmc, "llama2c": read_llama2c, "gguf": read_gguf,
                             "handgrad": read_handgrad, "peft": _read_peft}[fmt](path)
    info["format"] = fmt
    if merge and "adapter" in info:
        weights = lora_model(config, weights, info["adapter"]).merged_state_dict()
    return config, weights, info


def lora_model(config, base, adapter, backend="cpu"):
    """A LoRA model holding base weights `base` and the adapter (load_pretrained's info["adapter"])."""
    model = family_of(config).model(config, backend=backend, lora=adapter["lora"])
    model.load_state_dict(base, names=model.base_names)
    try:
        model.load_state_dict(adapter["tensors"], names=model.layout)
    except ValueError as e:
        raise ConvertError(f"the adapter does not fit its base model ({e})") from None
    return model


def fit_weights(weights, config):
    """Pretrained weights cut to a run's config: GPT-2's wpe keeps its first block_size rows
    (nanoGPT's crop_block_size)."""
    if "wpe.weight" in weights:
        weights = dict(weights, **{"wpe.weight": weights["wpe.weight"][:config.block_size]})
    return weights


def load_base(model, ref):
    """Load a LoRA model's frozen base, as its checkpoint records it (ref: {"path": where it was
    loaded from} or {"init": "random", "seed": s}, and the "sha256" of its weights), checking the
    digest: adapters on another base would compute something else."""
    if "path" in ref:
        try:
            _, weights, _ = load_pretrained(ref["path"])
        except ConvertError as e:
            raise ConvertError(f"the LoRA run's base model: {e}") from None
        where = ref["path"]
    else:
        layout, _ = flat_layout(model.param_spec(model.config))
        weights = flat_views(model.init_params(model.config, ref["seed"]), layout)
        where = f"the random initialisation of seed {ref['seed']}"
    try:
        model.load_state_dict(fit_weights(weights, model.config), names=model.base_names)
    except ValueError as e:
        raise ConvertError(f"{where}: not the base model of this LoRA run ({e})") from None
    digest = base_digest(model)
    if digest != ref["sha256"]:
        raise ConvertError(f"{where}: its weights differ from the base this LoRA run's adapters were trained on "
                           f"(SHA-256 {digest[:12]}..., recorded {ref['sha256'][:12]}...); put the original base "
                           f"model back at that path")


def _read_peft(path):
    """A PEFT adapter directory: its base model (adapter_config.json's base_model_name_or_path,
    peft.py says where it is looked for), checked against the digest the adapter recorded, and the
    adapter."""
    fields, base = read_peft_config(path)
    recorded = recorded_base(path)
    base = resolve_base(path, base, recorded)
    if detect_format(base) == "peft":
        raise ConvertError(f"{Path(path) / 'adapter_config.json'}: its base {base} is itself an adapter; point "
                           f"base_model_name_or_path at a model")
    config, weights, info = load_pretrained(base)
    family = family_of(config)
    lora, tensors = read_peft(path, fields, family.arch, config)
    _check_fit(base, config, lora, tensors)
    _check_recorded_base(path, base, config, weights, recorded)
    info["adapter"] = {"lora": lora, "tensors": tensors, "base": {"path": model_ref(base),
                                                                  "sha256": weights_digest(family.param_spec(config),
                                                                                           weights)}}
    if (Path(path) / "tokenizer.json").is_file():
        info["tokenizer"] = str(Path(path) / "tokenizer.json")
    return config, weights, info


def _check_fit(base, config, lora, tensors):
    """The adapter's tensors are those a LoRA model over this base trains, by name and shape (what
    lora_model refuses too; said here, before the base's digest is compared)."""
    trained, _, _ = split_spec(family_of(config).model, config, lora)
    want = {n: tuple(s) for n, s in trained}
    got = {n: tuple(a.shape) for n, a in tensors.items()}
    if want != got:
        name = next(n for n in sorted(want.keys() | got.keys()) if want.get(n) != got.get(n))
        raise ConvertError(f"the adapter does not fit its base model ({base}: {name} is "
                           f"{got.get(name, 'missing')} in the adapter, {want.get(name, 'no tensor')} over this base)")


def _check_recorded_base(path, base, config, weights, recorded):
    """The base found for the adapter at path has the weights its export recorded (their digest at
    the recorded block_size: a GPT-2 run's base is cut to the run's); an adapter PEFT wrote records
    none."""
    if "sha256" not in recorded:
        return
    block_size = recorded.get("block_size", config.block_size)
    if block_size <= config.block_size:
        cut = replace(config, block_size=block_size)
        if weights_digest(family_of(cut).param_spec(cut), fit_weights(weights, cut)) == recorded["sha256"]:
            return
    raise ConvertError(f"{base}: not the base model the adapter {path} was trained on (its weights' SHA-256 differs "
                       f"from the recorded {recorded['sha256'][:12]}...); set base_model_name_or_path in "
                       f"{Path(path) / 'adapter_config.json'} to the original base model")


def _read_hf(path):
    """A Hugging Face directory by its config.json's architecture: Llama, Qwen2 or Qwen3 (hf_llama.py),
    Gemma 3 (hf_gemma3.py), else GPT-2 (hf.py, which names the architectures handgrad reads when it is
    none of them)."""
    if is_hf_gemma(path):
        return read_hf_gemma3(path)
    return read_hf_llama(path) if is_hf_llama(path) else read_hf(path)


def from_pretrained(path, backend="cpu"):
    """A model with the weights at `path`, in any supported format (handgrad.GPT.from_pretrained)."""
    config, weights, _ = load_pretrained(path)
    model = family_of(config).model(config, backend=backend, seed=None)
    model.load_state_dict(weights)
    return model


# ---------------------------------------------------------------- handgrad
def read_handgrad(path):
    ckpt = resolve(path)
    state = read_state(ckpt)
    config = make_config(ckpt / "state.json", state.get("arch", "gpt2"), **state["model_config"])
    tok = next((p / "tokenizer.json" for p in (Path(path), ckpt, ckpt.parent.parent)
                if (p / "tokenizer.json").is_file()), None)
    info = {"tokenizer": str(tok) if tok else None,  # a run's model.dropout, for the exports that record it
            "dropout": state.get("config", {}).get("model", {}).get("dropout")}
    if state.get("context_length"):  # a llama run's --init-from model's (checkpoint.py), for the exports
        info["context_length"] = state["context_length"]
    if state.get("lora"):  # the adapters (and what else trained) over a base recorded by path and digest
        model = load_model(ckpt, base=load_base)
        # a base held quantized (train.base_quant) comes out dequantized, what its products multiply
        info["adapter"] = {"lora": replace(model.lora, base_quant="none"),
                           "tensors": {n: model.ops.to_numpy(model.p[n]) for n in model.layout}, "base": state["base"]}
        return config, {n: model.weight(n) if n in model.quant else model.ops.to_numpy(model.p[n])
                        for n in model.base_names}, info
    weights = load_weights(ckpt)
    check_weights(config, weights, ckpt / "model.safetensors")
    return config, weights, info


def model_tokenizer_path(src, info, config):
    """Where the tokenizer of a pretrained model lies, for load_tokenizer: a tokenizer.json beside
    it, GPT-2's vocab.json + merges.txt beside it, or "gpt2" (tiktoken) for a 50257-token llm.c
    model (llm.c trains on GPT-2's tokens)."""
    if info.get("tokenizer"):
        return info["tokenizer"]
    d = Path(src)
    if d.is_dir() and (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        return d
    if info.get("format") == "llmc" and config.vocab_size == 50257:
        return "gpt2"
    raise ConvertError(f"{src}: no tokenizer beside the model (no tokenizer.json, no vocab.json + merges.txt); "
                       f"pass --tokenizer PATH")


# ---------------------------------------------------------------- the model's sampling settings
GENERATION_CONFIG = "generation_config.json"
# a GGUF's general.sampling.* keys (llama.cpp's convert_hf_to_gguf.py writes them from generation_config.json)
# under sample_logits' names; its penalty_repeat is left out: llama.cpp applies it over the last 64 tokens
# only, transformers' repetition_penalty over the whole context
GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                 "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p"}


def model_sampling(path):
    """(settings, source) the model at path recommends for sampling, or None where it recommends
    none: settings {field: value} (models/sampling.py's FIELDS, only those it sets), source what
    they were read from. Read from a Hugging Face directory's generation_config.json (do_sample
    false: temperature 0, greedy); a GGUF's general.sampling.* metadata; a handgrad run's
    RUN_DIR/generation_config.json (`train --init-from` writes the model's there); a PEFT adapter's
    own generation_config.json, else its base's. llm.c and llama2.c files carry none. `sample`,
    `chat` and `serve` sample with these where the user sets none (models/sampling.py's
    resolve_sampling). A value that sample_logits cannot take is a ConvertError naming the file
    and the key."""
    if str(path) in PUBLISHED and not Path(path).exists():  # a published GGUF carries none: its entry says
        p = PUBLISHED[str(path)]
        return _checked(dict(p.sampling), path, p.sampling_source)
    path = resolve_model(path)
    try:
        fmt = detect_format(path)
    except ConvertError:
        return None
    path = Path(path)
    if fmt == "gguf":
        meta = read_gguf_metadata(path)
        # a float32 value as its shortest decimal (0.7, not 0.699999988)
        settings = {f: float(str(np.float32(meta[k]))) if isinstance(meta[k], float) else meta[k]
                    for k, f in GGUF_SAMPLING.items() if k in meta}
        return _checked(settings, path, "the GGUF's general.sampling.* metadata")
    if fmt in ("hf", "peft"):
        found = read_generation_config(path)
        if found is not None or fmt == "hf":
            return found
        _, base = read_peft_config(path)
        return model_sampling(resolve_base(path, base, recorded_base(path)))
    if fmt == "handgrad":
        try:
            ckpt = resolve(path)
        except CheckpointError:  # a run directory without a checkpoint yet
            ckpt = path / "ckpt" / "none"
        for d in (path, ckpt, ckpt.parent.parent):  # the path given, its checkpoint, the run directory
            found = read_generation_config(d)
            if found is not None:
                return found
    return None


def read_generation_config(directory):
    """(settings, source) from directory/generation_config.json as transformers reads it (greedy
    unless do_sample is true), or None where there is no such file."""
    f = Path(directory) / GENERATION_CONFIG
    if not f.is_file():
        return None
    doc = read_json_object(f)
    settings = {k: doc[k] for k in FIELDS if doc.get(k) is not None}
    if doc.get("do_sample") is not True:
        # transformers' generate() searches greedily unless do_sample is true, whatever temperature,
        # top_k or top_p say (a file of token ids alone, as many are, included); its repetition
        # penalty applies to greedy search too
        settings = {"temperature": 0, **{k: v for k, v in settings.items() if k == "repetition_penalty"}}
    return _checked(settings, f, f"the model's {GENERATION_CONFIG}")


def write_generation_config(run_dir, found):
    """RUN_DIR/generation_config.json holding `found` (model_sampling's (settings, source) of the model a
    run starts from), where model_sampling reads a run's; nothing where found is None."""
    if found is None:
        return
    settings = dict(found[0])
    # as transformers writes them: greedy search as do_sample false, sampling as do_sample true
    settings["do_sample"] = settings.get("temperature") != 0
    if not settings["do_sample"]:
        del settings["temperature"]
    write_atomic(Path(run_dir) / GENERATION_CONFIG, json.dumps(settings, indent=2) + "\n")


def _checked(settings, where, source):
    """(settings, source), or None for no settings; a value sample_logits refuses is a ConvertError."""
    if not settings:
        return None
    if isinstance(settings.get("top_k"), float) and settings["top_k"].is_integer():  # 50.0 in JSON
        settings["top_k"] = int(settings["top_k"])
    try:
        check_sampling(**settings)
    except SampleError as e:
        raise ConvertError(f"{where}: {source}: {e}") from None
    return settings, source
