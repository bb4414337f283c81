"""What the training loop (Trainer.run, training/trainer.py) writes as it goes, and how it stops.

StepLog takes each step's record to the log line, metrics.jsonl, the tracker and the progress bar;
StopFlag turns the first Ctrl-C into a checkpoint and a clean stop after the current step.
"""
import json
import signal
import sys

from .progress import format_step, progress_bar


class StopFlag:
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
    if model.lora is None:  # a padded vocabulary's zero rows are no parameters
        return f"{model.num_params - model.num_padding:,} parameters"
    return f"{model.num_params + model.num_frozen:,} parameters, {model.num_params:,} of them trained"


class StepLog:
    """Each step's record written out: a log line every log_interval steps (and at the first step,
    the last, and with a val loss), and every step to metrics.jsonl, the tracker and the progress
    bar. On rank 0; other ranks only log (their log says nothing)."""

    def __init__(self, run_dir, train, dp, log, tracker, start, flops_per_step, peak_gflops=None, gpu=False):
        """train: the run's train section; log: the run's log; tracker: train.log_to's, or None;
        start: the step the run starts from; flops_per_step and peak_gflops (the sgemm peak of all
        ranks together, or None) give each line its GFLOP/s and MFU; gpu: the first step's line says
        it compiled (Triton compiles or loads each kernel at its first launch)."""
        self.train, self.tracker, self.gpu = train, tracker, gpu
        self.flops_per_step, self.peak_gflops = flops_per_step, peak_gflops
        self.metrics = open(run_dir / "metrics.jsonl", "a") if dp.is_main else None
        self.bar = progress_bar(start, train.max_steps) if dp.is_main else None
        self.say = self.bar.write if self.bar is not None else log  # a line that leaves the bar in place
        self.first_step = start + 1
        self.compiled_steps = set()  # the steps during which Numba compiled a kernel


    def compiled(self, step):
        """Numba compiled a kernel during `step`: its line says so (its time includes compiling)."""
        self.compiled_steps.add(step)


    def write(self, recs):
        """Log (every log_interval steps, the first and last steps, and with a val loss) and record steps."""
        t = self.train
        for rec in recs:
            gflops = self.flops_per_step / rec["ms"] / 1e6
            if self.peak_gflops:
                rec["mfu"] = gflops / self.peak_gflops
            first = rec["step"] == self.first_step
            # its time includes compiling: Numba's where it compiled (a warm cache loads its kernels
            # instead), Triton's on the gpu, which compiles or loads each kernel at its first launch
            compiled = rec["step"] in self.compiled_steps or (first and self.gpu)
            if rec["step"] % t.log_interval == 0 or rec["step"] == t.max_steps or "val_loss" in rec or first:
                self.say(format_step(rec, gflops, self.peak_gflops) + (" (compiling kernels)" if compiled else ""))
            if self.metrics is not None:
                self.metrics.write(json.dumps(rec) + "\n")
            if self.tracker is not None:
                self.tracker.log(rec)
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix(loss=f"{rec['loss']:.4f}")
        if self.metrics is not None:
            self.metrics.flush()
        if self.tracker is not None:
            self.tracker.flush()


    def close(self):
        """Close metrics.jsonl (every write() flushed it: a failure to close loses nothing), the bar, the tracker."""
        try:
            if self.metrics is not None:
                self.metrics.close()
        except OSError:
            pass
        if self.bar is not None:
            self.bar.close()
        if self.tracker is not None:
            self.tracker.close()
