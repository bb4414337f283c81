"""`handgrad bench learn`: does handgrad learn like PyTorch does?

Trains handgrad and PyTorch (torch_ref.TorchGPT for GPT-2, transformers' LlamaForCausalLM for
`--preset llama-char`; float32, eager) side by side from the same initial weights on the same
batches, with the same AdamW, warmup + cosine schedule and clipping, and records both train-loss
curves and both val losses at every evaluation. Writes OUT/learn-{preset}.json and
OUT/learn-{preset}.png, and prints a table.

Two more checks share the same side-by-side loop: `--lora R` (Llama presets), handgrad's LoRA against
PEFT's on a second corpus (run_learn_lora), and `--dtype bfloat16`, handgrad's bf16 run and PyTorch's
autocast against handgrad's float32 one (run_learn).
"""
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

from ..config import LORA_TARGETS, LoRAConfig, load_run_config
from ..files import write_atomic
from ..data.prepare import prepare
from ..data.shards import Dataset
from ..models import get_family
from ..training.optim import AdamW
from ..training.step import accumulate_gradients, lr_at
from .torch_side import TorchSide


def _ensure_data(data_dir, source, tokenizer):
    data_dir = Path(data_dir)
    if not (data_dir / "meta.json").is_file():
        print(f"preparing {source} ({tokenizer}) into {data_dir}")
        prepare([source], data_dir, tokenizer=tokenizer)
    return data_dir


class _TorchSide:
    """PyTorch from the same weights (bench/torch_side.py's TorchSide, the plain reference: TorchGPT
    for GPT-2, transformers' LlamaForCausalLM with eager attention for the Llama family), float32,
    eager. kw: TorchSide's autocast, or its lora and seed."""

    def __init__(self, family, config, state, t, **kw):
        self.side = TorchSide(family, config, state, t, fast=False, **kw)

    def loss(self, x, y):
        return self.side.eval_loss(self.side.prepare(x, y))

    def step(self, batches, lr):
        losses = self.side.step([self.side.prepare(x, y) for x, y in batches], lr)
        return sum(loss.item() / len(batches) for loss in losses)


class _HandgradSide:
    def __init__(self, model, t):
        self.model, self.grad_clip = model, t.grad_clip
        self.opt = AdamW(model, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)

    def loss(self, x, y):
        return self.model.forward(x, y)

    def step(self, batches, lr):
        loss, _, grad_scale = accumulate_gradients(self.model, self.opt, batches, self.grad_clip)
        self.opt.step(lr=lr, grad_scale=grad_scale)
        return loss


def _train_side_by_side(sides, t, T, train_data, val_data, record, log_prefix=""):
    """t.max_steps steps of every side on the same batches and learning rates; val losses (the same
    val batches every time) at each eval_interval and at the end, into record[name]."""
    rng = np.random.Generator(np.random.PCG64([t.seed, 1]))
    for step in range(t.max_steps):
        batches = [train_data.get_batch(t.batch_size, T, rng) for _ in range(t.grad_accum_steps)]
        lr = lr_at(step, t)
        for name, side in sides.items():
            t0 = time.perf_counter()
            loss = side.step(batches, lr)
            record[name]["seconds"] += time.perf_counter() - t0
            record[name]["step"].append(step + 1)
            record[name]["loss"].append(loss)
        done = step + 1
        if t.eval_interval and (done % t.eval_interval == 0 or done == t.max_steps):
            for name, side in sides.items():
                record[name]["val_step"].append(done)
                record[name]["val_loss"].append(_val_loss(side, val_data, t, T))
            cells = " vs ".join(f"{record[n]['loss'][-1]:.4f}" for n in sides)
            vals = " vs ".join(f"{record[n]['val_loss'][-1]:.4f}" for n in sides)
            print(f"{log_prefix}step {done:>5} | train {cells} | val {vals} ({' vs '.join(sides)})", flush=True)


def _val_loss(side, val_data, t, T):
    vrng = np.random.Generator(np.random.PCG64([t.seed, 3]))
    return float(np.mean([side.loss(*val_data.get_batch(t.batch_size, T, vrng)) for _ in range(t.eval_steps)]))


def _new_record(sides):
    return {name: {"step": [], "loss": [], "val_step": [], "val_loss": [], "seconds": 0.0} for name in sides}


def _write(result, record, out_dir, name, title):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / f"{name}.json", json.dumps(result) + "\n")
    _plot(record, out_dir / f"{name}.png", title)
    print(f"wrote {out_dir / f'{name}.json'} and {out_dir / f'{name}.png'}")


