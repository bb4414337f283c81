"""What a checkpoint holds of a training run, and how the run comes back from one (exact resume).

Checkpointing is mixed into Trainer (training/trainer.py) and uses its model, opt, dp, config,
step, the two RNGs, run_dir, data_dir, identity and sharded.
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


class Checkpointing:
    """save() a checkpoint of the run; _resume() from the newest intact one."""

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
        state = {"config": self.config.to_dict(), "arch": self.family.arch, "model_config": self.gpt_config.to_dict(),
                 "rng": {"data": self.data_rng.bit_generator.state, "sample": self.sample_rng.bit_generator.state},
                 "data": {"data_dir": str(self.data_dir.resolve()), "identity": self.identity,
                          "batches_drawn": self.step * t.grad_accum_steps},
                 "world_size": self.dp.world_size}
        if self.model.lora is not None:  # what the adapters sit on: model.safetensors holds only what trains
            state.update(lora=self.model.lora.to_dict(), base=self.base_ref)
        path = save_checkpoint(self.run_dir, self.step, self.model, opt, state)
        for old in prune_checkpoints(self.run_dir, t.keep_checkpoints):
            self.log(f"removed checkpoint {old} (train.keep_checkpoints {t.keep_checkpoints})")
        return path


    def _resume(self, identity):
        step, path, state = self._restore_newest_intact()
        if state["data"]["identity"] != identity:
            raise TrainError(f"{self.data_dir}: tokenizer/vocab {identity} differs from the run's "
                             f"{state['data']['identity']}; resume with the data the run was trained on")
        self.step = step
        self.data_rng = make_rng(state["rng"]["data"])
        self.sample_rng = make_rng(state["rng"]["sample"])
        self.dp.agree(step, "the checkpoint step resumed from")
        self.log(f"resumed from {path} at step {step}")


    def _load_base(self, model, ref):
        """A LoRA checkpoint's base weights into the model (interop's load_base checks their digest)."""
        load_base(model, ref)
        self.base_ref = ref

    def _full_optimizer(self):
        """What a checkpoint holds of AdamW: the optimizer itself, or under ZeRO-1 a stand-in with
        full-size moments (filled by save's all-gather or by restore, then sliced)."""
        if not self.sharded:
            return self.opt
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
                state = restore(path, self.model, full, base=self._load_base)
                if full is not self.opt:
                    self.opt.m[:], self.opt.v[:] = full.m[self.opt.lo:self.opt.hi], full.v[self.opt.lo:self.opt.hi]
                return step, path, state
            except CheckpointError as e:
                self.log(f"warning: {e}; falling back to an older checkpoint")
        raise TrainError(f"{self.run_dir}: every checkpoint is damaged ({len(ckpts)} tried); start a new run")

