"""`handgrad bench ops|train|learn|products|eval|decode`: one subcommand per benchmark, each with only
the flags it takes, dispatched to bench/ops.py (gpu.py with --device gpu), bench/train.py
(train_gpu.py with --device gpu), bench/learn.py, bench/products.py, bench/eval.py and
bench/decode.py."""
import json

from .common import MAX_REPEAT, MIN_REPEAT, ROW_BUDGET_S
from .decode import NEW_TOKENS, PROMPT_TOKENS, REPEAT as DECODE_REPEAT, bench_decode
from .eval import bench_eval
from .gpu import bench_ops_gpu
from .learn import run_learn, run_learn_lora
from .ops import bench_ops
from .products import bench_products
from .train import SHAPES, main as bench_train_main
from .train_gpu import main as bench_train_gpu_main


WHAT = {
    "ops": "matmul, attention block and MLP block, handgrad beside PyTorch; with --device gpu each Triton op "
           "beside torch eager, torch.compile and scaled_dot_product_attention",
    "train": "whole training steps (tok/s, GFLOP/s, MFU, peak memory) beside PyTorch",
    "learn": "train handgrad and PyTorch side by side and compare loss curves",
    "products": "a model's matrix products on MKL float32, oneDNN float32 and oneDNN bf16",
    "eval": "handgrad eval's scorer beside a straightforward transformers scorer (rows/s, and the rows whose "
            "predictions differ)",
    "decode": "greedy decoding at batch 1 as a fraction of the memory-bandwidth bound (STREAM triad / weight "
              "bytes per token), beside transformers' generate; at batch 8, in bf16, and on serve's engine at 1 "
              "and 8 streams",
}
EVAL_LIMIT = 100  # bench eval: rows of each task by default (the transformers side is the slow one)
DTYPES = ["float32", "bfloat16"]


def add_arguments(parser):
    """Add `handgrad bench`'s subcommands to its parser, each with its own flags."""
    _say_what_is_missing(parser)
    sub = parser.add_subparsers(title="benchmarks", dest="what", required=True, metavar="WHAT",
                                parser_class=_benchmark_parser(type(parser)))
    for what, line in WHAT.items():
        p = sub.add_parser(what, help=line, description=f"{parser.prog} {what}: {line}.")
        FLAGS[what](p)
        p.add_argument("--json", action="store_true", help="print the results as one JSON object")


def _ops_flags(p):
    p.add_argument("--device", "--backend", default="cpu", choices=["cpu", "gpu"],
                   help="where the ops run (default cpu; --backend is the same flag, as `handgrad verify` "
                        "spells it); gpu: each Triton op beside torch eager, torch.compile and "
                        "scaled_dot_product_attention")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                   help="--device gpu: the activations' dtype (default bfloat16)")
    p.add_argument("--no-compile", action="store_true",
                   help="--device gpu: leave out the torch.compile column (its compiles take minutes)")
    p.add_argument("--repeat", type=_positive_int, default=None, metavar="N",
                   help=f"timed repeats per row and side (default: as many as fit in about {ROW_BUDGET_S:g} s, "
                        f"{MIN_REPEAT} to {MAX_REPEAT}; with --device gpu 50)")