def run_learn(preset="shakespeare-char", steps=None, data_dir=None, out_dir="docs", source="shakespeare",
              tokenizer="char", dtype="float32"):
    """The float32 learning check; with dtype "bfloat16" the mixed-precision one: handgrad's bf16 run
    (train.dtype = bfloat16 on the cpu), PyTorch's under torch.autocast("cpu", dtype=torch.bfloat16),
    and handgrad's float32 run, three sides on the same batches from the same weights, recording how
    far each bf16 curve ends from handgrad's float32 one (OUT/learn-{preset}-bf16.json and .png)."""
    from ..torch_ref import require_torch
    require_torch()
    overrides = {"train.max_steps": steps} if steps else None
    config = load_run_config(preset, overrides=overrides)
    t, T = config.train, config.model.block_size
    data_dir = _ensure_data(data_dir or Path.home() / ".cache" / "handgrad" / f"data-{source}-{tokenizer}",
                            source, tokenizer)
    train_data, val_data = Dataset(data_dir, "train"), Dataset(data_dir, "val")
    family, arch = get_family(config.model.arch), config.gpt_config(train_data.vocab_size)
    bf16 = dtype == "bfloat16"
    model = family.model(arch, seed=t.seed, dtype=dtype)
    sides = {"handgrad": _HandgradSide(model, t),
             "pytorch": _TorchSide(family, model.config, model.state_dict(), t, autocast=bf16)}
    if bf16:
        sides["handgrad-fp32"] = _HandgradSide(family.model(arch, seed=t.seed), t)
    record = _new_record(sides)
    print(f"bench learn: preset {preset}, {t.max_steps} steps, data {data_dir}, vocab {train_data.vocab_size}"
          + (", handgrad bf16 / pytorch autocast bf16 / handgrad float32" if bf16 else ""))
    _train_side_by_side(sides, t, T, train_data, val_data, record)
    result = {"preset": preset, "config": config.to_dict(), "data": str(data_dir), "dtype": dtype,
              "vocab_size": train_data.vocab_size, "curves": record}
    name, title = f"learn-{preset}", preset
    if bf16:
        result["bf16"] = _bf16_summary(record)
        name, title = f"{name}-bf16", f"{preset}, bf16 beside float32"
    _write(result, record, out_dir, name, title)
    return result


BF16_TAIL = 100  # steps: the end of a train curve, averaged (the sides see the same batches)


def _bf16_summary(record):
    """How far each bf16 side ends from handgrad's float32 run: the last val losses, and the train
    losses over the last BF16_TAIL steps (mean of the per-step differences, same batches)."""
    ref = record["handgrad-fp32"]
    out = {}
    for name in ("handgrad", "pytorch"):
        r = record[name]
        tail = np.subtract(r["loss"][-BF16_TAIL:], ref["loss"][-BF16_TAIL:])
        out[name] = {"final_val": r["val_loss"][-1], "val_diff": r["val_loss"][-1] - ref["val_loss"][-1],
                     "train_tail_diff": float(np.mean(tail)),
                     "max_val_diff": float(np.max(np.abs(np.subtract(r["val_loss"], ref["val_loss"]))))}
        print(f"{name} bf16 against handgrad float32: final val {r['val_loss'][-1]:.4f} vs {ref['val_loss'][-1]:.4f} "
              f"({out[name]['val_diff']:+.4f}); last {BF16_TAIL} train losses {out[name]['train_tail_diff']:+.4f} on "
              f"average", flush=True)
    out["fp32_final_val"] = ref["val_loss"][-1]
    return out


LORA_FINETUNE_STEPS = 500


