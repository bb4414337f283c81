"""`handgrad bench ops|train|learn|products|eval|decode`: the command line, dispatched to bench/ops.py
(or gpu.py), bench/train.py (or train_gpu.py), bench/learn.py, bench/products.py, bench/eval.py and
bench/decode.py."""
import json

from .common import MAX_REPEAT, MIN_REPEAT, ROW_BUDGET_S
from .decode import NEW_TOKENS, PROMPT_TOKENS, REPEAT as DECODE_REPEAT, bench_decode
from .eval import bench_eval
from .gpu import bench_ops_gpu
from .learn import run_learn, run_learn_lora
from .ops import bench_ops
from .products import bench_products
from .train import main as bench_train_main
from .train_gpu import main as bench_train_gpu_main


WHAT = ("ops", "train", "learn", "products", "eval", "decode")
EVAL_LIMIT = 100  # bench eval: rows of each task by default (the transformers side is the slow one)


def add_arguments(parser):
    """Add `handgrad bench` arguments: what to benchmark, then its options."""
    _say_what_is_missing(parser)
    parser.add_argument("what", choices=WHAT,
                        help="ops: matmul, attention block and MLP block, handgrad beside PyTorch; "
                             "train: whole training steps (tok/s, GFLOP/s, MFU, peak memory) beside PyTorch; "
                             "learn: train handgrad and PyTorch side by side and compare loss curves; "
                             "products: a model's matrix products on MKL float32, oneDNN float32 and oneDNN bf16; "
                             "eval: handgrad eval's scorer beside a straightforward transformers scorer (rows/s, "
                             "and the rows whose predictions differ); "
                             "decode: greedy decoding at batch 1 as a fraction of the memory-bandwidth bound "
                             "(STREAM triad / weight bytes per token), beside transformers' generate; at batch 8, "
                             "in bf16, and on serve's engine at 1 and 8 streams")
    parser.add_argument("--backend", default="cpu", choices=["cpu", "gpu"],
                        help="ops: backend to time (default cpu); gpu: each Triton op beside torch eager, "
                             "torch.compile and scaled_dot_product_attention")
    parser.add_argument("--device", default="cpu", choices=["cpu", "gpu"],
                        help="train: where the steps run (default cpu); gpu: handgrad's Triton step in bf16 (as "
                             "`handgrad train --device gpu --train.dtype bfloat16`) beside PyTorch eager under "
                             "torch.autocast bf16 and torch.compile, in one process, default presets "
                             "gpt2-124m,smollm2-135m at B 8, T 1024 (tiny shapes under TRITON_INTERPRET=1); "
                             "reports ms/step, tok/s, TFLOP/s, MFU against the measured bf16 matmul peak and peak "
                             "GPU memory")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="ops --backend gpu: the activations' dtype (default bfloat16); train: bfloat16 times "
                             "handgrad's cpu mixed precision beside PyTorch's torch.autocast('cpu', bfloat16) and "
                             "handgrad float32 (default float32); learn: bfloat16 trains those three side by side "
                             "and says how far each bf16 curve ends from handgrad float32's; train --device gpu: "
                             "bfloat16 only")
    parser.add_argument("--no-compile", action="store_true",
                        help="ops --backend gpu, train --device gpu: leave out the torch.compile column (its compiles "
                             "take minutes)")
    parser.add_argument("--repeat", type=_positive_int, default=None, metavar="N",
                        help=f"timed repeats per row and side (default: as many as fit in about "
                             f"{ROW_BUDGET_S:g} s, {MIN_REPEAT} to {MAX_REPEAT}; decode: {DECODE_REPEAT}, the best "
                             f"reported, the median beside it)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--preset", default=None,
                        help="train: shape(s) to time, comma-separated, from tiny, shakespeare-char, mid, gpt2-124m, "
                             "llama-char, llama-mid, smollm2-135m, qwen2.5-0.5b, llama3.2-1b (default tiny,mid,gpt2-124m; with --device gpu "
                             "gpt2-124m,smollm2-135m); learn: the run preset (default shakespeare-char); products: as "
                             "train (default mid,gpt2-124m,smollm2-135m); decode: one shape, random weights (default "
                             "smollm2-135m)")
    parser.add_argument("--steps", type=_positive_int, default=None,
                        help="train: timed steps per side (default: as many as fit in about 12 s; with --device "
                             "gpu 10, after 3 warm-up steps); "
                             "learn: override the preset's train.max_steps (with --lora: the fine-tuning steps, "
                             "default 500)")
    parser.add_argument("--compile", action="store_true",
                        help="train: one more side, the PyTorch step under torch.compile (Inductor), its compile time "
                             "reported apart and its losses checked against eager's")
    parser.add_argument("--lora", type=_positive_int, default=None, metavar="R",
                        help="train: LoRA rows at rank R on every linear (Llama presets): handgrad's LoRA step beside "
                             "PyTorch + PEFT's and handgrad's own full step; learn: the LoRA learning check (Llama "
                             "presets, default llama-char): pretrain on shakespeare, then fine-tune rank-R adapters on "
                             "the Python standard library beside PyTorch + PEFT")
    parser.add_argument("--recompute", default=None, choices=["none", "block"],
                        help="train: handgrad's train.recompute (block: each block's forward run again in the "
                             "backward) and, on the PyTorch side (Llama shapes), transformers' gradient checkpointing")
    parser.add_argument("--loss-chunk", type=_positive_int, default=None, metavar="N",
                        help="train: handgrad's train.loss_chunk, the logits formed N rows at a time (PyTorch has no "
                             "such loss)")
    parser.add_argument("--sequential", action="store_true",
                        help="train: run the sides one after another, each stopped before the next starts (shapes "
                             "whose sides do not fit in memory together), not in alternating chunks")
    parser.add_argument("--profile", action="store_true",
                        help="train: add handgrad's per-op time breakdown (forward, backward, optimizer); decode: "
                             "one decode step's time by op, the BLAS calls' GB/s and the time per op call outside "
                             "BLAS")
    learn = parser.add_argument_group("learn")
    learn.add_argument("--data", default=None, metavar="DATA_DIR",
                       help="prepared data for `learn` (default: prepare shakespeare, char, into ~/.cache/handgrad)")
    learn.add_argument("--finetune-data", default=None, metavar="DATA_DIR",
                       help="learn --lora: prepared data to fine-tune on, with the same tokenizer as --data "
                            "(default: prepare pystdlib, byte; --data's default is then shakespeare, byte)")
    learn.add_argument("--pretrain-steps", type=_positive_int, default=None, metavar="N",
                       help="learn --lora: pretraining steps before the adapters (default the preset's train.max_steps)")
    learn.add_argument("--out", default="docs", metavar="DIR", help="where `learn` writes its JSON and plot")
    ev = parser.add_argument_group("eval")
    ev.add_argument("--run", default=None, metavar="MODEL",
                    help="eval: the model, a Hugging Face directory, a GGUF file or a published model's name "
                         "(transformers reads it too); decode: a model to time instead of --preset's random "
                         "weights (anything `handgrad sample --run` loads)")
    ev.add_argument("--tasks", default=None, metavar="TASK[,TASK...]",
                    help="eval: JSONL task files or directories, as `handgrad eval --tasks`")
    ev.add_argument("--limit", type=_positive_int, default=EVAL_LIMIT, metavar="N",
                    help=f"eval: the first N rows of each task (default {EVAL_LIMIT})")
    ev.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                    help="eval, decode: threads for both sides (default this machine's cores)")
    dec = parser.add_argument_group("decode")
    dec.add_argument("--new-tokens", type=_positive_int, default=NEW_TOKENS, metavar="N",
                     help=f"decode: tokens generated per run, the first after the prefill, then N - 1 timed decode "
                          f"steps (default {NEW_TOKENS})")
    dec.add_argument("--prompt-tokens", type=_positive_int, default=PROMPT_TOKENS, metavar="N",
                     help=f"decode: the prompt's length, random token ids (default {PROMPT_TOKENS})")


