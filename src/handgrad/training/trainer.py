"""`handgrad train`'s Trainer: one run over a prepared data directory. It builds the run (data,
model, optimizer, checkpoints, run directory), takes one step (train_step, evaluate, sample_text)
and runs the loop (run). The parts it owns live beside it: its checkpoints (Checkpoints) in
training/resume.py, what the loop writes (StepLog) in training/loop.py, the run directory's files
and checks in training/rundir.py."""
import math
import time
from pathlib import Path

import numpy as np

from ..backends import get_backend
from ..backends.cpu.compiles import compile_watch
from ..config import ConfigError
from ..data.chat import CHAT_FILE
from ..data.chat_data import ChatDataset, PreferenceDataset, open_dataset
from ..data.tokenizer import load_tokenizer
from ..files import write_atomic
from ..interop.checkpoint import read_state, resolve
from ..interop.load import fit_weights, load_pretrained, model_sampling, write_generation_config
from ..interop.published import model_ref
from ..models import family_of, get_family
from ..models.decode import generate
from ..models.lora import base_digest, lora_flops_per_token
from ..models.lora_layout import quantized_names
from .device_loop import DeviceLoop, cuda_graph_refusal
from .distributed import DataParallel, DistributedError
from .dpo import DPO, REFERENCE_FILE, load_reference, precompute_reference, save_reference
from .loop import StepLog, StopFlag, model_size
from .memory import check_memory, describe, estimate
from .optim import AdamW
from .progress import plot_losses
from .resume import Checkpoints, make_rng
from .rundir import TrainError, check_data, check_same_data, data_identity, init_run_dir, last_good, lock_run_dir
from .step import accumulate_gradients, lr_at
from .tasks import TaskEval
from .tracking import open_tracker


AUTO_LOSS_CHUNK = 1024  # rows of logits at a time where the whole batch's do not fit (and train.loss_chunk is 0)