def run_learn_lora(rank, preset="llama-char", steps=None, pretrain_steps=None, data_dir=None, finetune_data=None,
                   out_dir="docs"):
    """The LoRA learning check. steps: fine-tuning steps (default LORA_FINETUNE_STEPS);
    pretrain_steps: default the preset's train.max_steps.

    handgrad first pretrains the preset's model on one corpus (shakespeare, byte tokenizer: every
    corpus shares its 256 ids), then fine-tunes rank-R adapters on every linear of every block (alpha
    2R) on another corpus (the Python standard library), side by side with PEFT's LoRA on transformers'
    LlamaForCausalLM holding the same pretrained weights and the same initial adapters. It records the
    fine-tuning corpus' val loss before and after (LoRA must lower it), both fine-tuning curves, and the
    pretraining corpus' val loss before and after (what the adapters cost the old corpus). Writes
    OUT/learn-{preset}-lora{R}.json and .png."""
    from ..torch_ref import require_torch
    require_torch()
    config = load_run_config(preset)
    if config.model.arch != "llama":
        raise SystemExit(f"bench learn --lora: {preset} is a GPT-2 preset; the LoRA check compares against PEFT on "
                         f"transformers' Llama (use --preset llama-char)")
    cache = Path.home() / ".cache" / "handgrad"
    pre_dir = _ensure_data(data_dir or cache / "data-shakespeare-byte", "shakespeare", "byte")
    ft_dir = _ensure_data(finetune_data or cache / "data-pystdlib-byte", "pystdlib", "byte")
    pre = {s: Dataset(pre_dir, s) for s in ("train", "val")}
    ft = {s: Dataset(ft_dir, s) for s in ("train", "val")}
    if pre["train"].vocab_size != ft["train"].vocab_size:
        raise SystemExit(f"bench learn --lora: {pre_dir} has {pre['train'].vocab_size} token ids but {ft_dir} has "
                         f"{ft['train'].vocab_size}; prepare both with one tokenizer (--tokenizer byte)")
    T = config.model.block_size
    t_pre = config.train if not pretrain_steps else dataclasses.replace(config.train, max_steps=pretrain_steps)
    n_ft = steps or LORA_FINETUNE_STEPS
    t_ft = dataclasses.replace(config.train, max_steps=n_ft, warmup_steps=min(config.train.warmup_steps, n_ft // 10))
    arch = config.gpt_config(pre["train"].vocab_size)
    family = get_family(config.model.arch)

    print(f"bench learn --lora {rank}: preset {preset}; pretraining {t_pre.max_steps} steps on {pre_dir}")
    model = family.model(arch, seed=t_pre.seed)
    pre_record = _new_record(["handgrad"])
    _train_side_by_side({"handgrad": _HandgradSide(model, t_pre)}, t_pre, T, pre["train"], pre["val"], pre_record,
                        log_prefix="pretrain ")
    base = model.state_dict()

    lora = LoRAConfig(rank=rank, alpha=2.0 * rank, targets=LORA_TARGETS["llama"])
    tuned = family.model(arch, seed=t_ft.seed, lora=lora)  # its adapters: initial_adapters(seed)
    tuned.load_state_dict(base, names=tuned.base_names)
    sides = {"handgrad": _HandgradSide(tuned, t_ft),
             "pytorch": _TorchSide(family, arch, base, t_ft, lora=lora, seed=t_ft.seed)}
    before = {"finetune_val": _val_loss(sides["handgrad"], ft["val"], t_ft, T),
              "pretrain_val": _val_loss(sides["handgrad"], pre["val"], t_ft, T)}
    record = _new_record(sides)
    for r in record.values():
        r["val_step"].append(0)
        r["val_loss"].append(before["finetune_val"])
    print(f"fine-tuning rank-{rank} adapters {n_ft} steps on {ft_dir} (val loss before: {before['finetune_val']:.4f})")
    _train_side_by_side(sides, t_ft, T, ft["train"], ft["val"], record, log_prefix="lora ")
    after = {name: {"finetune_val": record[name]["val_loss"][-1],
                    "pretrain_val": _val_loss(side, pre["val"], t_ft, T)} for name, side in sides.items()}
    h, p = (np.asarray(record[n]["loss"]) for n in ("handgrad", "pytorch"))
    summary = {"before": before, "after": after, "lowered": bool(after["handgrad"]["finetune_val"] < before["finetune_val"]),
               "max_train_loss_diff": float(np.max(np.abs(h - p))),
               "max_val_loss_diff": float(np.max(np.abs(np.subtract(record["handgrad"]["val_loss"],
                                                                     record["pytorch"]["val_loss"]))))}
    print(f"fine-tuning val loss {before['finetune_val']:.4f} -> handgrad {after['handgrad']['finetune_val']:.4f}, "
          f"pytorch+peft {after['pytorch']['finetune_val']:.4f}; pretraining corpus val {before['pretrain_val']:.4f} -> "
          f"{after['handgrad']['pretrain_val']:.4f}; largest train-loss gap {summary['max_train_loss_diff']:.2e}")
    result = {"preset": preset, "config": config.to_dict(), "lora": lora.to_dict(), "pretrain_data": str(pre_dir),
              "finetune_data": str(ft_dir), "vocab_size": arch.vocab_size, "pretrain_steps": t_pre.max_steps,
              "finetune_steps": n_ft, "summary": summary, "pretrain": pre_record, "curves": record}
    _write(result, record, out_dir, f"learn-{preset}-lora{rank}", f"{preset}, LoRA rank {rank} (after pretraining)")
    return result


def _plot(record, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, r), color in zip(record.items(), ("C0", "C1", "C2")):
        ax.plot(r["step"], r["loss"], lw=0.6, alpha=0.6, color=color, label=f"{name} train")
        ax.plot(r["val_step"], r["val_loss"], "o-", color=color, label=f"{name} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"bench learn: {title}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, path)  # whole or not at all
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)

