"""`handgrad train`'s Trainer: one run over a prepared data directory. This file builds the run
(data, model, optimizer, run directory) and holds one step's work (train_step, evaluate,
sample_text); the loop is training/loop.py, checkpoints and resume training/resume.py, the run
directory's files and checks training/rundir.py."""
import math
from pathlib import Path

import numpy as np

from ..backends import get_backend
from ..config import ConfigError
from ..data.chat import CHAT_FILE, open_dataset
from ..data.tokenizer import load_tokenizer
from ..files import write_atomic
from ..interop.load import fit_weights, load_base
from ..interop.published import model_ref
from ..models import family_of, get_family
from ..models.decode import generate
from ..models.lora import base_digest
from .device_loop import DeviceLoop, check_cuda_graph
from .distributed import DataParallel
from .loop import RunLoop
from .memory import check_memory, describe, estimate
from .optim import AdamW
from .resume import Checkpointing, make_rng
from .rundir import TrainError, check_data, check_same_data, data_identity, init_run_dir, lock_run_dir
from .step import accumulate_gradients, lr_at
from .tasks import TaskEval
from .tracking import open_tracker


class Trainer(Checkpointing, RunLoop):
    """One training run over a prepared data directory, writing into run_dir."""

    def __init__(self, data_dir, run_dir, config, resume=False, log=print, init_from=None, dp=None, backend="cpu"):
        """dp: this process's handgrad.training.distributed.DataParallel (several ranks under torchrun);
        only rank 0 logs and writes into run_dir. backend: "cpu" or "gpu"."""
        self.dp = dp if dp is not None else DataParallel()
        self.data_dir, self.run_dir, self.config = Path(data_dir), Path(run_dir), config
        self.log = log if self.dp.is_main else (lambda *a, **k: None)
        # chat data (data/chat.py): whole conversations, the loss on assistant tokens only
        self.train_data, self.val_data = open_dataset(data_dir, "train"), open_dataset(data_dir, "val")
        t = config.train
        check_data(config, self.data_dir, self.train_data, self.val_data)
        if resume:
            check_same_data(self.run_dir, self.data_dir, self.train_data)
        self.family = get_family(config.model.arch)
        if init_from is not None and self.train_data.vocab_size > config.model.vocab_size:
            raise TrainError(f"--init-from {init_from[0]}: the model has {config.model.vocab_size} tokens but "
                             f"{self.data_dir} has vocab_size {self.train_data.vocab_size}; prepare the data with "
                             f"the model's tokenizer (handgrad prepare SOURCE --tokenizer {init_from[0]})")
        self.gpt_config = config.gpt_config(self.train_data.vocab_size)  # model.vocab_size may pad the data's
        hs = self.gpt_config.n_embd // self.gpt_config.n_head
        if backend == "gpu" and (hs < 16 or hs & (hs - 1)):  # the flash-attention kernels' tiles
            raise ConfigError(f"model.n_embd / model.n_head = {hs}: the gpu backend's attention needs a head size "
                              f"that is a power of two >= 16 (16, 32, 64, 128, 256); pick n_head so, or train with "
                              f"--device cpu")
        note = get_backend("cpu").bf16_note() if t.dtype == "bfloat16" and backend == "cpu" else None
        if note:  # a CPU with bf16 multiply, without oneDNN: widened
            self.log(note)
        # count what the run will hold before allocating any of it; refuse what cannot fit
        memory = estimate(self.family, self.gpt_config, t.batch_size, config.model.block_size, backend, t.dtype,
                          self.dp.world_size, t.zero_stage if self.dp.world_size > 1 else 0, config.lora_config(),
                          loss_chunk=t.loss_chunk, recompute=t.recompute,
                          sample_tokens=t.sample_tokens if t.sample_interval else 0, eval_tasks=bool(t.eval_tasks))
        need = check_memory(memory, config, backend, processes=self.dp.local_world_size,
                            vocab_size=self.gpt_config.vocab_size)
        self.log(f"memory: {describe(memory)} per process" + (f", {need / 2**30:.2f} GiB on this machine"
                                                             if self.dp.local_world_size > 1 else ""))
        self.task_eval = None  # train.eval_tasks, read and tokenized before anything is allocated
        if t.eval_tasks:
            if not t.eval_interval:
                raise ConfigError("train.eval_tasks: scored at each evaluation, and train.eval_interval is 0; set "
                                  "train.eval_interval to the steps between evaluations")
            self.task_eval = TaskEval(t.eval_tasks, t.eval_limit, self.data_dir, self.gpt_config.block_size, backend)
            self.log(self.task_eval.describe())
        if t.cuda_graph:
            check_cuda_graph(backend, self.dp.world_size, config.model.dropout or (t.lora_rank and t.lora_dropout))
        lora = config.lora_config()
        if init_from is not None and "adapter" in (init_from[2:] or [{}])[0]:  # continue training a LoRA adapter
            lora = self._adapter_config(init_from[0], lora, init_from[2]["adapter"]["lora"])
        self.model = self.family.model(self.gpt_config, backend=backend, seed=t.seed,
                                       buffer_multiple=self.dp.world_size, dtype=t.dtype, lora=lora,
                                       dropout=config.model.dropout, loss_chunk=t.loss_chunk, recompute=t.recompute)
        self.base_ref = None  # a LoRA run's base model: where it came from and its weights' SHA-256
        if init_from is not None:
            self._load_pretrained(*init_from)
        if lora is not None:
            self.base_ref = self.base_ref or {"init": "random", "seed": t.seed, "sha256": base_digest(self.model)}
            self.log(f"LoRA: rank {lora.rank}, alpha {lora.alpha:g}, on {','.join(lora.targets)}"
                     + (f", dropout {lora.dropout:g}" if lora.dropout else "") + f"; {self.model.num_params:,} "
                     f"parameters train, {self.model.num_frozen:,} frozen")
        # ZeRO stage 1: this rank keeps AdamW moments for its slice of the flat buffer only
        self.sharded = t.zero_stage == 1 and self.dp.world_size > 1
        shard = self.dp.shard(len(self.model.flat_params)) if self.sharded else None
        self.opt = AdamW(self.model, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay, shard=shard)
        self.data_rng, self.sample_rng = make_rng(seed=[t.seed, 1]), make_rng(seed=[t.seed, 2])
        self.step = 0
        self.device_loop = None  # the gpu's sync-free step (handgrad.training.device_loop), made at the first step
        self.identity = data_identity(self.train_data)
        # rank 0 owns the run directory until it exits (one writer per run; released by the kernel)
        self.lock = lock_run_dir(self.run_dir) if self.dp.is_main else None
        if resume:  # every rank restores the checkpoint itself (the run dir is shared, as the data is)
            self._resume(self.identity)
        if self.dp.is_main:
            init_run_dir(self.run_dir, self.data_dir, config, self.train_data, self.dp.world_size,
                         resumed_step=self.step if resume else None)
            if (self.data_dir / CHAT_FILE).is_file():  # the chat template, for sample --chat
                write_atomic(self.run_dir / CHAT_FILE, (self.data_dir / CHAT_FILE).read_text(encoding="utf-8"))
        self.tracker = open_tracker(t.log_to, self.run_dir, config, self.step) if self.dp.is_main else None
        # every rank starts from rank 0's weights (resumed ones are equal already: checked above)
        self.dp.broadcast(self.model.flat_params)
        self.model.weights_changed()
        if self.sharded:
            full, ours = 8 * self.model.num_params, 8 * (shard[1] - shard[0])
            self.log(f"zero_stage 1: AdamW moments sharded over {self.dp.world_size} ranks: {ours / 2**20:,.1f} MiB "
                     f"per rank instead of {full / 2**20:,.1f} MiB (saves {(full - ours) / 2**20:,.1f} MiB per rank)")


    def _adapter_config(self, path, asked, found):
        """--init-from an adapter: train it on with its own rank, alpha, targets and trained norms or
        embeddings (a train.lora_* that disagrees is an error), recorded in the run's config; its
        dropout may be the run's."""
        if asked is not None and (asked.rank, asked.alpha, asked.targets) != (found.rank, found.alpha, found.targets):
            raise ConfigError(f"--init-from {path}: a LoRA adapter of rank {found.rank}, alpha {found.alpha:g} on "
                              f"{','.join(found.targets)}; train.lora_* asks for rank {asked.rank}, alpha "
                              f"{asked.alpha:g} on {','.join(asked.targets)}: drop those keys to train the adapter on")
        t = self.config.train
        t.lora_rank, t.lora_alpha, t.lora_targets = found.rank, found.alpha, ",".join(found.targets)
        t.lora_train_norms, t.lora_train_embeddings = found.train_norms, found.train_embeddings
        return self.config.lora_config()

    def _load_pretrained(self, path, weights, info=None):
        """Pretrained weights (from pretrained_config) into the fresh model, cut to its block_size
        (fit_weights). A LoRA run records its base (path and digest), then takes an adapter's tensors."""
        weights = fit_weights(weights, self.gpt_config)
        if self.model.lora is None:
            self.model.load_state_dict(weights)
        else:
            self.model.load_state_dict(weights, names=self.model.base_names)
            adapter = (info or {}).get("adapter")
            self.base_ref = {"path": adapter["base"]["path"] if adapter and "path" in adapter["base"]
                             else model_ref(path), "sha256": base_digest(self.model)}
            if adapter:
                self.model.load_state_dict(adapter["tensors"], names=list(adapter["tensors"]))
        c = self.gpt_config
        self.log(f"initialised from {path}: {family_of(c).arch}, n_layer {c.n_layer}, n_head {c.n_head}, "
                 f"n_embd {c.n_embd}, block_size {c.block_size}, vocab_size {c.vocab_size}"
                 + (f" (the data's {self.train_data.vocab_size} ids and {c.vocab_size - self.train_data.vocab_size} "
                    f"rows of padding)" if c.vocab_size > self.train_data.vocab_size else ""))


    def train_step(self):
        """One optimizer step over grad_accum_steps micro-batches; returns (loss, grad_norm, lr).
        On the gpu with one process loss and grad_norm are None: they stay on the device, and
        settle() reads them (see handgrad.training.device_loop)."""
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
        loss, norm, grad_scale = accumulate_gradients(self.model, self.opt, batches, t.grad_clip, dp, t.zero_stage,
                                                      dropout_key=(t.seed, self.step))
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
            self.device_loop = DeviceLoop(self.model, self.opt, self.config.train, self.step,
                                          cuda_graph=self.config.train.cuda_graph)
        return self.device_loop


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


    def evaluate(self):
        """Mean loss over eval_steps validation batches, the same batches at every evaluation (each
        rank takes its rows of every global batch, as in training)."""
        t, T, dp = self.config.train, self.config.model.block_size, self.dp
        rng = make_rng(seed=[t.seed, 3])
        losses = [self.model.forward(*self.val_data.get_batch(t.batch_size * dp.world_size, T, rng,
                                                              rows=dp.rows(t.batch_size)))
                  for _ in range(t.eval_steps)]
        return float(dp.sum([np.mean(losses)])[0]) / dp.world_size

    def evaluate_tasks(self):
        """train.eval_tasks' metrics for the model as it stands (rank 0 alone; {} elsewhere)."""
        if self.task_eval is None or not self.dp.is_main:
            return {}
        return self.task_eval.score(self.model)


    def sample_text(self):
        tok = load_tokenizer(self.run_dir)
        start = [tok.eot_id] if tok.eot_id is not None else tok.encode("\n")
        ids = generate(self.model, np.array([start]), self.config.train.sample_tokens,
                       temperature=1.0, top_k=None, rng=self.sample_rng, vocab=tok.vocab_size)
        return tok.decode(ids[0, len(start):].tolist())