def _train_flags(p):
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"],
                   help="where the steps run (default cpu); gpu: handgrad's Triton step in bf16 (as "
                        "`handgrad train --device gpu --train.dtype bfloat16`) beside PyTorch eager under "
                        "torch.autocast bf16 and torch.compile, in one process, default presets "
                        "gpt2-124m (llm.c's configuration: B 64, or the largest that fits, T 1024) and "
                        "smollm2-135m (B 8, T 1024) (tiny shapes under TRITON_INTERPRET=1); reports ms/step, tok/s, "
                        "TFLOP/s, MFU against the measured bf16 matmul peak and by llm.c's count against the card's "
                        "dense bf16 peak, and peak GPU memory")
    p.add_argument("--preset", default=None,
                   help=f"shape(s) to time, comma-separated, from {', '.join(SHAPES)} (default tiny,mid,gpt2-124m; "
                        f"with --device gpu gpt2-124m,smollm2-135m)")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="timed steps per side (default: as many as fit in about 12 s; with --device gpu 10, after "
                        "3 warm-up steps)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="bfloat16 times handgrad's cpu mixed precision beside PyTorch's "
                        "torch.autocast('cpu', bfloat16) and handgrad float32 (default float32); with --device "
                        "gpu: bfloat16 only")
    p.add_argument("--compile", action="store_true",
                   help="one more side, the PyTorch step under torch.compile (Inductor), its compile time "
                        "reported apart and its losses checked against eager's")
    p.add_argument("--no-compile", action="store_true",
                   help="--device gpu: leave out the torch.compile side (its compiles take minutes)")
    p.add_argument("--max-autotune", action="store_true",
                   help="--device gpu: one more side, the PyTorch step under "
                        "torch.compile(mode='max-autotune-no-cudagraphs'), whose compile benchmarks each product's "
                        "kernels (minutes more)")
    p.add_argument("--lora", type=_positive_int, default=None, metavar="R",
                   help="LoRA rows at rank R on every linear (Llama and Gemma 3 presets): handgrad's LoRA step beside "
                        "PyTorch + PEFT's and handgrad's own full step")
    p.add_argument("--recompute", default=None, choices=["none", "block", "full"],
                   help="handgrad's train.recompute (block, full: each block's forward run again in the backward) "
                        "and, on the PyTorch side (Llama and Gemma 3 shapes), transformers' gradient checkpointing")
    p.add_argument("--base-quant", default=None, choices=["q8_0", "q4_0"],
                   help="with --lora: one more side, handgrad's LoRA over the base held quantized "
                        "(train.base_quant), against handgrad's LoRA over the base as held without")
    p.add_argument("--loss-chunk", type=_positive_int, default=None, metavar="N",
                   help="handgrad's train.loss_chunk, the logits formed N rows at a time (PyTorch has no such "
                        "loss)")
    p.add_argument("--sequential", action="store_true",
                   help="run the sides one after another, each stopped before the next starts (shapes whose "
                        "sides do not fit in memory together), not in alternating chunks")
    p.add_argument("--profile", action="store_true",
                   help="add handgrad's per-op time breakdown (forward, backward, optimizer); with --device gpu "
                        "each side's step by llm.c's groups of kernels (encoder, layernorm, matmul, attention, "
                        "GELU, residual, classifier, AdamW)")


def _learn_flags(p):
    p.add_argument("--preset", default=None,
                   help="the run preset (default shakespeare-char; with --lora llama-char)")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="override the preset's train.max_steps (with --lora: the fine-tuning steps, default 500)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="bfloat16 trains handgrad's cpu mixed precision, PyTorch under "
                        "torch.autocast('cpu', bfloat16) and handgrad float32 side by side and says how far each "
                        "bf16 curve ends from handgrad float32's (default float32)")
    p.add_argument("--lora", type=_positive_int, default=None, metavar="R",
                   help="the LoRA learning check (Llama presets, default llama-char): pretrain on shakespeare, "
                        "then fine-tune rank-R adapters on the Python standard library beside PyTorch + PEFT")
    p.add_argument("--data", default=None, metavar="DATA_DIR",
                   help="prepared data (default: prepare shakespeare, char, into ~/.cache/handgrad)")
    p.add_argument("--finetune-data", default=None, metavar="DATA_DIR",
                   help="--lora: prepared data to fine-tune on, with the same tokenizer as --data "
                        "(default: prepare pystdlib, byte; --data's default is then shakespeare, byte)")
    p.add_argument("--pretrain-steps", type=_positive_int, default=None, metavar="N",
                   help="--lora: pretraining steps before the adapters (default the preset's train.max_steps)")
    p.add_argument("--out", default="docs", metavar="DIR", help="where it writes its JSON and plot")


def _products_flags(p):
    p.add_argument("--preset", default=None,
                   help="shapes, comma-separated, from bench train's (default mid,gpt2-124m,smollm2-135m)")


def _eval_flags(p):
    p.add_argument("--run", default=None, metavar="MODEL",
                   help="the model, a Hugging Face directory, a GGUF file or a published model's name "
                        "(transformers reads it too)")
    p.add_argument("--tasks", default=None, metavar="TASK[,TASK...]",
                   help="standard task names, JSONL task files or directories, as `handgrad eval --tasks`")
    p.add_argument("--limit", type=_positive_int, default=EVAL_LIMIT, metavar="N",
                   help=f"the first N rows of each task (default {EVAL_LIMIT})")
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="threads for both sides (default this machine's cores)")


