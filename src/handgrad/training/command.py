"""`handgrad train`: the command line, the config it resolves, --init-from, threads and the
sgemm peak for MFU, then a Trainer run."""
import shlex
import sys
from dataclasses import fields
from pathlib import Path

from ..backends.cpu import onednn, set_threads
from ..backends.cpu.compiles import announce_compiles
from ..config import RUN_PRESETS, SECTIONS, ConfigError, load_run_config
from ..config_keys import help_line
from ..interop.load import load_pretrained
from ..machine import cores_available, sgemm_peak
from ..models import family_of
from .distributed import DataParallel
from .rundir import TrainError, read_json, resolve_config
from .trainer import Trainer


def add_arguments(parser, preset=None):
    """`handgrad train`'s flags. With preset (`--preset NAME --help`), the defaults shown are that
    preset's values."""
    parser.add_argument("--data", required=True, metavar="DATA_DIR", help="a directory made by `handgrad prepare`")
    parser.add_argument("--out", required=True, metavar="RUN_DIR", help="where config, metrics, checkpoints go")
    parser.add_argument("--preset", help=f"named preset: {', '.join(RUN_PRESETS)} (with --help: show its values)")
    parser.add_argument("--config", metavar="FILE", help="a TOML, JSON or YAML file of model.* and train.* keys")
    parser.add_argument("--resume", action="store_true", help="continue from RUN_DIR's newest checkpoint")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                        help="cpu: NumPy + Numba (default); gpu: Triton kernels and cuBLAS on an NVIDIA GPU")
    parser.add_argument("--init-from", metavar="PATH", default=None,
                        help="start a new run from pretrained weights (fine-tuning): a Hugging Face GPT-2, "
                             "Llama, Qwen2 or Qwen3 directory, an llm.c or llama2.c model file, or a handgrad run; the "
                             "architecture and vocab_size are the model's, model.block_size may crop its positions "
                             "(default: chat data's block size, else min(the model's, 1024))")
    shown = load_run_config(preset if preset in RUN_PRESETS else None)
    for section, cls in SECTIONS.items():
        where = f"preset {preset}'s values" if preset in RUN_PRESETS else "the defaults"
        group = parser.add_argument_group(f"{section}.* overrides (win over the preset and the file; shown: {where})")
        for f in fields(cls):
            key = f"{section}.{f.name}"
            text = help_line(section, f.name, getattr(getattr(shown, section), f.name))
            group.add_argument(f"--{key}", dest=f"override:{key}", metavar="V", help=text.replace("%", "%%"))


DEFAULT_FINETUNE_BLOCK = 1024  # transformers' run_clm.py: min(the model's length, 1024) unless asked


def pretrained_config(path, config, overrides, data_dir=None):
    """The run config with the pretrained model's architecture; its weights (an adapter's base's) and
    load_pretrained's info (an adapter's tensors). model.arch and the
    architecture keys come from the model (an override that disagrees is an error); model.block_size
    may be smaller than the model's, never larger. Unless a preset, file or flag sets it, it is the
    block size chat or preference data was prepared for, else min(the model's, 1024), as transformers' run_clm.py
    chooses (a published model's 32,768 positions would not fit a CPU's batch). A llama-family model's
    context length (its own block_size, or the one a handgrad run recorded) goes on in
    info["context_length"]: the run records it and its exports give it (convert)."""
    pre, weights, info = load_pretrained(path, merge=False)  # an adapter's base; info["adapter"] the adapter
    if "block_size" not in config.given:
        meta = Path(data_dir or "") / "meta.json"
        meta = read_json(meta) if data_dir is not None and meta.is_file() else None  # (a bad one: Trainer says so)
        chat = (meta.get("chat") or meta.get("preference")) if isinstance(meta, dict) else None
        asked = chat.get("block_size") if isinstance(chat, dict) else None
        config.model.block_size = min(pre.block_size, asked if isinstance(asked, int) and asked > 0
                                      else DEFAULT_FINETUNE_BLOCK)
    arch = family_of(pre).arch
    keys = [f.name for f in fields(pre) if f.name != "block_size"]  # vocab_size: the model's, padded or not
    for key, value in [("arch", arch)] + [(k, getattr(pre, k)) for k in keys]:
        asked = (overrides or {}).get(f"model.{key}")
        if asked is not None and str(asked).lower() != str(value).lower() and not _same_number(asked, value):
            raise ConfigError(f"model.{key}: {asked} differs from the --init-from model's {value}; "
                              f"drop --model.{key}")
        setattr(config.model, key, value)
    if config.model.block_size > pre.block_size:
        if (overrides or {}).get("model.block_size") is not None:
            raise ConfigError(f"model.block_size: {config.model.block_size} is above the --init-from model's "
                              f"{pre.block_size}; use at most {pre.block_size}")
        config.model.block_size = pre.block_size
    if arch in ("llama", "gemma3"):  # RoPE, no table of positions: the run keeps the model's context, whatever it trains on
        info["context_length"] = info.get("context_length") or pre.block_size
    return config, weights, info


