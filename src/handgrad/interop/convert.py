"""`handgrad convert`: a model in any format load.py reads (its docstring lists the formats, what
each holds and what its export is) written out in another, a LoRA adapter alone (--format peft) or
folded into its base (--merge). save_pretrained picks the writer: a foreign format's lies beside its
reader (hf.py, hf_llama.py, hf_gemma3.py, llmc.py, llama2c.py, gguf.py, peft.py), a handgrad run's here
(write_handgrad: a run directory holding one weights-only checkpoint). A llama run started from a
pretrained model is written with that model's context length (what its checkpoint records), not the
block_size it trained on: RoPE has no table of positions that training on short blocks would cut.

A command (docs/ARCHITECTURE.md, "The layers"): nothing in the package imports it but cli.py;
training and sampling load their models through load.py.
"""
import shutil
from dataclasses import replace

from ..data.sources import DataError
from ..data.tokenizer import load_tokenizer
from ..files import lock_output
from ..models import family_of
from .checkpoint import save_weights
from .common import ConvertError, check_weights, describe, prepare_dir, publish_dir
from .hf import write_hf
from .gguf import GGUF_TYPES, write_gguf
from .hf_gemma3 import write_hf_gemma3
from .hf_llama import write_hf_llama
from .llama2c import write_llama2c
from .llmc import write_llmc
from .load import load_pretrained, lora_model
from .peft import write_peft


FORMATS = ("handgrad", "hf", "llmc", "llama2c", "gguf", "peft")


def save_pretrained(dst, config, weights, fmt="handgrad", tokenizer=None, info=None):
    """Write (config, weights) to dst in format fmt; tokenizer is a tokenizer.json path or None.
    Returns (the path written, one line saying what was written, and what was not and why)."""
    info = info or {}
    if fmt not in FORMATS:
        raise ConvertError(f"--format {fmt}: unknown format; choose from {', '.join(FORMATS)}")
    if fmt == "hf":
        write = {"llama": write_hf_llama, "gemma3": write_hf_gemma3}.get(family_of(config).arch, write_hf)
        return write(dst, config, weights, tokenizer, eot_id=info.get("eot_id"), dropout=info.get("dropout"))
    if fmt == "llmc":
        version = info.get("llmc_version", 3)
        path = write_llmc(dst, config, weights, version=version, padded_vocab=info.get("padded_vocab_size"))
        dtype = "float32" if version == 3 else "bfloat16"
        left = (f"; not the tokenizer, which an llm.c model file cannot hold (sample with --tokenizer {tokenizer})"
                if tokenizer else "; no tokenizer came with the model (an llm.c model file cannot hold one)")
        return path, f"wrote an llm.c model file (version {version}, {dtype}){left}"
    if fmt == "llama2c":
        return write_llama2c(dst, config, weights, tokenizer, source=info.get("path"))
    if fmt == "gguf":
        if family_of(config).arch not in ("llama", "gemma3"):
            raise ConvertError(f"--format gguf: handgrad writes GGUF for its llama family (llama, qwen2, qwen3) and "
                               f"gemma3; this is a {family_of(config).arch} model: use --format hf or llmc")
        return write_gguf(dst, config, weights, tokenizer, info.get("gguf_type", "f32"))
    if fmt == "peft":
        adapter = info["adapter"]
        return write_peft(dst, family_of(config).arch, adapter["lora"], adapter["tensors"],
                          adapter["base"].get("path"), tied=getattr(config, "tie_embeddings", True),
                          base_sha256=adapter["base"].get("sha256"), block_size=config.block_size)
    return write_handgrad(dst, config, weights, tokenizer, source=info)


# ---------------------------------------------------------------- handgrad
def write_handgrad(dst, config, weights, tokenizer=None, source=None):
    """A run directory with one weights-only checkpoint (step 0) and, if known, the tokenizer.
    Returns (dst, one line saying what was written)."""
    check_weights(config, weights, "weights")
    tmp = prepare_dir(dst)
    try:
        save_weights(tmp, 0, config, weights, {"converted_from": {k: v for k, v in (source or {}).items()
                                                                   if k in ("format", "path")}})
        what = "wrote a run directory: a weights-only checkpoint (step 0)"
        if tokenizer is not None:
            tok = _hf_tokenizer(tokenizer)
            if tok is not None:  # the file as it came, with its settings: the chat template, the eos token
                tok.save(tmp)
                what += f" and tokenizer.json + tokenizer_config.json (the Hugging Face tokenizer of {tokenizer})"
            else:
                shutil.copyfile(tokenizer, tmp / "tokenizer.json")
                what += f" and tokenizer.json (copied from {tokenizer})"
        else:
            what += "; no tokenizer came with the model (sample with --tokenizer PATH)"
        return publish_dir(tmp, dst), what
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _hf_tokenizer(path):
    """The tokenizer at path where it is a Hugging Face one (kind hf: its tokenizer_config.json and
    the model's eos ids travel with it), else None."""
    try:
        tok = load_tokenizer(path)
    except DataError:
        return None
    return tok if tok.name == "hf" else None


