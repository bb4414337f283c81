"""`handgrad train`: batches from memory-mapped shards, gradient accumulation, AdamW with warmup
and cosine decay, clipping, periodic validation, samples and checkpoints, exact resume."""
import json
import math
import os
import signal
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np

from .checkpoint import CheckpointError, list_checkpoints, restore, save_checkpoint
from .config import SECTIONS, ConfigError, load_run_config
from .model import GPT, flops_per_token
from .sources import DataError
from .optim import AdamW, clip_scale, grad_norm


class TrainError(ValueError):
    """A problem with the run's inputs or outputs; the message names the path or key."""


def add_arguments(parser):
    parser.add_argument("--data", required=True, metavar="DATA_DIR", help="a directory made by `handgrad prepare`")
    parser.add_argument("--out", required=True, metavar="RUN_DIR", help="where config, metrics, checkpoints go")
    parser.add_argument("--preset", help="named preset: tiny, shakespeare-char, mid, gpt2-124m")
    parser.add_argument("--config", metavar="FILE", help="a TOML, JSON or YAML file of model.* and train.* keys")
    parser.add_argument("--resume", action="store_true", help="continue from RUN_DIR's newest checkpoint")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                        help="cpu: NumPy + Numba (default); gpu: Triton kernels and cuBLAS on an NVIDIA GPU")
    parser.add_argument("--init-from", metavar="PATH", default=None,
                        help="start a new run from pretrained weights (fine-tuning): a Hugging Face GPT-2 "
                             "directory, an llm.c model file, or a handgrad run; the architecture is the "
                             "model's, model.block_size may crop its positions")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section}.* overrides (win over the preset and the file)")
        for f in fields(cls):
            group.add_argument(f"--{section}.{f.name}", dest=f"override:{section}.{f.name}", metavar="V",
                               help=f"default {f.default}")


def lr_at(step, t):
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to min_lr."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.max_steps <= t.warmup_steps:
        return t.lr
    progress = min(1.0, (step - t.warmup_steps) / (t.max_steps - t.warmup_steps))
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


def accumulate_gradients(model, opt, batches, grad_clip, dp=None, zero_stage=0):
    """zero_grad, then forward + backward on each (x, y) micro-batch. The gradient buffer then
    holds the sum of the micro-batches' mean-loss gradients; with dp (data-parallel ranks, see
    handgrad.distributed) also summed over the ranks, all of it or (zero_stage 1) this rank's
    slice. Returns (mean loss, norm of the mean gradient, the grad_scale for opt.step that turns
    the buffer into the clipped mean gradient), the same on every rank."""
    model.zero_grad()
    hook = dp.grads_ready(model) if dp is not None and zero_stage == 0 else None
    loss = 0.0
    for i, (x, y) in enumerate(batches):
        loss += model.forward(x, y) / len(batches)
        model.backward(grads_ready=hook if i == len(batches) - 1 else None)
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


class _StopFlag:
    """First Ctrl-C asks the loop to checkpoint and stop after the current step; a second aborts."""

    def __enter__(self):
        self.requested = False
        self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\ninterrupt: finishing this step, saving a checkpoint, then stopping "
              "(Ctrl-C again to abort without saving)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._old)


def _rng(state=None, seed=None):
    rng = np.random.Generator(np.random.PCG64(seed))
    if state is not None:
        rng.bit_generator.state = state
    return rng


def resolve_config(run_dir, preset=None, config_file=None, overrides=None, resume=False):
    """A fresh run's config (preset, file, overrides), or with resume the saved config with any
    preset, file and overrides applied on top; the architecture cannot change on resume."""
    saved = run_dir / "config.json"
    if not resume:
        if list_checkpoints(run_dir):
            raise TrainError(f"{run_dir}: already holds checkpoints; pass --resume to continue, "
                             f"or choose another --out")
        return load_run_config(preset, config_file, overrides)
    if not saved.is_file():
        raise TrainError(f"{saved}: missing; nothing to resume in {run_dir} (drop --resume to start a run)")
    try:
        doc = json.loads(saved.read_text(encoding="utf-8"))
        base = {"model": dict(doc["model"]), "train": dict(doc["train"])}
    except (ValueError, KeyError, TypeError) as e:  # bad JSON or UTF-8, or not a run's config
        raise TrainError(f"{saved}: not a readable run config ({type(e).__name__}: {e}); "
                         f"nothing can be resumed from {run_dir}, start a new run with another --out") from None
    config = load_run_config(preset, config_file, overrides, base=base)
    for key, old in base["model"].items():
        new = getattr(config.model, key)
        if new != old:
            raise ConfigError(f"model.{key}: cannot change on resume (saved {old}, asked {new}); "
                              f"drop --model.{key}, or start a new run with another --out")
    return config


