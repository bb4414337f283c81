"""The gpu backend's training step with no host sync, and its CUDA graphs (`train.cuda_graph`).

The host queues GPU work and runs ahead of it; every value it reads back (a float(loss), the
gradient norm that clipping needs, the NaN check) makes it wait until the GPU has drained the queue.
Trainer.train_step on the cpu reads all three every step; here they stay on the device: the losses
add into a device scalar, one kernel (prepare_update) forms clipping, the NaN/inf check, the learning
rate and AdamW's bias corrections, a step that is not finite is skipped on the device, and each
step's (loss, grad_norm) lands in a device ring that the host reads in one copy when it needs them.
The only host-to-device traffic is the token ids, through page-locked buffers (ops.upload_tokens)
once per micro-batch. With cuda_graph the step is replayed as two or three captured graphs: a few
launches instead of hundreds of kernel launches from Python."""
import contextlib

from ..config import ConfigError
from .step import lr_at


class DeviceLoop:
    """Optimizer steps of `model` (gpu backend, one process) with `opt`, scheduled by the train
    section `t`, starting after `start_step` loop steps (applied or skipped)."""

    HISTORY = 1024  # (loss, grad_norm) slots on the device: the most steps between two reads

    def __init__(self, model, opt, t, start_step, cuda_graph=False):
        import torch

        from ..backends.gpu import HYPER_SIZE, device, update_state
        if model.backend != "gpu":
            raise ValueError(f"DeviceLoop runs the gpu backend's step, got a {model.backend} model")
        if (opt.lo, opt.hi) != (0, model.num_params):
            raise ValueError("DeviceLoop needs the whole optimizer state (one process, no ZeRO shard)")
        self.model, self.opt, self.t = model, opt, t
        self.ops = model.ops
        dev = device()
        self.lr_table = torch.tensor([lr_at(s, t) for s in range(t.max_steps)] or [t.lr], dtype=torch.float32,
                                     device=dev)
        self.state = update_state(self.HISTORY, start_step, opt.t, opt.betas, 1.0 / t.grad_accum_steps,
                                  t.grad_clip, stop=t.on_nan == "stop")
        self.hyper = torch.zeros(HYPER_SIZE, dtype=torch.float32, device=dev)
        self.loss = torch.zeros((), dtype=torch.float64, device=dev)  # this step's mean loss
        self.step_count = start_step  # loop steps queued (the device's count once they have run)
        self.unread = []  # the loop steps (1-based) whose (loss, grad_norm) are still on the device
        self.cuda_graph = cuda_graph
        if cuda_graph:
            check_cuda_graph(model.backend, 1, model.dropout or (model.lora.dropout if model.lora else 0.0))
        self.graphs = None  # after capture: {"first", "more", "update"} and the captured activations
        self.graph_factory = None  # tests swap in a stand-in for torch.cuda.CUDAGraph
        self._eager_steps = 0
        self._stream = None  # cuda_graph: the stream of the warm-up step and of the capture

    # ---------------------------------------------------------------- one step
    def step(self, batches):
        """Queue one optimizer step over the (x, y[, positions]) micro-batches; nothing is read back. Each
        micro-batch's loss is added into a float64 device scalar; prepare_update, one single-program
        kernel, turns global_norm's result into clipping, the NaN/inf check, the learning rate (a
        device table of the schedule, indexed by the device's step count) and AdamW's bias
        corrections, the scalars adamw_update reads. A step whose loss or norm is not finite is
        skipped on the device, AdamW's step count and moments left as they were, as on the cpu;
        with train.on_nan stop every later step is skipped too, until the host reads the fault."""
        if len(batches) != self.t.grad_accum_steps:
            raise ValueError(f"{len(batches)} micro-batches, expected train.grad_accum_steps "
                             f"{self.t.grad_accum_steps}")
        if self.full():
            raise RuntimeError(f"{self.HISTORY} steps unread: call read() first")
        if self.cuda_graph and self.graphs is None and self._eager_steps >= 1:
            self._capture(batches[0])
        if self.graphs is None:
            with self._warmup_stream():
                for i, batch in enumerate(batches):
                    self._micro(self.model.stage(*batch), i)
                self._update()
            self._eager_steps += 1
        else:
            acts = self.graphs["acts"]
            for i, batch in enumerate(batches):
                self.model.stage(*batch, into=acts)
                self.graphs["first" if i == 0 else "more"].replay()
            self.graphs["update"].replay()
        self.step_count += 1
        self.unread.append(self.step_count)

    @contextlib.contextmanager
    def _warmup_stream(self):
        """With cuda_graph, the eager steps run on the stream the capture will use, as torch's docs
        ask: cuBLAS keeps a workspace per stream, made on first use, and that must not happen
        inside the capture."""
        if not self.cuda_graph or self.graph_factory is not None:
            yield
            return
        import torch
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            yield
        torch.cuda.current_stream().wait_stream(self._stream)

    def _micro(self, a, i):
        model = self.model
        if i == 0:
            model.zero_grad()
        # dropout's masks, keyed as on the cpu (training/step.py): the run's seed, this step, micro-batch i
        model.set_training(True, step=self.step_count, micro_step=i, seed=self.t.seed)
        # grad=True, as the host step's forward (training/step.py): a backward follows at once, after
        # the zero_grad above, so a chunked head with a frozen lm_head (LoRA) folds each chunk's
        # gradient into the hidden state's while its logits exist, and never forms them again
        loss = model.forward_staged(a, grad=True)
        model.backward()
        model.set_training(False)
        n = self.t.grad_accum_steps  # the mean over micro-batches, in float64 as on the host
        if i == 0:
            self.loss.copy_(loss).div_(n)
        else:
            self.loss.add_(loss.double().div_(n))

    def _update(self):
        ops, opt = self.ops, self.opt
        norm = ops.global_norm(self.model.flat_grad, opt.chunks)
        self._norm = norm  # kept alive: under capture it lives in the graphs' pool
        # the buffer holds the sum of the micro-batches' gradients: prepare_update scales the norm
        # (and the gradients, through grad_scale) by 1 / grad_accum_steps
        ops.prepare_update(self.hyper, self.state, self.loss, norm, self.lr_table)
        opt.step_on_device(self.hyper)

    def _capture(self, batch):
        """Capture the step's graphs over activations of the batch's shape, holding them (the model
        may move to others, e.g. to sample): two or three graphs sharing a memory pool, the first
        micro-batch (zero_grad, forward, backward writing the weight gradients), further ones
        (backward adding into them; only when grad_accum_steps > 1) and the update (norm,
        prepare_update, AdamW). Later steps stage a micro-batch's tokens into the captured
        activations and replay them. The eager step before has compiled every kernel and
        made every workspace; the activations are filled (tokens staged, gradient buffers made)
        before capture, so nothing in the graphs allocates them or reads garbage."""
        import torch
        make = self.graph_factory or torch.cuda.CUDAGraph
        model = self.model
        a = model.stage(*batch)
        if a.grads is None:
            a.alloc_grads(model.ops, model.config, model._act_dtype())
        graphs = {"acts": a}
        pool = torch.cuda.graph_pool_handle() if self.graph_factory is None else None
        parts = [("first", lambda: self._micro(a, 0)), ("update", self._update)]
        if self.t.grad_accum_steps > 1:
            parts.insert(1, ("more", lambda: self._micro(a, 1)))
        for name, body in parts:
            graphs[name] = g = make()
            if self.graph_factory is None:
                with torch.cuda.graph(g, pool=pool, stream=self._stream):
                    body()
            else:
                g.capture(body)
        self.graphs = graphs

    # ---------------------------------------------------------------- reading back
    def full(self):
        return len(self.unread) >= self.HISTORY

    def read(self):
        """Wait for the queued steps and read their results back in one copy (the host calls it
        when it logs, evaluates, samples or checkpoints, or when the ring is full). Returns ([(step,
        loss, grad_norm)] of the steps not read before, oldest first, NaN or inf where a step was
        skipped for it; whether a fault under train.on_nan stop has frozen the weights). Also brings
        opt.t (AdamW's steps applied) up to date."""
        from ..backends.gpu import adamw as gpu_adamw
        host = self.state.cpu().numpy()
        self.opt.t = int(host[gpu_adamw.APPLIED])
        ring = host[gpu_adamw.STATE_SIZE:].reshape(self.HISTORY, 2)
        out = [(s, float(ring[(s - 1) % self.HISTORY, 0]), float(ring[(s - 1) % self.HISTORY, 1]))
               for s in self.unread]
        self.unread = []
        return out, bool(host[gpu_adamw.FAULT])


