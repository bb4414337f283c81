"""`handgrad bench learn`: does handgrad learn like PyTorch does?

Trains handgrad and PyTorch (torch_ref.TorchGPT for GPT-2, transformers' LlamaForCausalLM for
`--preset llama-char`; float32, eager) side by side from the same
initial weights on the same batches, with the same AdamW, warmup + cosine schedule and clipping,
and records both train-loss curves and both val losses at every evaluation. Writes
OUT/learn-{preset}.json and OUT/learn-{preset}.png, and prints a table.
"""
import json
import os
import time
from pathlib import Path

import numpy as np

from ..config import LlamaConfig, load_run_config
from ..files import write_atomic
from ..data.prepare import prepare
from ..data.shards import Dataset
from ..models import get_family
from ..training.optim import AdamW
from ..training.step import accumulate_gradients, lr_at


def _ensure_data(data_dir, source, tokenizer):
    data_dir = Path(data_dir)
    if not (data_dir / "meta.json").is_file():
        print(f"preparing {source} ({tokenizer}) into {data_dir}")
        prepare([source], data_dir, tokenizer=tokenizer)
    return data_dir


class _TorchSide:
    """PyTorch from the same weights: torch_ref.TorchGPT for GPT-2, transformers' own
    LlamaForCausalLM (Qwen2ForCausalLM with q/k/v biases) for the Llama family; float32, eager."""

    def __init__(self, arch_config, state, t):
        from ..torch_ref import TorchGPT, TorchLlama, torch
        self.torch = torch
        ref = TorchLlama if isinstance(arch_config, LlamaConfig) else TorchGPT
        self.model = ref(arch_config, torch.float32).load_numpy(state)
        self.opt = self.model.adamw(lr=t.lr, weight_decay=t.weight_decay, betas=(t.beta1, t.beta2))

    def loss(self, x, y):
        with self.torch.no_grad():
            return self.model(self.torch.from_numpy(x).long(), self.torch.from_numpy(y).long())[1].item()

    def step(self, batches, lr, max_norm):
        torch = self.torch
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in batches:
            _, loss = self.model(torch.from_numpy(x).long(), torch.from_numpy(y).long())
            (loss / len(batches)).backward()
            total += loss.item() / len(batches)
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        return total


class _HandgradSide:
    def __init__(self, model, t):
        self.model = model
        self.opt = AdamW(model, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)

    def loss(self, x, y):
        return self.model.forward(x, y)

    def step(self, batches, lr, max_norm):
        loss, _, grad_scale = accumulate_gradients(self.model, self.opt, batches, max_norm)
        self.opt.step(lr=lr, grad_scale=grad_scale)
        return loss


def run_learn(preset="shakespeare-char", steps=None, data_dir=None, out_dir="docs", source="shakespeare",
              tokenizer="char"):
    from ..torch_ref import require_torch
    require_torch()
    overrides = {"train.max_steps": steps} if steps else None
    config = load_run_config(preset, overrides=overrides)
    t, T = config.train, config.model.block_size
    data_dir = _ensure_data(data_dir or Path.home() / ".cache" / "handgrad" / f"data-{source}-{tokenizer}",
                            source, tokenizer)
    train_data, val_data = Dataset(data_dir, "train"), Dataset(data_dir, "val")
    model = get_family(config.model.arch).model(config.gpt_config(train_data.vocab_size), seed=t.seed)
    sides = {"handgrad": _HandgradSide(model, t), "pytorch": _TorchSide(model.config, model.state_dict(), t)}
    rng = np.random.Generator(np.random.PCG64([t.seed, 1]))
    record = {name: {"step": [], "loss": [], "val_step": [], "val_loss": [], "seconds": 0.0} for name in sides}
    print(f"bench learn: preset {preset}, {t.max_steps} steps, data {data_dir}, vocab {train_data.vocab_size}")
    for step in range(t.max_steps):
        batches = [train_data.get_batch(t.batch_size, T, rng) for _ in range(t.grad_accum_steps)]
        lr = lr_at(step, t)
        for name, side in sides.items():
            t0 = time.perf_counter()
            loss = side.step(batches, lr, t.grad_clip)
            record[name]["seconds"] += time.perf_counter() - t0
            record[name]["step"].append(step + 1)
            record[name]["loss"].append(loss)
        done = step + 1
        if t.eval_interval and (done % t.eval_interval == 0 or done == t.max_steps):
            vrng = np.random.Generator(np.random.PCG64([t.seed, 3]))
            vb = [val_data.get_batch(t.batch_size, T, vrng) for _ in range(t.eval_steps)]
            for name, side in sides.items():
                record[name]["val_step"].append(done)
                record[name]["val_loss"].append(float(np.mean([side.loss(x, y) for x, y in vb])))
            h, p = record["handgrad"], record["pytorch"]
            print(f"step {done:>5} | train {h['loss'][-1]:.4f} vs {p['loss'][-1]:.4f} | "
                  f"val {h['val_loss'][-1]:.4f} vs {p['val_loss'][-1]:.4f} (handgrad vs pytorch)", flush=True)
    result = {"preset": preset, "config": config.to_dict(), "data": str(data_dir),
              "vocab_size": train_data.vocab_size, "curves": record}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / f"learn-{preset}.json", json.dumps(result) + "\n")
    _plot(record, out_dir / f"learn-{preset}.png", preset)
    print(f"wrote {out_dir / f'learn-{preset}.json'} and {out_dir / f'learn-{preset}.png'}")
    return result


def _plot(record, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, r), color in zip(record.items(), ("C0", "C1")):
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