def _decode_flags(p):
    p.add_argument("--preset", default=None,
                   help="one shape of bench train's, random weights (default smollm2-135m)")
    p.add_argument("--run", default=None, metavar="MODEL",
                   help="a model to time instead of --preset's random weights (anything `handgrad sample --run` "
                        "loads)")
    p.add_argument("--new-tokens", type=_positive_int, default=NEW_TOKENS, metavar="N",
                   help=f"tokens generated per run, the first after the prefill, then N - 1 timed decode steps "
                        f"(default {NEW_TOKENS})")
    p.add_argument("--prompt-tokens", type=_positive_int, default=PROMPT_TOKENS, metavar="N",
                   help=f"the prompt's length, random token ids (default {PROMPT_TOKENS})")
    p.add_argument("--repeat", type=_positive_int, default=DECODE_REPEAT, metavar="N",
                   help=f"timed runs per row (default {DECODE_REPEAT}), the best reported, the median beside it")
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="threads for both sides (default this machine's cores)")
    p.add_argument("--profile", action="store_true",
                   help="one decode step's time by op, the BLAS calls' GB/s and the time per op call outside BLAS")
    p.add_argument("--quant", default=None, choices=["keep", "q8_0", "q4_0"],
                   help="one more row: the model with its matrices held quantized (sample's --quant), decoded "
                        "from their blocks, against float32 and against its own bytes' bound")


FLAGS = {"ops": _ops_flags, "train": _train_flags, "learn": _learn_flags, "products": _products_flags,
         "eval": _eval_flags, "decode": _decode_flags}


def _say_what_is_missing(parser):
    """`handgrad bench` alone, or with a flag first: argparse would say `the following arguments are
    required: WHAT`, or take the flag's value for a benchmark's name; say what to give instead, in
    one line through parser.error (cli's _Parser: `error: ...; see `handgrad bench --help``, exit 2)."""
    parse = parser.parse_known_args

    def what_first(args=None, namespace=None):
        if args is not None and (not args or args[0].startswith("-") and args[0] not in ("-h", "--help")):
            parser.error(f"{parser.prog} needs what to benchmark: {', '.join(list(WHAT)[:-1])} or {list(WHAT)[-1]}")
        return parse(args, namespace)

    parser.parse_known_args = what_first


def _benchmark_parser(base):
    """The parser class of a benchmark's subcommand: base (cli's), refusing the flags it does not
    take itself, so that its error names `handgrad bench WHAT --help`, which lists them."""

    class Benchmark(base):
        def parse_known_args(self, args=None, namespace=None):
            namespace, extra = super().parse_known_args(args, namespace)
            if extra:
                self.error(self.unrecognized(extra))
            return namespace, extra

    return Benchmark


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


_positive_int.__name__ = "positive int"  # argparse names the type in its error message


def main(args):
    """Run `handgrad bench WHAT`; returns the exit status."""
    return RUN[args.what](args)


def _ops(args):
    if args.device == "gpu":
        return bench_ops_gpu(args.repeat, args.json, args.dtype, not args.no_compile)
    return bench_ops(args.device, args.repeat, args.json)


def _train(args):
    return (bench_train_gpu_main if args.device == "gpu" else bench_train_main)(args)


def _learn(args):
    if args.lora and args.dtype == "bfloat16":  # before any peak is measured
        raise SystemExit("bench learn: --lora runs in float32 (the learning check has no bf16 side); leave out "
                         "--dtype")
    if args.lora:
        result = run_learn_lora(args.lora, args.preset or "llama-char", args.steps, args.pretrain_steps,
                                args.data, args.finetune_data, args.out)
    else:
        result = run_learn(args.preset or "shakespeare-char", args.steps, args.data, args.out,
                           dtype=args.dtype or "float32")
    if args.json:
        print(json.dumps(result))
    return 0


def _products(args):
    return bench_products((args.preset or "mid,gpt2-124m,smollm2-135m").split(","), args.json)


def _eval(args):
    if not args.run or not args.tasks:
        raise SystemExit("bench eval: needs --run MODEL and --tasks TASK[,TASK...]")
    return bench_eval(args.run, args.tasks, args.limit, args.json, args.threads)


def _decode(args):
    if args.preset and "," in args.preset:
        raise SystemExit(f"bench decode: --preset {args.preset}: one shape at a time")
    if args.preset and args.run:
        raise SystemExit("bench decode: --preset and --run name two models; give one")
    return bench_decode(args.preset or "smollm2-135m", args.run, args.new_tokens, args.prompt_tokens,
                        args.repeat, args.threads, args.json, args.profile, args.quant)


RUN = {"ops": _ops, "train": _train, "learn": _learn, "products": _products, "eval": _eval, "decode": _decode}
