"""The `handgrad` command: one entry point, one verb per job (build_parser lists the verbs, each with
a line saying what it does: the top-level --help shows that list once, and `handgrad` alone shows
only that list)."""
import argparse
import difflib
import json
import os
import platform
import sys

import numba
import numpy as np

from . import __version__, chat_cli, sample, serve, verify
from .backends.cpu import onednn
from .bench import command as bench
from .config import ConfigError, close_key
from .data import prepare
from .data.sources import DataError
from .eval import command as evaluate
from .files import OutputLockedError
from .interop import convert
from .interop.common import ConvertError
from .machine import environment, sgemm_peak
from .models.sampling import SampleError
from .training import command as train
from .interop.checkpoint import CheckpointError
from .training.distributed import DistributedError, exit_if_lost
from .training.rundir import TrainError


# The exception types that mean 'the user asked for something wrong': one line, exit 2.
USER_ERRORS = (CheckpointError, ConfigError, ConvertError, DataError, DistributedError, OutputLockedError,
               SampleError, TrainError)


class OSFailure(ValueError):
    """An OSError no command caught itself, as one line naming the path and the cause."""


def _user_errors():
    """USER_ERRORS, and the gpu backend's GPUUnavailable where the gpu was asked for (that module
    loads torch, so it is looked up, not imported)."""
    gpu = sys.modules.get("handgrad.backends.gpu.common")
    return USER_ERRORS + (gpu.GPUUnavailable,) if gpu is not None else USER_ERRORS


def _cmd_verify(args):
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    return verify.main(backend=args.backend, as_json=args.json, only=only)


def _cmd_info(args):
    try:
        import torch
    except ImportError:
        torch = None
    env = environment(torch)
    info = {"handgrad": __version__, "python": platform.python_version(), "numpy": np.__version__,
            "numba": numba.__version__, "cores": os.cpu_count(), **env}
    cuda = triton = "no"
    if torch is not None:
        info["torch"] = torch.__version__
        cuda = f"yes ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "no (no CUDA device)"
    try:
        import triton as _triton
        triton = f"yes ({_triton.__version__})"
    except ImportError:
        triton = "no (not installed)"
    info.update(cuda=cuda, triton=triton)
    info["cpu_bf16"] = _bf16_line()
    info["sgemm_peak_gflops"] = round(sgemm_peak()["median_gflops"], 1)
    if args.json:
        print(json.dumps(info, indent=1, default=str))
    else:
        print("\n".join(info_lines(info)))
    return 0


def info_lines(info):
    """`handgrad info`'s table: each key padded to the longest, so every value starts in one column."""
    width = max(map(len, info))
    return [f"{k:<{width}}  {v}" for k, v in info.items()]


def _bf16_line():
    """What the CPU multiplies bf16 with, and whether oneDNN (the cpu backend's bf16 products) is here."""
    path = onednn.bf16_path()
    what = {"amx": "AMX-BF16 tiles", "avx512_bf16": "AVX512_BF16 dot products"}.get(
        path, "none (no AVX512_BF16 or AMX: bf16 products widened to float32)")
    try:
        lib = f"oneDNN {onednn.version()}" if onednn.library_path() else "oneDNN not installed"
    except onednn.OneDNNError as e:
        lib = str(e)
    return f"{what}; {lib}"