class Trainer:
    """One training run over a prepared data directory, writing into run_dir."""

    def __init__(self, data_dir, run_dir, config, resume=False, log=print, init_from=None, dp=None, backend="cpu"):
        """dp: this process's handgrad.training.distributed.DataParallel (several ranks under torchrun);
        only rank 0 logs and writes into run_dir. backend: "cpu" or "gpu"."""
        self.dp = dp if dp is not None else DataParallel()
        self.data_dir, self.run_dir, self.config = Path(data_dir), Path(run_dir), config
        self.log = log if self.dp.is_main else (lambda *a, **k: None)
        # chat data (data/chat_data.py): whole conversations, the loss on assistant tokens only
        self.train_data, self.val_data = open_dataset(data_dir, "train"), open_dataset(data_dir, "val")
        self.counts_targets, self.step_targets = isinstance(self.train_data, ChatDataset), 0
        t = config.train
        self._check_objective(t)
        check_data(config, self.data_dir, self.train_data, self.val_data)
        if resume:
            check_same_data(self.run_dir, self.data_dir, self.train_data)
        self.family = get_family(config.model.arch)
        if init_from is not None and self.train_data.vocab_size > config.model.vocab_size:
            raise TrainError(f"--init-from {init_from[0]}: the model has {config.model.vocab_size} tokens but "
                             f"{self.data_dir} has vocab_size {self.train_data.vocab_size}; prepare the data with "
                             f"the model's tokenizer (handgrad prepare SOURCE --tokenizer {init_from[0]})")
        self.gpt_config = config.gpt_config(self.train_data.vocab_size)  # model.vocab_size may pad the data's
        hs = getattr(self.gpt_config, "head_dim", self.gpt_config.n_embd // self.gpt_config.n_head)
        if backend == "gpu" and (hs < 16 or hs & (hs - 1)):  # the flash-attention kernels' tiles
            what = "model.head_dim" if config.model.head_dim else "model.n_embd / model.n_head"
            raise ConfigError(f"{what} = {hs}: the gpu backend's attention needs a head size "
                              f"that is a power of two >= 16 (16, 32, 64, 128, 256); pick n_head so, or train with "
                              f"--device cpu")
        note = get_backend("cpu").bf16_note() if t.dtype == "bfloat16" and backend == "cpu" else None
        if note:  # a CPU with bf16 multiply, without oneDNN: widened
            self.log(note)
        lora = config.lora_config()  # (an adapter --init-from continues: its own rank and targets)
        adapter = init_from is not None and "adapter" in (init_from[2:] or [{}])[0]
        if adapter:  # continue training a LoRA adapter
            lora = self._adapter_config(init_from[0], lora, init_from[2]["adapter"]["lora"])
        if t.objective == "dpo" and t.dpo_reference == "adapters_off":
            self._check_adapters_off(lora, init_from[0] if adapter else None)
        stored = self._check_base_quant(t, backend, init_from, resume)
        vocab_pad = config.vocab_pad(backend, lora is not None)
        # count what the run will hold before allocating any of it; refuse what cannot fit. Where the
        # whole batch's logits do not fit (a 262,144-token vocabulary's: 4 GiB at B 4, T 1024) and
        # train.loss_chunk is unset, the loss forms them AUTO_LOSS_CHUNK rows at a time instead
        memory, need = None, None
        for chunk in (t.loss_chunk, AUTO_LOSS_CHUNK) if not t.loss_chunk else (t.loss_chunk,):
            memory = estimate(self.family, self.gpt_config, self.rows, config.model.block_size, backend, t.dtype,
                              self.dp.world_size, t.zero_stage if self.dp.world_size > 1 else 0, lora,
                              loss_chunk=chunk, recompute=t.recompute,
                              sample_tokens=t.sample_tokens if t.sample_interval else 0, eval_tasks=bool(t.eval_tasks),
                              stored_bytes=stored, vocab_pad=vocab_pad)
            try:
                need = check_memory(memory, config, backend, processes=self.dp.local_world_size,
                                    vocab_size=self.gpt_config.vocab_size)
            except TrainError as e:
                refusal = e if chunk == t.loss_chunk else refusal  # the run as asked: its refusal names what to lower
                continue
            if chunk != t.loss_chunk:
                t.loss_chunk = chunk
                self.log(f"train.loss_chunk {chunk}: the whole batch's logits ({self.rows} x "
                         f"{config.model.block_size} x {self.gpt_config.vocab_size:,}) do not fit in memory; the loss "
                         f"forms them {chunk} rows at a time")
            break
        else:
            raise refusal
        self.log(f"memory: {describe(memory)} per process" + (f", {need / 2**30:.2f} GiB on this machine"
                                                             if self.dp.local_world_size > 1 else ""))
        self.task_eval = None  # train.eval_tasks, read and tokenized before anything is allocated
        if t.eval_tasks:
            if not t.eval_interval:
                raise ConfigError("train.eval_tasks: scored at each evaluation, and train.eval_interval is 0; set "
                                  "train.eval_interval to the steps between evaluations")
            self.task_eval = TaskEval(t.eval_tasks, t.eval_limit, self.data_dir, self.gpt_config.block_size, backend)
            self.log(self.task_eval.describe())
        # train.cuda_graph: auto captures the step wherever the run allows it; true insists
        why = cuda_graph_refusal(backend, self.dp.world_size, config.model.dropout or (t.lora_rank and t.lora_dropout),
                                 t.objective)
        if t.cuda_graph == "true" and why:
            raise ConfigError(why)
        self.cuda_graph = t.cuda_graph != "false" and why is None
        if backend == "gpu":
            self.log("step: captured as CUDA graphs after one eager step (train.cuda_graph " + t.cuda_graph + ")"
                     if self.cuda_graph else "step: eager, launch by launch (train.cuda_graph " + t.cuda_graph
                     + ("" if why is None or t.cuda_graph == "false" else ": " + why.split(": ", 1)[1].split(";")[0])
                     + ")")
        self.model = self.family.model(self.gpt_config, backend=backend, seed=t.seed,
                                       buffer_multiple=self.dp.world_size, dtype=t.dtype, lora=lora,
                                       dropout=config.model.dropout, loss_chunk=t.loss_chunk, recompute=t.recompute,
                                       vocab_pad=vocab_pad)
        if self.model.head_rows != self.gpt_config.vocab_size:
            self.log(f"vocabulary: {self.gpt_config.vocab_size:,} tokens, the lm_head held as {self.model.head_rows:,} "
                     f"rows (model.vocab_pad {vocab_pad}; checkpoints and exports keep {self.gpt_config.vocab_size:,})")
        self.base_ref = None  # a LoRA run's base model: where it came from and its weights' SHA-256
        # a llama model's context length from --init-from (pretrained_config), which exports give: a
        # RoPE model is not cut to the block_size it trains on
        self.context_length = (init_from[2:] or [{}])[0].get("context_length") if init_from is not None else None
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
        self.interrupted = False  # run() stopped by Ctrl-C before max_steps, with a checkpoint written
        self.device_loop = None  # the gpu's sync-free step (handgrad.training.device_loop), made at the first step
        self.identity = data_identity(self.train_data)
        self.checkpoints = Checkpoints(self.run_dir, self.model, self.opt, self.dp, t.keep_checkpoints,
                                       sharded=self.sharded, log=self.log)
        # rank 0 owns the run directory until it exits (one writer per run; released by the kernel)
        self.lock = lock_run_dir(self.run_dir) if self.dp.is_main else None
        if resume:  # every rank restores the checkpoint itself (the run dir is shared, as the data is)
            self._resume()
        if self.dp.is_main:
            init_run_dir(self.run_dir, self.data_dir, config, self.train_data, self.dp.world_size,
                         resumed_step=self.step if resume else None)
            if (self.data_dir / CHAT_FILE).is_file():  # the chat template, for sample --chat
                write_atomic(self.run_dir / CHAT_FILE, (self.data_dir / CHAT_FILE).read_text(encoding="utf-8"))
            if init_from is not None:  # the model's sampling settings stay the fine-tune's (sample, chat, serve)
                write_generation_config(self.run_dir, model_sampling(init_from[0]))
        self.tracker = open_tracker(t.log_to, self.run_dir, config, self.step) if self.dp.is_main else None
        # every rank starts from rank 0's weights (resumed ones are equal already: checked above)
        self.dp.broadcast(self.model.flat_params)
        self.model.weights_changed()
        self.dpo = None if t.objective != "dpo" else DPO(t.dpo_beta, t.dpo_reference, self._reference(resume))
        if self.sharded:
            full, ours = 8 * self.model.num_params, 8 * (shard[1] - shard[0])
            self.log(f"zero_stage 1: AdamW moments sharded over {self.dp.world_size} ranks: {ours / 2**20:,.1f} MiB "
                     f"per rank instead of {full / 2**20:,.1f} MiB (saves {(full - ours) / 2**20:,.1f} MiB per rank)")


    def _check_objective(self, t):
        """train.objective against the data: dpo takes preference pairs, and preference pairs take dpo.
        Sets self.rows, the rows of a micro-batch's forward: a pair is two."""
        preference = isinstance(self.train_data, PreferenceDataset)
        if t.objective == "dpo" and not preference:
            raise ConfigError(f"train.objective dpo: {self.data_dir} holds no preference pairs; prepare them with "
                              f"handgrad prepare PAIRS.jsonl --format preference --tokenizer MODEL")
        if preference and t.objective != "dpo":
            raise ConfigError(f"{self.data_dir}: preference pairs train with train.objective dpo; pass "
                              f"--train.objective dpo, or prepare --format chat data for supervised fine-tuning")
        self.rows = t.batch_size * (2 if preference else 1)

    def _check_base_quant(self, t, backend, init_from, resume):
        """train.base_quant against the run: the cpu's, and keep over a GGUF base only (--init-from, or
        on resume the base the run recorded). Returns keep's stored bytes of the block matrices (the
        memory count's), else None."""
        if t.base_quant == "none":
            return None
        if backend != "cpu":
            raise ConfigError(f"train.base_quant {t.base_quant}: a quantized base is the cpu backend's; on the gpu "
                              f"train over the base as loaded (train.base_quant none)")
        if t.base_quant != "keep":
            return None
        if init_from is None and resume:  # the recorded base: checked against its digest when restored
            ref = read_state(resolve(self.run_dir)).get("base") or {}
            if "path" in ref:
                init_from = (ref["path"], *load_pretrained(ref["path"], merge=False)[1:])
        info = (init_from[2:] or [{}])[0] if init_from is not None else {}
        if init_from is None or info.get("format") != "gguf" or "adapter" in info:
            what = f"--init-from {init_from[0]} is not a GGUF file" if init_from is not None else "no --init-from"
            raise ConfigError(f"train.base_quant keep: holds a GGUF base's blocks as stored, and {what}; choose "
                              f"train.base_quant q8_0 or q4_0")
        spec = self.family.param_spec(self.gpt_config)
        return sum(init_from[1][n].stored_bytes for n in quantized_names(spec))

    @staticmethod
    def _check_adapters_off(lora, adapter):
        """train.dpo_reference adapters_off takes the base as the reference: only for a LoRA run that
        starts a new adapter (adapter: the --init-from adapter continued, or None) and trains nothing
        of the base."""
        fix = "use train.dpo_reference precompute"
        if lora is None:
            raise ConfigError(f"train.dpo_reference adapters_off: needs a LoRA run (train.lora_rank > 0), whose base "
                              f"is the reference; full fine-tuning: {fix}")
        if adapter is not None:
            raise ConfigError(f"train.dpo_reference adapters_off: --init-from {adapter} is an adapter, so the base "
                              f"without it is not the model the run starts from; {fix} (the reference is then the "
                              f"base with this adapter)")
        if lora.train_norms or lora.train_embeddings:
            which = "train.lora_train_norms" if lora.train_norms else "train.lora_train_embeddings"
            raise ConfigError(f"train.dpo_reference adapters_off: {which} trains base tensors, so the model with its "
                              f"adapters off is no longer the reference; {fix}")

    def _reference(self, resume):
        """DPO's precomputed reference log-probs ({split: (chosen, rejected)}), or None (adapters_off):
        read back on resume, else formed by the model as it starts, before the first step, and kept
        in RUN_DIR/reference_logps.safetensors."""
        t = self.config.train
        if t.dpo_reference != "precompute":
            return None
        path, splits = self.run_dir / REFERENCE_FILE, {"train": self.train_data, "val": self.val_data}
        if resume:
            if not path.is_file():
                raise TrainError(f"{path}: missing; a DPO run keeps its reference log-probs there, and without "
                                 f"them it cannot resume: start the run again with another --out")
            return load_reference(path, splits, self.identity)
        logps = precompute_reference(self.model, splits, t.batch_size, self.config.model.block_size, self.dp,
                                     self.log)
        if self.dp.is_main:
            save_reference(path, logps, self.identity)
        return logps

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


    def _resume(self):
        """Continue from the newest intact checkpoint: its weights and AdamW state (Checkpoints), then
        the run's step, RNG states, LoRA base and context length from its record."""
        step, path, state = self.checkpoints.restore_newest()
        if state["data"]["identity"] != self.identity:
            raise TrainError(f"{self.data_dir}: tokenizer/vocab {self.identity} differs from the run's "
                             f"{state['data']['identity']}; resume with the data the run was trained on")
        self.step = step
        self.context_length = state.get("context_length")
        self.data_rng = make_rng(state["rng"]["data"])
        self.sample_rng = make_rng(state["rng"]["sample"])
        if self.model.lora is not None:  # the base whose weights restore loaded (and checked)
            self.base_ref = state["base"]
        self.dp.agree(step, "the checkpoint step resumed from")
        self.log(f"resumed from {path} at step {step}")


    def save(self):
        """Checkpoint the run at this step (every rank calls it: see Checkpoints.save); its path on
        rank 0, None on other ranks."""
        return self.checkpoints.save(self.step, self._record())


    def _record(self):
        """The run's record in each checkpoint (state.json): what exact resume needs beside the
        weights and moments, and what a LoRA run's adapters sit on."""
        t = self.config.train
        state = {"config": self.config.to_dict(), "arch": self.family.arch, "model_config": self.gpt_config.to_dict(),
                 "rng": {"data": self.data_rng.bit_generator.state, "sample": self.sample_rng.bit_generator.state},
                 "data": {"data_dir": str(self.data_dir.resolve()), "identity": self.identity,
                          "batches_drawn": self.step * t.grad_accum_steps},
                 "world_size": self.dp.world_size}
        if self.model.lora is not None:  # what the adapters sit on: model.safetensors holds only what trains
            state.update(lora=self.model.lora.to_dict(), base=self.base_ref)
        if self.context_length is not None:  # the --init-from model's, for the exports (interop/convert.py)
            state["context_length"] = self.context_length
        return state


    def run(self, peak_gflops=None):
        """Train to max_steps, with evaluation, samples, checkpoints and log lines at their intervals.
        The first Ctrl-C checkpoints and stops after the current step (self.interrupted); a failed
        write or a lost rank stops with one line naming the last good checkpoint. peak_gflops (the
        sgemm peak of all ranks together) adds MFU to the log. On the gpu the losses stay on the
        device until a step is logged or saved (settle). Returns the step reached."""
        t, T, dp = self.config.train, self.config.model.block_size, self.dp
        tokens_per_step = self.rows * T * t.grad_accum_steps * dp.world_size
        flops_per_step = tokens_per_step * (self.family.flops_per_token(self.gpt_config, T) if self.model.lora is None
                                            else lora_flops_per_token(self.family, self.gpt_config, self.model.lora, T))
        steps = StepLog(self.run_dir, t, dp, self.log, self.tracker, self.step, flops_per_step, peak_gflops,
                        gpu=self.model.backend == "gpu")
        self.interrupted = False
        watch = compile_watch()  # counts Numba's compiles, to tag the steps during which it compiled
        self.log(f"model: {model_size(self.model)}; {tokens_per_step:,} tokens per step"
                 f"{f' over {dp.world_size} ranks' if dp.world_size > 1 else ''}; steps {self.step} -> {t.max_steps}")
        if self.dpo is not None:
            self.log(f"data: {self.train_data.num_pairs:,} preference pairs, {t.batch_size} a micro-batch (its chosen "
                     f"and rejected sequences one a row, padded); dpo: beta {t.dpo_beta:g}, reference "
                     f"{'precomputed' if t.dpo_reference == 'precompute' else 'the model with its adapters off'}")
        elif self.counts_targets:
            chat = self.train_data.meta["chat"]
            padding = (chat.get("padding") or {}).get("train")
            self.log(f"data: conversations {chat.get('batches', 'one conversation per row, padded')}"
                     + (f", {padding:.1%} of train positions padding" if padding is not None else ""))
        try:
            with StopFlag() as stop:
                stopping = False
                unread, window = [], time.perf_counter()  # gpu: steps whose loss is still on the device
                while self.step < t.max_steps and not stopping:
                    t0, compiles = time.perf_counter(), watch.count
                    try:
                        loss, norm, lr = self.train_step()
                    except BaseException:  # an OOM, a failed capture, a second Ctrl-C: keep what ran
                        self._settle_and_write(steps, unread, window)
                        raise
                    dt = time.perf_counter() - t0
                    if watch.count > compiles:
                        steps.compiled(self.step)
                    # every rank stops after the same step, if any of them was asked to
                    targets = self.step_targets
                    if dp.world_size > 1:
                        asked, targets = dp.sum([stop.requested, targets])
                        stopping = asked > 0
                    else:
                        stopping = stop.requested
                    rec = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": norm,
                           "tok_per_s": tokens_per_step / dt, "ms": dt * 1e3}
                    if self.counts_targets:  # chat data: the assistant tokens the loss learnt from
                        rec.update(targets=int(targets), target_tok_per_s=targets / dt)
                    if self.dpo is not None:  # the step's rewards, over every rank's pairs
                        rec.update(self.dpo.take_metrics(dp))
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
                        recs = self._settle_and_write(steps, unread, window, write=False)
                        unread, window = [], None
                    if evaluate:
                        rec["val_loss"] = self.evaluate()
                        if self.dpo is not None:
                            rec.update(self.dpo.take_metrics(dp, prefix="val_"))
                        rec.update(self.evaluate_tasks())
                    steps.write(recs)
                    if sample:
                        steps.say(f"--- sample at step {self.step} ---\n{self.sample_text()}\n---")
                    if save:
                        path = self.save()
                        steps.say(f"checkpoint {path}")
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
            steps.close()
        self.interrupted = stopping and self.step < t.max_steps  # Ctrl-C: checkpointed, not finished
        return self.step


    def train_step(self):
        """One optimizer step over grad_accum_steps micro-batches; returns (loss, grad_norm, lr).
        On the gpu with one process loss and grad_norm are None: they stay on the device, and
        settle() reads them (see handgrad.training.device_loop)."""
        t, T, dp = self.config.train, self.config.model.block_size, self.dp
        # one global batch of world_size * batch_size rows per micro-step; this rank reads its rows
        batches = [self.train_data.get_batch(t.batch_size * dp.world_size, T, self.data_rng,
                                             rows=dp.rows(t.batch_size))
                   for _ in range(t.grad_accum_steps)]
        self.step_targets = sum(int(np.count_nonzero(batch[1] >= 0)) for batch in batches)
        lr = lr_at(self.step, t)
        loop = self._device_loop()
        if loop is not None:
            loop.step(batches)
            self.step += 1
            return None, None, lr
        loss, norm, grad_scale = accumulate_gradients(self.model, self.opt, batches, t.grad_clip, dp, t.zero_stage,
                                                      dropout_key=(t.seed, self.step), objective=self.dpo)
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
        if self.model.backend != "gpu" or self.dp.world_size > 1 or self.dpo is not None:
            return None
        if self.device_loop is None:
            self.device_loop = DeviceLoop(self.model, self.opt, self.config.train, self.step,
                                          cuda_graph=self.cuda_graph)
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
            if "targets" in rec:
                rec["target_tok_per_s"] = rec["targets"] / ms * 1e3
            if not (math.isfinite(loss) and math.isfinite(norm)):
                try:
                    # the gradient buffer is that step's only when it is the newest one queued
                    self._numerical_fault(step, loss, locate=step == self.step)
                except TrainError as e:
                    e.records = recs[:i]
                    self.device_loop = None  # its stop flag is set: a later run starts a fresh one
                    raise
        return recs


    def _settle_and_write(self, steps, unread, window, write=True):
        """settle() the gpu's unread records and return them; under on_nan stop, write the steps
        before the fault to `steps` (the StepLog) and raise. With write (called while another
        exception is on its way up) also write them, and let a failure to read lose them: the
        first error stands."""
        if not unread:
            return []
        try:
            recs = self.settle(unread, window)
        except TrainError as e:
            steps.write(e.records)
            if write:
                return []
            raise
        except Exception:
            if write:
                return []
            raise
        if write:
            steps.write(recs)
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


    def evaluate(self):
        """Mean loss over eval_steps validation batches, the same batches at every evaluation (each
        rank takes its rows of every global batch, as in training)."""
        t, T, dp = self.config.train, self.config.model.block_size, self.dp
        rng = make_rng(seed=[t.seed, 3])
        loss = self.model.forward if self.dpo is None else (lambda *batch: self.dpo.loss(self.model, batch))
        losses = [loss(*self.val_data.get_batch(t.batch_size * dp.world_size, T, rng, rows=dp.rows(t.batch_size)))
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