def cuda_graph_refusal(backend, world_size, dropout=0.0, objective="cross_entropy"):
    """Why train.cuda_graph cannot work for a run (one line naming the fix), or None where it can: not
    DPO (its step reads each sequence's log-prob back), the gpu backend, one process, no dropout (a
    replayed graph would draw the captured step's masks again), real CUDA."""
    if objective == "dpo":
        return ("train.cuda_graph: a DPO step reads each sequence's log-prob back to the host to form its loss, "
                "which a captured graph cannot; drop --train.cuda_graph")
    if backend != "gpu":
        return "train.cuda_graph: CUDA graphs replay the gpu backend's step; add --device gpu, or drop --train.cuda_graph"
    if world_size > 1:
        return ("train.cuda_graph: needs a single process (under torchrun the gradients are all-reduced between the "
                "kernels, from Python); drop --train.cuda_graph")
    if dropout:
        return ("train.cuda_graph: a captured step would replay its dropout masks every step (model.dropout and "
                "train.lora_dropout draw new ones per step); drop --train.cuda_graph or set the dropout to 0")
    import torch

    from ..backends.gpu.common import interpreting
    if interpreting() or not torch.cuda.is_available():
        return ("train.cuda_graph: needs CUDA (TRITON_INTERPRET=1 runs the kernels on the CPU, where nothing can be "
                "captured); drop --train.cuda_graph")
    return None


def check_cuda_graph(backend, world_size, dropout=0.0):
    """ConfigError where train.cuda_graph cannot work (cuda_graph_refusal)."""
    why = cuda_graph_refusal(backend, world_size, dropout)
    if why:
        raise ConfigError(why)