class _Parser(argparse.ArgumentParser):
    """Usage mistakes print one line, `error: ...`, and exit 2, like every other user error. Flags
    are never abbreviated: `--train.max_step` is an unknown flag, not `--train.max_steps`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **dict(kwargs, allow_abbrev=False))

    def error(self, message):
        self.exit(2, f"error: {message}; see `{self.prog} --help`\n")

    def unrecognized(self, extra):
        """The error for the arguments this parser did not know, with a guess where one of them looks
        like one of its flags: `unrecognized arguments: --train.max_step 5 (did you mean
        --train.max_steps?)`."""
        known = sorted(set(self._option_string_actions) - {"-h", "--help", "--version"})
        guesses = []
        for arg in extra:
            flag = arg.split("=", 1)[0]
            if not flag.startswith("--"):
                continue  # a value, or a short flag
            if "." in flag:  # --section.key: the key against its section's keys (config.close_key)
                close = close_key(flag[2:])
                guess = f"--{close}" if close is not None and f"--{close}" in known else None
            else:
                guess = next(iter(difflib.get_close_matches(flag, known, n=1)), None)
            if guess is not None:
                guesses.append((flag, guess))
        hint = ""
        if len(guesses) == 1:
            hint = f" (did you mean {guesses[0][1]}?)"
        elif guesses:
            hint = f" (did you mean {', '.join(f'{g} for {f}' for f, g in guesses)}?)"
        return f"unrecognized arguments: {' '.join(extra)}{hint}"


def overview(parser):
    """What `handgrad` alone prints: the verbs, one line each, and where the rest is."""
    verbs = [(a.dest, a.help) for a in parser.verb_lines]
    width = max(len(name) for name, _ in verbs)
    return "\n".join([f"usage: {parser.prog} VERB [flags]", f"       {parser.prog} --version", "", "verbs:",
                      *[f"  {name:<{width}}  {text}" for name, text in verbs], "",
                      f"`{parser.prog} VERB --help` shows a verb's flags; `{parser.prog} --help` says more."])


def _preset_asked(argv):
    """The NAME of `--preset NAME` (or --preset=NAME) in argv, for `train --preset NAME --help`."""
    for i, arg in enumerate(argv):
        if arg == "--preset" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--preset="):
            return arg.split("=", 1)[1]
    return None


DESCRIPTION = ("Train GPT-2 and Llama-family language models (Llama, SmolLM2, Qwen2, Qwen3) with every forward and "
               "backward pass written by hand, on the CPU (NumPy + Numba) or an NVIDIA GPU (Triton); fine-tune published "
               "models, in full or with LoRA, and sample, evaluate, verify and convert them.")


def build_parser(argv=()):
    parser = _Parser(prog="handgrad", description=DESCRIPTION, epilog="`handgrad VERB --help` shows a verb's flags.")
    parser.add_argument("--version", action="version", version=f"handgrad {__version__}")
    sub = parser.add_subparsers(title="verbs", dest="verb", required=True, metavar="VERB", parser_class=_Parser)
    parser.verbs = sub.choices  # verb -> its parser, for errors that name the verb's --help
    parser.verb_lines = sub._choices_actions  # each verb's name (dest) and line (help), for overview()

    p = sub.add_parser("prepare", help="turn a corpus (or chats) into a tokenizer and token shards")
    prepare.add_arguments(p)
    p.set_defaults(func=prepare.main)

    p = sub.add_parser("train", help="train or fine-tune a GPT-2 or Llama-family model on prepared data")
    train.add_arguments(p, preset=_preset_asked(argv))
    p.set_defaults(func=train.main)

    p = sub.add_parser("sample", help="generate text (or a chat reply) from a run or a pretrained model")
    sample.add_arguments(p)
    p.set_defaults(func=sample.main)

    p = sub.add_parser("chat", help="talk with a chat model in the terminal, turn after turn, replies streamed")
    chat_cli.add_arguments(p)
    p.set_defaults(func=chat_cli.main)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP API and a chat page for a model, requests "
                                     "decoded together in batched steps")
    serve.add_arguments(p)
    p.set_defaults(func=serve.main)

    p = sub.add_parser("verify", help="check every op and the whole model against PyTorch autograd")
    p.add_argument("--backend", default="cpu", choices=["cpu", "gpu"],
                   help="backend to verify (default cpu); gpu on a CPU runs under TRITON_INTERPRET=1")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--only", default=None, metavar="CHECK[,CHECK...]",
                   help="run only these checks: encoder, layernorm, linear, layernorm_linear, attention, gelu, "
                        "residual, crossentropy, adamw, model, lora_linear, dropout, rmsnorm, rmsnorm_linear, swiglu, "
                        "rope, gqa_attention, llama_model (default all)")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("bench", help="time handgrad beside PyTorch on this machine")
    bench.add_arguments(p)
    p.set_defaults(func=bench.main)

    p = sub.add_parser("convert", help="convert a model between handgrad, Hugging Face (GPT-2, Llama, Qwen2, Qwen3), "
                                       "GGUF, llm.c and llama2.c formats; a LoRA adapter to PEFT's, or merged")
    convert.add_arguments(p)
    p.set_defaults(func=convert.main)

    p = sub.add_parser("eval", help="zero-shot accuracy on benchmark tasks, scored as lm-evaluation-harness")
    evaluate.add_arguments(p)
    p.set_defaults(func=evaluate.main)

    p = sub.add_parser("info", help="versions, cores, BLAS, threads, the measured sgemm peak, CUDA/Triton")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=_cmd_info)
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    if not argv:  # the verbs on stdout, as git prints its commands; nothing was done, so a usage status
        print(overview(parser))
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra:  # the verb's parser says it, so the hint is `handgrad VERB --help`
        verb = parser.verbs[args.verb]
        verb.error(verb.unrecognized(extra))
    try:
        try:
            return args.func(args) or 0
        except OSError as e:  # what the command's own checks could not foresee: a full disk, a lost mount
            where = f"{e.filename}: " if e.filename else ""
            raise OSFailure(f"{where}{e.strerror or e}") from None
    except _user_errors() + (OSFailure,) as e:
        rank = os.environ.get("RANK")
        ranked = rank and os.environ.get("WORLD_SIZE", "1") != "1" and not str(e).startswith("rank ")
        where = f"[rank {rank}] " if ranked else ""
        print(f"error: {where}{e}", file=sys.stderr)
        exit_if_lost(2)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
