"""Experiment tracking (`train.log_to`): the scalars of metrics.jsonl (loss, val loss, lr, grad
norm, tok/s, MFU, DPO's rewards) also to TensorBoard or Weights & Biases, with the run's config.

TensorBoard event files are written by tensorboardX's EventsWriter (RUN_DIR/tb; `tensorboard --logdir RUN_DIR/tb`);
on resume, events past the checkpoint are purged, as metrics.jsonl's lines are. wandb runs offline
(WANDB_MODE=offline, files under RUN_DIR/wandb, `wandb sync` uploads them) unless WANDB_MODE says
otherwise. Both libraries are optional: asking for one that is not installed is a ConfigError
naming the package to install.
"""
import contextlib
import os
import time

from ..config import ConfigError

SCALARS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "tok_per_s": "perf/tok_per_s", "target_tok_per_s": "perf/target_tok_per_s", "mfu": "perf/mfu"}


DPO_PREFIXES = ("rewards/", "logps/")  # training/dpo.py's METRICS, as TRL names them


def scalars(rec):
    """(tag, value) of every scalar of a metrics record: SCALARS', DPO's rewards/... and logps/... under
    train/ (their val_ twins under val/, as TRL's are under train/ and eval/), then train.eval_tasks'
    eval/TASK/METRIC keys under their own names."""
    out = [(tag, rec[key]) for key, tag in SCALARS.items() if rec.get(key) is not None]
    for key, value in rec.items():
        val = key.startswith("val_")
        if (key[4:] if val else key).startswith(DPO_PREFIXES) and value is not None:
            out.append((f"val/{key[4:]}" if val else f"train/{key}", value))
    return out + [(key, value) for key, value in rec.items() if key.startswith("eval/") and value is not None]


def _require(module, package, log_to):
    try:
        return __import__(module)
    except ImportError:
        raise ConfigError(f"train.log_to {log_to}: needs the {package} package; pip install {package} "
                          f"(or pip install 'handgrad[{log_to}]'), or drop --train.log_to") from None


class TensorBoard:
    """Event files through tensorboardX's synchronous EventsWriter (its SummaryWriter writes from a
    background thread, where a failed write, a full disk, dies as a traceback while the run goes
    on): here a failed write is an OSError in the training loop, which stops in one line."""

    def __init__(self, run_dir, config, step):
        _require("tensorboardX", "tensorboardX", "tensorboard")
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.summary import scalar, text
        self.Event, self.scalar = Event, scalar
        (run_dir / "tb").mkdir(exist_ok=True)
        self.dir = run_dir / "tb"
        with self._naming_the_file():
            self.writer = EventsWriter(str(self.dir / "events"))
        lines = "\n".join(f"{s}.{k} = {v}" for s, d in config.to_dict().items() for k, v in d.items())
        with self._naming_the_file():
            if step:  # resumed: TensorBoard drops this run's events past the checkpoint (as metrics.jsonl's lines)
                self.writer.write_event(Event(wall_time=time.time(), step=step + 1,
                                              session_log=SessionLog(status=SessionLog.START)))
            self.writer.write_event(Event(wall_time=time.time(), step=0,
                                          summary=text("config", f"```\n{lines}\n```")))
            self.writer.flush()

    @contextlib.contextmanager
    def _naming_the_file(self):
        """An OSError from the writer (which names no file) as one naming the event file."""
        try:
            yield
        except OSError as e:
            if e.filename:
                raise
            where = getattr(getattr(self, "writer", None), "_file_name", None) or str(self.dir)
            raise OSError(e.errno, e.strerror or str(e), where) from None

    def log(self, rec):
        with self._naming_the_file():
            for tag, value in scalars(rec):
                self.writer.write_event(self.Event(wall_time=time.time(), step=rec["step"],
                                                   summary=self.scalar(tag, value)))

    def flush(self):
        with self._naming_the_file():
            self.writer.flush()

    def close(self):
        with self._naming_the_file():
            self.writer.close()


class WandB:
    def __init__(self, run_dir, config, step):
        wandb = _require("wandb", "wandb", "wandb")
        os.environ.setdefault("WANDB_MODE", "offline")
        self.wandb = wandb
        self.run = wandb.init(project="handgrad", name=run_dir.name, dir=str(run_dir), config=config.to_dict(),
                              resume="allow" if step else None)

    def log(self, rec):
        self.run.log(dict(scalars(rec)), step=rec["step"])

    def flush(self):
        pass

    def close(self):
        self.run.finish()
        # finish() returns before wandb's service process has written the records to the offline run
        # file (seen: a 7-byte file, header only, in about 1 run of 5); teardown waits for the service
        self.wandb.teardown()


def open_tracker(log_to, run_dir, config, step):
    """The tracker train.log_to asks for, or None."""
    if log_to == "none":
        return None
    return {"tensorboard": TensorBoard, "wandb": WandB}[log_to](run_dir, config, step)
