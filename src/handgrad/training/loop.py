"""The training loop: steps until max_steps, with evaluation, samples, checkpoints and logging at
their intervals, a clean stop on Ctrl-C, and failed writes turned into one line naming the last good
checkpoint. On the gpu, losses stay on the device until a step is logged or saved (settle()).

RunLoop is mixed into Trainer (training/trainer.py) and uses its config, dp, model, step,
device_loop, run_dir, log, and its train_step, evaluate, sample_text, save and _numerical_fault.
"""
import json
import math
import signal
import sys
import time

from ..models.lora import lora_flops_per_token
from .distributed import DistributedError
from .progress import format_step, plot_losses, progress_bar
from .rundir import TrainError, last_good


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


def model_size(model):
    """The model's parameters for the log: all of them, and of a LoRA model how many train (the
    adapters and whatever trains beside them) beside its frozen base."""
    if model.lora is None:
        return f"{model.num_params:,} parameters"
    return f"{model.num_params + model.num_frozen:,} parameters, {model.num_params:,} of them trained"


class RunLoop:
    """run() the steps; settle() the gpu's unread losses; write the log and metrics.jsonl."""

    def run(self, peak_gflops=None):
        """Train to max_steps. peak_gflops (the sgemm peak of all ranks together) adds MFU to the log."""
        t, dp = self.config.train, self.dp
        tokens_per_step = t.batch_size * self.config.model.block_size * t.grad_accum_steps * dp.world_size
        T = self.config.model.block_size
        flops_per_step = tokens_per_step * (self.family.flops_per_token(self.gpt_config, T) if self.model.lora is None
                                            else lora_flops_per_token(self.family, self.gpt_config, self.model.lora, T))
        metrics = open(self.run_dir / "metrics.jsonl", "a") if dp.is_main else None
        bar = progress_bar(self.step, t.max_steps) if dp.is_main else None
        say = bar.write if bar is not None else self.log
        self.first_step, self.interrupted = self.step + 1, False
        self.log(f"model: {model_size(self.model)}; {tokens_per_step:,} tokens per step"
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
                        rec.update(self.evaluate_tasks())
                    self._emit(recs, metrics, bar, say, flops_per_step, peak_gflops)
                    if sample:
                        say(f"--- sample at step {self.step} ---\n{self.sample_text()}\n---")
                    if save:
                        path = self.save()
                        say(f"checkpoint {path}")
                    if window is None:  # the next gpu window starts after this step's reads and writes
                        window = time.perf_counter()
            if dp.is_main:
                plot_losses(self.run_dir)
        except OSError as e:  # disk full, a directory that became unwritable, a vanished mount
            what = f"{e.filename}: " if e.filename else ""
            raise TrainError(f"{what}write failed at step {self.step} ({e.strerror or e}); stopped; "
                             f"{last_good(self.run_dir)}; free space or fix {self.run_dir}, then --resume") from None
        except DistributedError as e:
            raise TrainError(f"{e}; stopped at step {self.step}; {last_good(self.run_dir)}; fix the cause, then start "
                             f"every rank again with --resume") from None
        finally:
            try:
                if metrics is not None:
                    metrics.close()
            except OSError:
                pass
            if bar is not None:
                bar.close()
            if self.tracker is not None:
                self.tracker.close()
        self.interrupted = stopping and self.step < t.max_steps  # Ctrl-C: checkpointed, not finished
        return self.step


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
            gflops = flops_per_step / rec["ms"] / 1e6
            if peak_gflops:
                rec["mfu"] = gflops / peak_gflops
            first = rec["step"] == self.first_step  # its time includes Numba's (or Triton's) compiles
            if rec["step"] % t.log_interval == 0 or rec["step"] == t.max_steps or "val_loss" in rec or first:
                say(format_step(rec, gflops, peak_gflops) + (" (compiling kernels)" if first else ""))
            if metrics is not None:
                metrics.write(json.dumps(rec) + "\n")
            if self.tracker is not None:
                self.tracker.log(rec)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.4f}")
        if metrics is not None:
            metrics.flush()
        if self.tracker is not None:
            self.tracker.flush()