def pretrained_config(path, config, overrides):
    """The run config with the pretrained model's architecture; its weights. model.n_layer, n_head
    and n_embd come from the model (an override that disagrees is an error); model.block_size may
    be smaller than the model's, never larger."""
    from .convert import load_pretrained
    pre, weights, _ = load_pretrained(path)
    for key in ("n_layer", "n_head", "n_embd"):
        asked = (overrides or {}).get(f"model.{key}")
        if asked is not None and int(asked) != getattr(pre, key):
            raise ConfigError(f"model.{key}: {asked} differs from the --init-from model's {getattr(pre, key)}; "
                              f"drop --model.{key}")
        setattr(config.model, key, getattr(pre, key))
    if config.model.block_size > pre.block_size:
        if (overrides or {}).get("model.block_size") is not None:
            raise ConfigError(f"model.block_size: {config.model.block_size} is above the --init-from model's "
                              f"{pre.block_size}; use at most {pre.block_size}")
        config.model.block_size = pre.block_size
    return config, weights


class Trainer:
    """One training run over a prepared data directory, writing into run_dir."""

    def __init__(self, data_dir, run_dir, config, resume=False, log=print, init_from=None, dp=None, backend="cpu"):
        """dp: this process's handgrad.distributed.DataParallel (several ranks under torchrun);
        only rank 0 logs and writes into run_dir. backend: "cpu" or "gpu"."""
        from .data import Dataset
        from .distributed import DataParallel
        self.dp = dp if dp is not None else DataParallel()
        self.data_dir, self.run_dir, self.config = Path(data_dir), Path(run_dir), config
        self.log = log if self.dp.is_main else (lambda *a, **k: None)
        self.train_data, self.val_data = Dataset(data_dir, "train"), Dataset(data_dir, "val")
        t = config.train
        self._check_data(config.model.block_size)
        if resume:
            self._check_same_data()
        self.gpt_config = config.gpt_config(self.train_data.vocab_size)
        if t.dtype == "bfloat16" and backend != "gpu":
            raise ConfigError("train.dtype: bfloat16 is the gpu backend's mixed precision; add --device gpu, or "
                              "use --train.dtype float32 on the cpu")
        if t.cuda_graph:
            check_cuda_graph(backend, self.dp.world_size)
        self.model = GPT(self.gpt_config, backend=backend, seed=t.seed, buffer_multiple=self.dp.world_size,
                         dtype=t.dtype)
        if init_from is not None:
            self._load_pretrained(*init_from)
        # ZeRO stage 1: this rank keeps AdamW moments for its slice of the flat buffer only
        self.sharded = t.zero_stage == 1 and self.dp.world_size > 1
        shard = self.dp.shard(len(self.model.flat_params)) if self.sharded else None
        self.opt = AdamW(self.model, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay, shard=shard)
        self.data_rng, self.sample_rng = _rng(seed=[t.seed, 1]), _rng(seed=[t.seed, 2])
        self.step = 0
        self.device_loop = None  # the gpu's sync-free step (handgrad.device_loop), made at the first step
        self._prepare_run_dir(resume)
        # every rank starts from rank 0's weights (resumed ones are equal already: checked above)
        self.dp.broadcast(self.model.flat_params)
        if self.sharded:
            full, ours = 8 * self.model.num_params, 8 * (shard[1] - shard[0])
            self.log(f"zero_stage 1: AdamW moments sharded over {self.dp.world_size} ranks: {ours / 2**20:,.1f} MiB "
                     f"per rank instead of {full / 2**20:,.1f} MiB (saves {(full - ours) / 2**20:,.1f} MiB per rank)")

    def _load_pretrained(self, path, weights):
        """Pretrained weights (from pretrained_config) into the fresh model; wpe keeps its first
        block_size rows (nanoGPT's crop_block_size)."""
        if self.gpt_config.vocab_size != weights["wte.weight"].shape[0]:
            raise TrainError(f"--init-from {path}: the model has {weights['wte.weight'].shape[0]} tokens but "
                             f"{self.data_dir} has vocab_size {self.gpt_config.vocab_size}; prepare the data "
                             f"with the model's tokenizer")
        weights = dict(weights, **{"wpe.weight": weights["wpe.weight"][:self.gpt_config.block_size]})
        self.model.load_state_dict(weights)
        c = self.gpt_config
        self.log(f"initialised from {path}: n_layer {c.n_layer}, n_head {c.n_head}, n_embd {c.n_embd}, "
                 f"block_size {c.block_size}")

    def _check_same_data(self):
        """A run resumes only on data with its tokenizer and vocabulary (checked before building):
        the same kind and vocab_size, and the same tokenizer.json as the run's copy (two char
        vocabularies of one size can still map ids to different characters)."""
        from .tokenizer import TOKENIZER_FILE
        saved = json.loads((self.run_dir / "config.json").read_text())
        ours = {"tokenizer": self.train_data.meta.get("tokenizer"), "vocab_size": self.train_data.vocab_size}
        theirs = {k: saved.get(k) for k in ours}
        if theirs != ours:
            raise TrainError(f"{self.data_dir}: tokenizer/vocab {ours} differs from the run's {theirs}; "
                             f"resume with the data the run was trained on")
        run_tok, data_tok = self.run_dir / TOKENIZER_FILE, self.data_dir / TOKENIZER_FILE
        if run_tok.is_file() and _read_json(run_tok) != _read_json(data_tok):
            raise TrainError(f"{data_tok} differs from the run's copy {run_tok} (same kind and vocab_size, other "
                             f"tokens); resume with the data the run was trained on")

    def _check_data(self, T):
        """Before anything is written: every token id < vocab_size, windows of T + 1 tokens fit, and
        tokenizer.json has meta.json's vocab_size (samples are decoded with it)."""
        for ds in (self.train_data, self.val_data):
            ds.check_tokens()
            longest = max(ds.lengths, default=0)
            if ds.num_tokens and longest < T + 1:
                raise TrainError(f"model.block_size {T} is too large for the {ds.split} split of {self.data_dir}: "
                                 f"its longest shard has {longest} tokens; use at most {longest - 1}")
        if not self.train_data.num_tokens:
            raise TrainError(f"{self.data_dir}: the train split is empty; prepare more text")
        from .tokenizer import GPT2Tokenizer, load_tokenizer
        tok_file = self.data_dir / "tokenizer.json"
        doc = _read_json(tok_file) if tok_file.is_file() else None
        gpt2 = isinstance(doc, dict) and doc.get("type") == "gpt2"
        if gpt2 and not self.config.train.sample_interval:
            n = GPT2Tokenizer.VOCAB_SIZE  # training on GPT-2 tokens (llm.c shards) needs no tiktoken
        else:
            try:
                n = load_tokenizer(self.data_dir).vocab_size
            except DataError as e:
                if not gpt2:
                    raise
                raise TrainError(f"{e}; or train without samples: --train.sample_interval 0") from None
        if n != self.train_data.vocab_size:
            raise TrainError(f"{self.data_dir}: meta.json says vocab_size {self.train_data.vocab_size} but "
                             f"tokenizer.json has {n} tokens; re-run handgrad prepare")

    # ------------------------------------------------------------ run directory
    def _prepare_run_dir(self, resume):
        from .tokenizer import copy_tokenizer
        meta = self.train_data.meta
        identity = {"tokenizer": meta.get("tokenizer"), "vocab_size": self.train_data.vocab_size}
        self.identity = identity
        main = self.dp.is_main
        if resume:  # every rank restores the checkpoint itself (the run dir is shared, as the data is)
            self._resume(identity)
        if not main:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / ".write_test"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise TrainError(f"{self.run_dir}: cannot write there ({e.strerror}); choose another --out") from None
        if resume:
            self._truncate_metrics(self.step)
        else:
            copy_tokenizer(self.data_dir, self.run_dir)
            (self.run_dir / "metrics.jsonl").write_text("")
        doc = dict(self.config.to_dict(), data=str(self.data_dir.resolve()), vocab_size=self.train_data.vocab_size,
                   tokenizer=meta.get("tokenizer"), world_size=self.dp.world_size)
        _write_atomic(self.run_dir / "config.json", json.dumps(doc, indent=1) + "\n")

    def _resume(self, identity):
        step, path, state = self._restore_newest_intact()
        if state["data"]["identity"] != identity:
            raise TrainError(f"{self.data_dir}: tokenizer/vocab {identity} differs from the run's "
                             f"{state['data']['identity']}; resume with the data the run was trained on")
        self.step = step
        self.data_rng = _rng(state["rng"]["data"])
        self.sample_rng = _rng(state["rng"]["sample"])
        self.dp.agree(step, "the checkpoint step resumed from")
        self.log(f"resumed from {path} at step {step}")

    def _full_optimizer(self):
        """What a checkpoint holds of AdamW: the optimizer itself, or under ZeRO-1 a stand-in with
        full-size moments (filled by save's all-gather or by restore, then sliced)."""
        if not self.sharded:
            return self.opt
        from types import SimpleNamespace
        n, ops = len(self.model.flat_params), self.model.ops
        return SimpleNamespace(m=ops.zeros((n,)), v=ops.zeros((n,)), state=self.opt.state,
                               load_state=self.opt.load_state)

    def _restore_newest_intact(self):
        """Restore the newest checkpoint that passes its checksums, saying which ones were skipped."""
        ckpts = list_checkpoints(self.run_dir)
        if not ckpts:
            raise TrainError(f"{self.run_dir}: no complete checkpoint to resume from")
        for step, path in reversed(ckpts):
            try:
                full = self._full_optimizer()
                state = restore(path, self.model, full)
                if full is not self.opt:
                    self.opt.m[:], self.opt.v[:] = full.m[self.opt.lo:self.opt.hi], full.v[self.opt.lo:self.opt.hi]
                return step, path, state
            except CheckpointError as e:
                self.log(f"warning: {e}; falling back to an older checkpoint")
        raise TrainError(f"{self.run_dir}: every checkpoint is damaged ({len(ckpts)} tried); start a new run")

    def _truncate_metrics(self, step):
        """Drop metric lines past the checkpoint we resume from: they will be produced again."""
        path = self.run_dir / "metrics.jsonl"
        if path.is_file():
            keep = []
            for ln in path.read_text().splitlines():
                try:
                    if json.loads(ln)["step"] <= step:
                        keep.append(ln)
                except (ValueError, KeyError, TypeError):
                    pass  # a line torn by a kill mid-write
            _write_atomic(path, "".join(ln + "\n" for ln in keep))

    def save(self):
        """Write a checkpoint (rank 0; under ZeRO-1 every rank first all-gathers the moments).
        Returns its path, None on other ranks."""
        t = self.config.train
        opt = self._full_optimizer()
        if opt is not self.opt:
            self.dp.gather(self.opt.m, opt.m)
            self.dp.gather(self.opt.v, opt.v)
        if not self.dp.is_main:
            return None
        state = {"config": self.config.to_dict(), "model_config": self.gpt_config.to_dict(),
                 "rng": {"data": self.data_rng.bit_generator.state, "sample": self.sample_rng.bit_generator.state},
                 "data": {"data_dir": str(self.data_dir.resolve()), "identity": self.identity,
                          "batches_drawn": self.step * t.grad_accum_steps},
                 "world_size": self.dp.world_size}
        return save_checkpoint(self.run_dir, self.step, self.model, opt, state, keep=t.keep_checkpoints)

    # ------------------------------------------------------------ the loop
    def evaluate(self):
        """Mean loss over eval_steps validation batches, the same batches at every evaluation (each
        rank takes its rows of every global batch, as in training)."""
        t, T, dp = self.config.train, self.config.model.block_size, self.dp
        rng = _rng(seed=[t.seed, 3])
        losses = [self.model.forward(*self.val_data.get_batch(t.batch_size * dp.world_size, T, rng,
                                                              rows=dp.rows(t.batch_size)))
                  for _ in range(t.eval_steps)]
        return float(dp.sum([np.mean(losses)])[0]) / dp.world_size

    def sample_text(self):
        from .sample import generate
        from .tokenizer import load_tokenizer
        tok = load_tokenizer(self.run_dir)
        start = [tok.eot_id] if tok.eot_id is not None else tok.encode("\n")
        ids = generate(self.model, np.array([start]), self.config.train.sample_tokens,
                       temperature=1.0, top_k=None, rng=self.sample_rng)
        return tok.decode(ids[0, len(start):].tolist())

    def train_step(self):
        """One optimizer step over grad_accum_steps micro-batches; returns (loss, grad_norm, lr).
        On the gpu with one process loss and grad_norm are None: they stay on the device, and
        settle() reads them (see handgrad.device_loop)."""
        t, T, dp = self.config.train, self.config.model.block_size, self.dp
        # one global batch of world_size * batch_size rows per micro-step; this rank reads its rows
        batches = [self.train_data.get_batch(t.batch_size * dp.world_size, T, self.data_rng,
                                             rows=dp.rows(t.batch_size))
                   for _ in range(t.grad_accum_steps)]
        lr = lr_at(self.step, t)
        loop = self._device_loop()
        if loop is not None:
            loop.step(batches)
            self.step += 1
            return None, None, lr
        loss, norm, grad_scale = accumulate_gradients(self.model, self.opt, batches, t.grad_clip, dp, t.zero_stage)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self._numerical_fault(self.step + 1, loss)  # raises on "stop"; on "skip" the weights stay untouched
        else:
            self.opt.step(lr=lr, grad_scale=grad_scale)
            if self.sharded:  # each rank updated its own slice: all-gather the weights
                dp.gather(self.model.flat_params[self.opt.lo:self.opt.hi], self.model.flat_params)
        self.step += 1
        return loss, norm, lr

    def _device_loop(self):
        """The gpu's sync-free step (one process), made at the first step (after any resume)."""
        if self.model.backend != "gpu" or self.dp.world_size > 1:
            return None
        if self.device_loop is None:
            from .device_loop import DeviceLoop
            self.device_loop = DeviceLoop(self.model, self.opt, self.config.train, self.step,
                                          cuda_graph=self.config.train.cuda_graph)
        return self.device_loop

    def settle(self, recs, started):
        """Fill in the loss and grad_norm of the gpu's records `recs` (one read from the device)
        and their time: the window since `started` over the steps. Acts on a non-finite step as
        train.on_nan says; under stop, the records before it are returned in the error's place
        (the caller writes them) through TrainError.records."""
        results, _ = self.device_loop.read()
        ms = (time.perf_counter() - started) * 1e3 / max(1, len(recs))
        tokens = self.config.train.batch_size * self.config.model.block_size * self.config.train.grad_accum_steps
        for i, (rec, (step, loss, norm)) in enumerate(zip(recs, results)):
            rec.update(loss=loss, grad_norm=norm, ms=ms, tok_per_s=tokens / ms * 1e3)
            if not (math.isfinite(loss) and math.isfinite(norm)):
                try:
                    # the gradient buffer is that step's only when it is the newest one queued
                    self._numerical_fault(step, loss, locate=step == self.step)
                except TrainError as e:
                    e.records = recs[:i]
                    self.device_loop = None  # its stop flag is set: a later run starts a fresh one
                    raise
        return recs

    def _numerical_fault(self, step, loss, locate=True):
        """Name the step and the first non-finite gradient tensor (in param_spec order)."""
        where = "the loss" if not math.isfinite(loss) else "the gradients"
        if locate:
            bad = next((name for name, g in self.model.g.items()
                        if not np.isfinite(self.model.ops.to_numpy(g)).all()), None) or "none"
        else:  # the gpu read this step's scalars back steps later: its gradients are gone
            bad = "not located (log every step, --train.log_interval 1, to locate it)"
        msg = (f"step {step}: {where} {'is' if where == 'the loss' else 'are'} not finite"
               f" (loss {loss}; first non-finite gradient: {bad})")
        if self.config.train.on_nan == "stop":
            raise TrainError(msg + "; stopped before the optimizer touched the weights (the last checkpoint is "
                             "intact); lower train.lr, or pass --train.on_nan skip to skip such batches")
        self.log(msg + "; batch skipped (train.on_nan skip)")

    def run(self, peak_gflops=None):
        """Train to max_steps. peak_gflops (the sgemm peak of all ranks together) adds MFU to the log."""
        from .distributed import DistributedError
        t, dp = self.config.train, self.dp
        tokens_per_step = t.batch_size * self.config.model.block_size * t.grad_accum_steps * dp.world_size
        flops_per_step = flops_per_token(self.gpt_config, self.config.model.block_size) * tokens_per_step
        metrics = open(self.run_dir / "metrics.jsonl", "a") if dp.is_main else None
        bar = _progress(self.step, t.max_steps) if dp.is_main else None
        say = bar.write if bar is not None else self.log
        self.log(f"model: {self.model.num_params:,} parameters; {tokens_per_step:,} tokens per step"
                 f"{f' over {dp.world_size} ranks' if dp.world_size > 1 else ''}; steps {self.step} -> {t.max_steps}")
        try:
            with _StopFlag() as stop:
                stopping = False
                unread, window = [], time.perf_counter()  # gpu: steps whose loss is still on the device
                while self.step < t.max_steps and not stopping:
                    t0 = time.perf_counter()
                    try:
                        loss, norm, lr = self.train_step()
                    except BaseException:  # an OOM, a failed capture, a second Ctrl-C: keep what ran
                        self._settle_and_emit(unread, window, metrics, bar, say, flops_per_step, peak_gflops)
                        raise
                    dt = time.perf_counter() - t0
                    # every rank stops after the same step, if any of them was asked to
                    stopping = stop.requested if dp.world_size == 1 else dp.sum([stop.requested])[0] > 0
                    rec = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": norm,
                           "tok_per_s": tokens_per_step / dt, "ms": dt * 1e3}
                    last = self.step == t.max_steps
                    evaluate = bool(t.eval_interval and self.val_data.num_tokens
                                    and (self.step % t.eval_interval == 0 or last))
                    sample = bool(t.sample_interval and self.step % t.sample_interval == 0 and dp.is_main)
                    save = bool((t.checkpoint_interval and self.step % t.checkpoint_interval == 0) or last or stopping)
                    recs = [rec]
                    if loss is None:  # the gpu: read back only when something is shown or saved
                        unread.append(rec)
                        if not (self.step % t.log_interval == 0 or evaluate or sample or save
                                or self.device_loop.full()):
                            continue
                        recs = self._settle_and_emit(unread, window, metrics, bar, say, flops_per_step,
                                                     peak_gflops, emit=False)
                        unread, window = [], None
                    if evaluate:
                        rec["val_loss"] = self.evaluate()
                    self._emit(recs, metrics, bar, say, flops_per_step, peak_gflops)
                    if sample:
                        say(f"--- sample at step {self.step} ---\n{self.sample_text()}\n---")
                    if save:
                        path = self.save()
                        say(f"checkpoint {path}")
                    if window is None:  # the next gpu window starts after this step's reads and writes
                        window = time.perf_counter()
        except OSError as e:  # disk full, a directory that became unwritable, a vanished mount
            what = f"{e.filename}: " if e.filename else ""
            raise TrainError(f"{what}write failed at step {self.step} ({e.strerror or e}); stopped; "
                             f"{self._last_good()}; free space or fix {self.run_dir}, then --resume") from None
        except DistributedError as e:
            raise TrainError(f"{e}; stopped at step {self.step}; {self._last_good()}; fix the cause, then start "
                             f"every rank again with --resume") from None
        finally:
            try:
                if metrics is not None:
                    metrics.close()
            except OSError:
                pass
            if bar is not None:
                bar.close()
        if dp.is_main:
            plot_losses(self.run_dir)
        return self.step

    def _settle_and_emit(self, unread, window, *emit_args, emit=True):
        """settle() the gpu's unread records and return them; under on_nan stop, write the steps
        before the fault and raise. With emit (called while another exception is on its way up)
        also write them, and let a failure to read lose them: the first error stands."""
        if not unread:
            return []
        try:
            recs = self.settle(unread, window)
        except TrainError as e:
            self._emit(e.records, *emit_args)
            if emit:
                return []
            raise
        except Exception:
            if emit:
                return []
            raise
        if emit:
            self._emit(recs, *emit_args)
        return recs

    def _emit(self, recs, metrics, bar, say, flops_per_step, peak_gflops):
        """Log (every log_interval steps, the last step, and with a val loss) and record steps."""
        t = self.config.train
        for rec in recs:
            if rec["step"] % t.log_interval == 0 or rec["step"] == t.max_steps or "val_loss" in rec:
                say(_format(rec, flops_per_step / rec["ms"] / 1e6, peak_gflops))
            if metrics is not None:
                metrics.write(json.dumps(rec) + "\n")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.4f}")
        if metrics is not None:
            metrics.flush()

    def _last_good(self):
        good = list_checkpoints(self.run_dir)
        return f"the last good checkpoint is {good[-1][1]}" if good else "no checkpoint was completed"


