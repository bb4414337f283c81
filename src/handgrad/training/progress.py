"""What a run shows: the log line of a step, the progress bar, and RUN_DIR/loss.png."""
import json
import os
import sys
from pathlib import Path


def progress_bar(start, total):
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)


def format_step(rec, gflops, peak):
    line = (f"step {rec['step']:>6} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | norm {rec['grad_norm']:.4f} | "
            f"{rec['ms']:7.1f} ms | {rec['tok_per_s']:8,.0f} tok/s | {gflops:6.1f} GFLOP/s")
    if peak:
        line += f" | MFU {100 * gflops / peak:4.1f}%"
    if "target_tok_per_s" in rec:  # chat data: the tokens the loss learnt from (assistant tokens)
        line += f" | {rec['target_tok_per_s']:,.0f} target tok/s"
    if "rewards/accuracies" in rec:  # train.objective dpo
        line += f" | reward acc {rec['rewards/accuracies']:.2f} margin {rec['rewards/margins']:.3f}"
    if "val_loss" in rec:
        line += f" | val {rec['val_loss']:.4f}"
    if "val_rewards/accuracies" in rec:
        line += f" acc {rec['val_rewards/accuracies']:.2f} margin {rec['val_rewards/margins']:.3f}"
    for key, value in rec.items():  # train.eval_tasks: each task's accuracy
        if key.startswith("eval/") and key.endswith("/acc"):
            line += f" | {key[5:-4]} {value:.3f}"
    return line


def plot_losses(run_dir):
    """RUN_DIR/loss.png: train loss per step and val loss at each evaluation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    run_dir = Path(run_dir)
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    if not recs:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], lw=0.8, label="train")
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = run_dir / "loss.png"
    tmp = run_dir / ".loss.png.tmp"
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, out)  # whole or not at all, as every other file of the run
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out