def _say_what_is_missing(parser):
    """`handgrad bench` alone: argparse's own words would be `the following arguments are
    required: what`, which names a variable; say what to give instead. parser.error (cli's
    _Parser: one line, `error: ...; see `handgrad bench --help``, exit 2) does the rest."""
    error = parser.error

    def named(message):
        missing = message.partition("the following arguments are required: ")[2]
        if missing and "what" in missing.split(", "):
            message = f"{parser.prog} needs what to benchmark: {', '.join(WHAT[:-1])} or {WHAT[-1]}"
        return error(message)

    parser.error = named


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


_positive_int.__name__ = "positive int"  # argparse names the type in its error message


def main(args):
    """Run `handgrad bench <what>`; returns the exit status."""
    if args.device == "gpu":
        if args.what != "train":
            raise SystemExit(f"bench {args.what}: --device gpu is for `bench train`"
                             + ("; `bench ops` takes --backend gpu" if args.what == "ops" else ""))
        return bench_train_gpu_main(args)
    if args.what == "ops":
        if args.backend == "gpu":
            return bench_ops_gpu(args.repeat, args.json, args.dtype or "bfloat16", not args.no_compile)
        return bench_ops(args.backend, args.repeat, args.json)
    if args.what == "learn" and args.lora and args.dtype == "bfloat16":  # before any peak is measured
        raise SystemExit("bench learn: --lora runs in float32 (the learning check has no bf16 side); leave out "
                         "--dtype")
    if args.what == "train":
        return bench_train_main(args)
    if args.what == "eval":
        if not args.run or not args.tasks:
            raise SystemExit("bench eval: needs --run MODEL and --tasks TASK[,TASK...]")
        return bench_eval(args.run, args.tasks, args.limit, args.json, args.threads)
    if args.what == "decode":
        if args.preset and "," in args.preset:
            raise SystemExit(f"bench decode: --preset {args.preset}: one shape at a time")
        if args.preset and args.run:
            raise SystemExit("bench decode: --preset and --run name two models; give one")
        return bench_decode(args.preset or "smollm2-135m", args.run, args.new_tokens, args.prompt_tokens,
                            args.repeat or DECODE_REPEAT, args.threads, args.json, args.profile)
    if args.what == "products":
        return bench_products((args.preset or "mid,gpt2-124m,smollm2-135m").split(","), args.json)
    if args.what == "learn":
        if args.lora:
            result = run_learn_lora(args.lora, args.preset or "llama-char", args.steps, args.pretrain_steps,
                                    args.data, args.finetune_data, args.out)
        else:
            result = run_learn(args.preset or "shakespeare-char", args.steps, args.data, args.out,
                               dtype=args.dtype or "float32")
        if args.json:
            print(json.dumps(result))
        return 0
    raise SystemExit(f"bench: unknown benchmark {args.what!r}")

