"""A training run's checkpoints: writing one, and restoring the newest intact one (exact resume).

Checkpoints reads and writes the weights and AdamW state of the model and optimizer it is given; the
run's record beside them (config, RNG states, data, a LoRA run's base) is the Trainer's
(training/trainer.py), which hands it to save() and applies what a resume reads back.
"""
from types import SimpleNamespace

import numpy as np

from ..interop.checkpoint import CheckpointError, list_checkpoints, prune_checkpoints, restore, save_checkpoint
from ..interop.load import load_base
from .rundir import TrainError


def make_rng(state=None, seed=None):
    """A PCG64 generator from a seed, or restored to a saved bit_generator.state."""
    rng = np.random.Generator(np.random.PCG64(seed))
    if state is not None:
        rng.bit_generator.state = state
    return rng


class Checkpoints:
    """The checkpoints in run_dir: save() one, restore_newest() the newest that passes its checksums."""

    def __init__(self, run_dir, model, opt, dp, keep, sharded=False, log=print):
        """model, opt: whose weights and AdamW state each checkpoint holds; dp: this process's
        DataParallel (rank 0 writes); keep: train.keep_checkpoints, how many stay after a save;
        sharded: ZeRO-1, where opt holds this rank's slice of the moments only."""
        self.run_dir, self.model, self.opt, self.dp = run_dir, model, opt, dp
        self.sharded, self.keep, self.log = sharded, keep, log


    def save(self, step, state):
        """Write step's checkpoint with `state` (the run's record, state.json) and prune the oldest
        beyond keep: rank 0 writes, and under ZeRO-1 every rank first all-gathers the moments.
        Returns its path, None on other ranks."""
        opt = self._full_optimizer()
        if opt is not self.opt:
            self.dp.gather(self.opt.m, opt.m)
            self.dp.gather(self.opt.v, opt.v)
        if not self.dp.is_main:
            return None
        path = save_checkpoint(self.run_dir, step, self.model, opt, state)
        for old in prune_checkpoints(self.run_dir, self.keep):
            self.log(f"removed checkpoint {old} (train.keep_checkpoints {self.keep})")
        return path


    def restore_newest(self):
        """Restore the newest checkpoint that passes its checksums into the model and optimizer (a
        LoRA checkpoint's base weights first, their digest checked), saying which ones were skipped.
        Returns (step, path, state)."""
        ckpts = list_checkpoints(self.run_dir)
        if not ckpts:
            raise TrainError(f"{self.run_dir}: no complete checkpoint to resume from")
        for step, path in reversed(ckpts):
            try:
                full = self._full_optimizer()
                state = restore(path, self.model, full, base=load_base)
                if full is not self.opt:
                    self.opt.m[:], self.opt.v[:] = full.m[self.opt.lo:self.opt.hi], full.v[self.opt.lo:self.opt.hi]
                return step, path, state
            except CheckpointError as e:
                self.log(f"warning: {e}; falling back to an older checkpoint")
        raise TrainError(f"{self.run_dir}: every checkpoint is damaged ({len(ckpts)} tried); start a new run")


    def _full_optimizer(self):
        """What a checkpoint holds of AdamW: the optimizer itself, or under ZeRO-1 a stand-in with
        full-size moments (filled by save's all-gather or by restore, then sliced)."""
        if not self.sharded:
            return self.opt
        n, ops = len(self.model.flat_params), self.model.ops
        return SimpleNamespace(m=ops.zeros((n,)), v=ops.zeros((n,)), state=self.opt.state,
                               load_state=self.opt.load_state)