def _same_number(a, b):
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


def peak_line(dtype, peak, world_size=1, threads=0):
    """The log line of the matmul peak MFU is measured against: float32's sgemm, or bf16's on oneDNN."""
    how = ("oneDNN" if onednn.products_path() else "widened to float32: oneDNN is not installed"
           if onednn.bf16_path() else "widened to float32: this CPU has no bf16 multiply")
    what = f"bf16 matmul peak ({how}, measured now)" if dtype == "bfloat16" else "sgemm peak (measured now)"
    where = f" over {world_size} ranks (gloo), {threads} threads each" if world_size > 1 else ""
    return f"{what}{where}: {peak:.0f} GFLOP/s"


def main(args):
    overrides = {k.split(":", 1)[1]: v for k, v in vars(args).items()
                 if k.startswith("override:") and v is not None}
    run_dir = Path(args.out)
    if args.init_from is not None and args.resume:
        raise TrainError("--init-from starts a new run from pretrained weights; --resume continues one: "
                         "pass only one of them")
    config = resolve_config(run_dir, args.preset, args.config, overrides, args.resume)
    announce_compiles()
    init_from = None
    if args.init_from is not None:
        config, weights, info = pretrained_config(args.init_from, config, overrides, args.data)
        init_from = (args.init_from, weights, info)
    dp = DataParallel(args.device, config.train.dist_timeout)
    threads = config.train.threads or (max(1, cores_available() // dp.local_world_size) if dp.world_size > 1 else 0)
    if threads and args.device == "cpu":
        set_threads(threads)
    trainer = Trainer(args.data, run_dir, config, resume=args.resume, init_from=init_from, dp=dp, backend=args.device)
    peak = None
    if args.device == "cpu":
        dtype = config.train.dtype  # bf16 products: MFU against the bf16 product's peak
        peak = float(dp.sum([sgemm_peak(dtype=dtype)["median_gflops"]])[0])  # every rank measures at once: their sum
        if dp.is_main:
            print(peak_line(dtype, peak, dp.world_size, threads))
    trainer.run(peak_gflops=peak)
    dp.close()
    if trainer.interrupted:  # Ctrl-C: the checkpoint is written; a `&&` chain must not go on as if done
        if dp.is_main:
            again = ["handgrad", "train", "--data", str(args.data), "--out", str(run_dir), "--resume"]
            again += ["--device", args.device] if args.device != "cpu" else []
            launch = " (under the same torchrun launch)" if dp.world_size > 1 else ""
            print(f"interrupted at step {trainer.step} of {config.train.max_steps}; checkpoint saved; resume "
                  f"with{launch}: {shlex.join(again)}", file=sys.stderr)
        return 130
    if dp.is_main:
        print(f"done: {trainer.step} steps; metrics {run_dir / 'metrics.jsonl'}; loss plot {run_dir / 'loss.png'}")
    return 0