def check_cuda_graph(backend, world_size):
    """ConfigError unless train.cuda_graph can work: the gpu backend, one process, real CUDA."""
    if backend != "gpu":
        raise ConfigError("train.cuda_graph: CUDA graphs replay the gpu backend's step; add --device gpu, "
                          "or drop --train.cuda_graph")
    if world_size > 1:
        raise ConfigError("train.cuda_graph: needs a single process (under torchrun the gradients are "
                          "all-reduced between the kernels, from Python); drop --train.cuda_graph")
    import torch
    from .backends.gpu.common import interpreting
    if interpreting() or not torch.cuda.is_available():
        raise ConfigError("train.cuda_graph: needs CUDA (TRITON_INTERPRET=1 runs the kernels on the CPU, "
                          "where nothing can be captured); drop --train.cuda_graph")


def _read_json(path):
    """A JSON file's contents, or None where it is not valid JSON."""
    try:
        return json.loads(path.read_bytes())
    except ValueError:
        return None


def _write_atomic(path, text):
    """Replace a file whole or not at all (a kill mid-write leaves the old one)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _progress(start, total):
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)


def _format(rec, gflops, peak):
    line = (f"step {rec['step']:>6} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | norm {rec['grad_norm']:.4f} | "
            f"{rec['ms']:7.1f} ms | {rec['tok_per_s']:8,.0f} tok/s | {gflops:6.1f} GFLOP/s")
    if peak:
        line += f" | MFU {100 * gflops / peak:4.1f}%"
    if "val_loss" in rec:
        line += f" | val {rec['val_loss']:.4f}"
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
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(args):
    overrides = {k.split(":", 1)[1]: v for k, v in vars(args).items()
                 if k.startswith("override:") and v is not None}
    run_dir = Path(args.out)
    if args.init_from is not None and args.resume:
        raise TrainError("--init-from starts a new run from pretrained weights; --resume continues one: "
                         "pass only one of them")
    config = resolve_config(run_dir, args.preset, args.config, overrides, args.resume)
    init_from = None
    if args.init_from is not None:
        config, weights = pretrained_config(args.init_from, config, overrides)
        init_from = (args.init_from, weights)
    from .backends.cpu import set_threads
    from .bench import sgemm_peak
    from .distributed import DataParallel, cores_available
    dp = DataParallel(args.device, config.train.dist_timeout)
    threads = config.train.threads or (max(1, cores_available() // dp.local_world_size) if dp.world_size > 1 else 0)
    if threads and args.device == "cpu":
        set_threads(threads)
    trainer = Trainer(args.data, run_dir, config, resume=args.resume, init_from=init_from, dp=dp, backend=args.device)
    peak = None
    if args.device == "cpu":
        peak = float(dp.sum([sgemm_peak()["median_gflops"]])[0])  # every rank measures at once: their sum
        if dp.is_main:
            where = f" over {dp.world_size} ranks (gloo), {threads} threads each" if dp.world_size > 1 else ""
            print(f"sgemm peak (measured now){where}: {peak:.0f} GFLOP/s")
    trainer.run(peak_gflops=peak)
    dp.close()
    if dp.is_main:
        print(f"done: {trainer.step} steps; metrics {run_dir / 'metrics.jsonl'}; loss plot {run_dir / 'loss.png'}")
    return 0
