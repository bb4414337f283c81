"""One optimizer step's arithmetic, shared by the trainer and the benchmarks: the learning-rate
schedule and gradient accumulation (with data-parallel reduction and clipping)."""
import math

from .optim import clip_scale, grad_norm


def lr_at(step, t):
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to min_lr."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.max_steps <= t.warmup_steps:
        return t.lr
    progress = min(1.0, (step - t.warmup_steps) / (t.max_steps - t.warmup_steps))
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


def accumulate_gradients(model, opt, batches, grad_clip, dp=None, zero_stage=0, dropout_key=None, objective=None):
    """zero_grad, then forward + backward on each (x, y) or (x, y, positions) micro-batch, or with
    objective (training/dpo.py's DPO) its step on each of its micro-batches. The
    gradient buffer then holds the sum of the micro-batches' mean-loss gradients; with dp
    (data-parallel ranks, see handgrad.training.distributed) also summed over the ranks, all of it
    or (zero_stage 1) this rank's slice. Returns (mean loss, norm of the mean gradient, the
    grad_scale for opt.step that turns the buffer into the clipped mean gradient), the same on
    every rank.
    dropout_key (seed, step): dropout on (model.dropout, train.lora_dropout), each micro-batch's masks
    keyed by (seed, step, micro-step, layer, site); off again afterwards."""
    model.zero_grad()
    hook = dp.grads_ready(model) if dp is not None and zero_stage == 0 else None
    loss = 0.0
    for i, batch in enumerate(batches):  # (x, y), or (x, y, positions) for packed documents
        dropout = None if dropout_key is None else dict(step=dropout_key[1], micro_step=i, seed=dropout_key[0])
        ready = hook if i == len(batches) - 1 else None
        try:
            if objective is not None:
                loss += objective.step(model, batch, ready, dropout) / len(batches)
                continue
            if dropout is not None:
                model.set_training(True, **dropout)
            loss += model.forward(*batch, grad=True) / len(batches)
            model.backward(grads_ready=ready)
        finally:
            model.set_training(False)
    ranks = 1 if dp is None else dp.world_size
    if dp is not None:
        dp.finish_gradients(model, zero_stage)
    norm = float(grad_norm(model, opt.chunks, opt.lo))  # a device scalar on the gpu: this waits for it
    if ranks > 1:
        # a sharded optimizer holds only its slice of the summed gradient: add the squares up
        sharded = (opt.lo, opt.hi) != (0, model.num_params)
        loss_sum, sumsq = dp.sum([loss, norm * norm if sharded else 0.0])
        loss = float(loss_sum) / ranks
        if sharded:
            norm = math.sqrt(sumsq)
    mean = 1.0 / (len(batches) * ranks)  # SUM over micro-batches and ranks, then scale
    norm *= mean
    return loss, norm, mean * clip_scale(norm, grad_clip)