# ---------------------------------------------------------------- the verb
def add_arguments(parser):
    parser.add_argument("src", metavar="SRC", help="a Hugging Face directory (GPT-2, Llama, Qwen2, Qwen3, Gemma 3), a "
                                                   "GGUF file, an llm.c or llama2.c model file, a handgrad run or "
                                                   "checkpoint directory, a PEFT adapter directory (detected), or a "
                                                   "published model's name (smollm2-135m-instruct)")
    parser.add_argument("dst", metavar="DST", help="where to write (must not exist, or be an empty directory)")
    parser.add_argument("--format", default="handgrad", choices=FORMATS,
                        help="DST's format (default handgrad); llama2c writes DST as a directory of model.bin "
                             "and tokenizer.bin: ./run DST/model.bin -z DST/tokenizer.bin; gguf writes one file "
                             "llama.cpp and ollama run (llama-family and gemma3 models)")
    parser.add_argument("--gguf-type", default="f32", choices=GGUF_TYPES,
                        help="GGUF output: the 2-D weights in f32 (default), f16, bf16 or q8_0 (blocks of 32, one "
                             "scale: 8.5 bits a weight; a matrix whose rows are not whole blocks is f16); norms and "
                             "biases stay f32, as llama.cpp's convert_hf_to_gguf.py writes them")
    parser.add_argument("--llmc-dtype", default=None, choices=["float32", "bfloat16"],
                        help="llm.c output: version 3 (float32, the default) or 5 (bfloat16)")
    parser.add_argument("--merge", action="store_true",
                        help="SRC is a LoRA adapter (a handgrad LoRA run or a PEFT directory): fold it into its base "
                             "model's weights, W + (alpha / r) B A, and write that model (--format hf, gguf, llmc, "
                             "llama2c or handgrad); without it such a SRC converts only to --format peft")


def _adapter_or_merged(args, config, weights, info):
    """The weights convert writes: a LoRA SRC's merged (--merge) or its adapter alone (--format peft)."""
    adapter = info.get("adapter")
    if args.format == "peft":
        if adapter is None:
            raise ConvertError(f"{args.src}: a full model, no LoRA adapter to write; --format peft takes a LoRA run "
                               f"(train.lora_rank > 0) or a PEFT directory")
        if args.merge:
            raise ConvertError("--merge writes the base with the adapter folded in, --format peft the adapter alone; "
                               "pass one of them")
        return weights
    if adapter is None:
        if args.merge:
            raise ConvertError(f"--merge: {args.src} has no LoRA adapter to fold in; drop --merge")
        return weights
    if not args.merge:
        raise ConvertError(f"{args.src}: a LoRA adapter (over the base {adapter['base'].get('path', 'of a random init')}); "
                           f"pass --merge to fold it into the base's weights for --format {args.format}, or write the "
                           f"adapter itself with --format peft")
    return lora_model(config, weights, adapter).merged_state_dict()


def main(args):
    config, weights, info = load_pretrained(args.src, merge=False)
    weights = _adapter_or_merged(args, config, weights, info)
    context = info.get("context_length")  # a llama run's: its --init-from model's context length
    if context and context > config.block_size and args.format != "peft":
        config = replace(config, block_size=context)  # RoPE: training on shorter blocks cut nothing from it
    info["path"] = str(args.src)
    if args.llmc_dtype:  # else an llm.c source keeps its version, and anything else gets 3 (float32)
        info["llmc_version"] = 3 if args.llmc_dtype == "float32" else 5
    info["gguf_type"] = args.gguf_type
    try:
        with lock_output(args.dst):  # one process writes DST; a second one stops with this one's pid
            dst, what = save_pretrained(args.dst, config, weights, args.format, info.get("tokenizer"), info)
    except OSError as e:  # a full disk, a lost mount: the temporary output is gone, DST was never made
        where = e.filename or args.dst
        raise ConvertError(f"{where}: write failed ({e.strerror or e}); nothing was written to {args.dst}; "
                           f"free space or choose another DST") from None
    print(f"{args.src} ({info['format']}) -> {dst} ({args.format}): {describe(config)}")
    if info.get("note"):  # what the reader left out of the source (a multimodal Gemma 3's vision tower)
        print(f"  {info['note']}")
    print(f"  {what}")
    return 0

