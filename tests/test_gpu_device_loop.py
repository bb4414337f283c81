"""The gpu's training step with no host sync (handgrad.training.device_loop) and its CUDA graphs.

- prepare_update + adamw_update(hyper=...) give the host path's update bit for bit, through
  clipping, accumulation and NaN steps (skip and stop);
- DeviceLoop's steps equal accumulate_gradients + AdamW.step, and read nothing back from the device;
- the graph replay path stages into the captured activations (a stand-in for torch.cuda.CUDAGraph
  without CUDA; the real thing, under torch's sync debug mode, with CUDA);
- `handgrad train --device gpu` reads the device only when it logs, and handles NaN steps as the
  cpu does.
Without CUDA this runs in Triton's interpreter at tiny sizes."""
import json
import math

import numpy as np
import pytest
import torch
from gpu_helpers import DEVICE, REAL_GPU

from handgrad import GPT, GPTConfig
from handgrad.interop.checkpoint import list_checkpoints
from handgrad.backends.gpu import adamw as gpu_adamw
from handgrad.config import ConfigError, LoRAConfig, load_run_config
from handgrad.training.device_loop import DeviceLoop
from handgrad.training.optim import AdamW
from handgrad.training.trainer import Trainer
from handgrad.training.step import accumulate_gradients, lr_at
from helpers import prepared_char_data

TINY = GPTConfig(block_size=8, vocab_size=37, n_layer=1, n_head=2, n_embd=32)


@pytest.mark.parametrize("stop, max_norm, accum", [(False, 1.0, 2), (True, 0.0, 1)], ids=["skip-clip", "stop"])
def test_prepare_update_gives_the_host_update_bit_for_bit(stop, max_norm, accum):
    """Six steps, the fourth with a NaN gradient: the device decides lr (from the table), clipping,
    the bias corrections and the skip; params and moments equal the host path's exactly."""
    N = 20000
    chunks = gpu_adamw.make_chunks([(0, 15000, True), (15000, N, False)])
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(N, generator=gen).to(DEVICE)
    host = [p0.clone(), torch.zeros(N, device=DEVICE), torch.zeros(N, device=DEVICE)]
    dev = [p0.clone(), torch.zeros(N, device=DEVICE), torch.zeros(N, device=DEVICE)]
    lrs = [1e-3 * (i + 1) / 3 for i in range(6)]
    table = torch.tensor(lrs, dtype=torch.float32, device=DEVICE)
    mean = 1.0 / accum
    state = gpu_adamw.update_state(8, 0, 0, (0.9, 0.95), mean, max_norm, stop=stop)
    hyper = torch.empty(gpu_adamw.HYPER_SIZE, device=DEVICE)
    t, faulted = 0, False
    for k in range(6):
        g = (torch.randn(N, generator=gen) * (3.0 if k % 2 else 0.1)).to(DEVICE)
        if k == 3:
            g[7] = float("nan")
        loss = torch.tensor(2.5 + k, dtype=torch.float64, device=DEVICE)
        norm = gpu_adamw.global_norm(g, chunks)
        gpu_adamw.prepare_update(hyper, state, loss, norm, table)
        gpu_adamw.adamw_update(*dev[:1], g, *dev[1:], chunks, None, None, 0.9, 0.95, 1e-8, 0.1, hyper=hyper)
        n = float(norm) * mean  # the host path (Trainer.train_step)
        faulted = faulted or (stop and not math.isfinite(n))
        if math.isfinite(n) and not faulted:
            t += 1
            clip = min(1.0, max_norm / (n + 1e-6)) if max_norm > 0 else 1.0
            gpu_adamw.adamw_update(*host[:1], g, *host[1:], chunks, t, lrs[k], 0.9, 0.95, 1e-8, 0.1, mean * clip)
        assert hyper[4].item() == float(math.isfinite(n) and not faulted)
        for name, a, b in zip(("params", "m", "v"), host, dev):
            assert torch.equal(a, b), f"step {k + 1}: {name} differ from the host path's"
    s = state.cpu().numpy()
    assert s[gpu_adamw.STEP] == 6 and s[gpu_adamw.APPLIED] == t == (3 if stop else 5)
    assert s[gpu_adamw.FAULT] == float(stop)
    ring = s[gpu_adamw.STATE_SIZE:].reshape(-1, 2)
    assert ring[:6, 0].tolist() == [2.5 + k for k in range(6)] and np.isnan(ring[3, 1])


def test_hyper_is_checked():
    with pytest.raises(ValueError, match="hyper must be prepare_update's float32 tensor of 5"):
        x = torch.zeros(4, device=DEVICE)
        gpu_adamw.adamw_update(x, x, x, x, gpu_adamw.make_chunks([(0, 4, True)]), None, None,
                               hyper=torch.zeros(3, device=DEVICE))


def _batches(seed, n, B=2, T=8, V=37):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))) for _ in range(n)]


def _train_section(**kw):
    t = load_run_config("tiny", overrides={"train.max_steps": 5, "train.warmup_steps": 2, "train.lr": 3e-3,
                                           **{f"train.{k}": v for k, v in kw.items()}}).train
    return t


class _NoReads:
    """Fails the test on any read of a device value into the host: float(), int(), bool(), .item(),
    .tolist(), .numpy() and the backend's to_numpy. (Not .cpu(): the interpreter itself calls it.)"""

    def __init__(self, monkeypatch, model):
        def refuse(*a, **k):
            raise AssertionError("the device loop read a value back from the device")
        self.undo = [(torch.Tensor, n, getattr(torch.Tensor, n))
                     for n in ("__float__", "__int__", "__bool__", "item", "tolist", "numpy")]
        self.undo.append((model.ops, "to_numpy", model.ops.to_numpy))
        self.mp, self.refuse = monkeypatch, refuse

    def __enter__(self):
        for owner, name, _ in self.undo:
            self.mp.setattr(owner, name, self.refuse)

    def __exit__(self, *exc):
        for owner, name, real in self.undo:
            setattr(owner, name, real)


@pytest.mark.parametrize("accum", [1, 2])
def test_device_loop_equals_the_host_step_and_reads_nothing(accum, monkeypatch):
    t = _train_section(grad_accum_steps=accum, grad_clip=0.05)
    host, dev = GPT(TINY, backend="gpu", seed=3), GPT(TINY, backend="gpu", seed=3)
    host_opt, dev_opt = (AdamW(m, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
                         for m in (host, dev))
    loop = DeviceLoop(dev, dev_opt, t, start_step=0)
    losses = []
    for step in range(3):
        batches = _batches(step, accum)
        loss, norm, scale = accumulate_gradients(host, host_opt, batches, t.grad_clip)
        host_opt.step(lr=lr_at(step, t), grad_scale=scale)
        losses.append((step + 1, loss, norm))
        with _NoReads(monkeypatch, dev):
            loop.step(batches)
    got, faulted = loop.read()
    assert not faulted and dev_opt.t == host_opt.t == 3
    assert [s for s, _, _ in got] == [1, 2, 3]
    np.testing.assert_allclose([x[1:] for x in got], [x[1:] for x in losses], rtol=1e-12)
    assert torch.equal(dev.flat_params, host.flat_params), "weights differ from the host path's"
    assert torch.equal(dev_opt.v, host_opt.v)
    assert loop.read() == ([], False)


def test_device_loop_forms_a_frozen_chunked_heads_logits_once(monkeypatch):
    """With LoRA (the lm_head frozen) and a chunked loss, a training forward folds each chunk's
    gradient into the hidden state's while the chunk's logits exist (models/head.py), so the backward
    does not form them again. The device loop's step does so too, as the host step does: the same
    number of head products, and the same weights."""
    t = _train_section()
    V, chunk = TINY.vocab_size, 5  # 2 * 8 rows in chunks of 5, the last short
    lora = LoRAConfig(rank=4, alpha=8.0, targets=tuple(GPT.LORA_MODULES))
    host, dev = (GPT(TINY, backend="gpu", seed=3, lora=lora, loss_chunk=chunk) for _ in range(2))
    host_opt, dev_opt = (AdamW(m, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
                         for m in (host, dev))
    loop = DeviceLoop(dev, dev_opt, t, start_step=0)
    heads = []  # the products that form logits (out: (1, rows, V)), by which path formed them
    real = host.ops.linear_forward

    def counted(out, *args, **kw):
        if out.shape[-1] == V:
            heads.append(path)
        return real(out, *args, **kw)
    monkeypatch.setattr(host.ops, "linear_forward", counted)
    batches = _batches(0, 1)
    path = "host"
    accumulate_gradients(host, host_opt, batches, t.grad_clip)
    host_opt.step(lr=lr_at(0, t))
    path = "device"
    loop.step(batches)
    loop.read()
    assert heads.count("host") == heads.count("device") == 4  # ceil(16 / 5) chunks, each once
    assert torch.equal(dev.flat_params, host.flat_params), "weights differ from the host path's"


class _StandInGraph:
    """torch.cuda.CUDAGraph's interface without CUDA: capture records the body (and, like a real
    capture, must not read the device); replay runs it again."""

    def __init__(self, no_reads):
        self.no_reads, self.body = no_reads, None

    def capture(self, body):
        with self.no_reads:
            body()  # a real capture only records; running it here costs one extra pass, undone below
        self.body = body

    def replay(self):
        self.body()


def test_graph_path_stages_into_the_captured_activations(monkeypatch):
    """cuda_graph's structure without CUDA: capture after one eager step, then every step stages its
    micro-batches into the captured activations and replays first/more/update; the weights follow
    the eager loop's exactly, even after a forward of another shape reallocated the model's
    activations in between (as sampling does)."""
    t = _train_section(grad_accum_steps=2)
    eager, graphed = GPT(TINY, backend="gpu", seed=4), GPT(TINY, backend="gpu", seed=4)
    opts = [AdamW(m, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay) for m in (eager, graphed)]
    ref = DeviceLoop(eager, opts[0], t, 0)
    loop = DeviceLoop(graphed, opts[1], t, 0)
    loop.cuda_graph = True
    loop.graph_factory = lambda: _StandInGraph(_NoReads(monkeypatch, graphed))
    snapshot = {}

    def capture_without_side_effects(batch, real=loop._capture):
        # the stand-in runs each body once while capturing; put the state back as a real capture leaves it
        snapshot.update(p=graphed.flat_params.clone(), m=opts[1].m.clone(), v=opts[1].v.clone(),
                        s=loop.state.clone())
        real(batch)
        graphed.flat_params.copy_(snapshot["p"]), opts[1].m.copy_(snapshot["m"])
        opts[1].v.copy_(snapshot["v"]), loop.state.copy_(snapshot["s"])
    loop._capture = capture_without_side_effects
    for step in range(3):
        batches = _batches(10 + step, 2)
        ref.step(batches)
        loop.step(batches)
        assert (loop.graphs is not None) == (step >= 1)
        graphed.forward(np.zeros((1, 3), np.int64))  # another shape: the model's activations move
    assert set(loop.graphs) == {"acts", "first", "more", "update"}
    assert loop.read() == ref.read()
    assert torch.equal(graphed.flat_params, eager.flat_params)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    text = "".join(f"Full fathom five thy father lies {i}; of his bones are coral made.\n" for i in range(150))
    return prepared_char_data(tmp_path_factory.mktemp("loop_corpus"), text)


def _config(**train):
    return load_run_config("tiny", overrides={"model.n_layer": 1, "model.n_embd": 32, "model.block_size": 8,
                                              "train.batch_size": 2, "train.eval_interval": 0,
                                              "train.sample_interval": 0, "train.checkpoint_interval": 0,
                                              **{f"train.{k}": v for k, v in train.items()}})


def test_cuda_graph_config_errors(data_dir, tmp_path):
    config = _config(cuda_graph="true")
    with pytest.raises(ConfigError, match="train.cuda_graph: CUDA graphs replay the gpu backend's step"):
        Trainer(data_dir, tmp_path / "r1", config)
    if not REAL_GPU:
        with pytest.raises(ConfigError, match="train.cuda_graph: needs CUDA"):
            Trainer(data_dir, tmp_path / "r2", config, backend="gpu")
    with pytest.raises(ConfigError, match="train.cuda_graph: must be one of auto, true, false, got 'maybe'"):
        _config(cuda_graph="maybe")
    assert _config(cuda_graph="yes").train.cuda_graph == "true" and _config(cuda_graph=False).train.cuda_graph == "false"


@pytest.mark.parametrize("word", ["auto", "false"])
def test_cuda_graph_auto_wherever_the_run_allows_and_the_log_says_which(data_dir, tmp_path, word):
    """auto (the default) captures the gpu step wherever cuda_graph_refusal finds nothing against it, and
    runs it eagerly elsewhere (here without CUDA: the interpreter), saying which in the log; false never."""
    lines = []
    trainer = Trainer(data_dir, tmp_path / word, _config(cuda_graph=word), backend="gpu", log=lambda m, **k: lines.append(m))
    graphs = word == "auto" and REAL_GPU
    assert trainer.cuda_graph is graphs
    said = [ln for ln in lines if ln.startswith("step: ")]
    if graphs:
        assert said == ["step: captured as CUDA graphs after one eager step (train.cuda_graph auto)"]
    elif word == "auto":
        assert said == ["step: eager, launch by launch (train.cuda_graph auto: needs CUDA (TRITON_INTERPRET=1 runs "
                        "the kernels on the CPU, where nothing can be captured))"], said
    else:
        assert said == ["step: eager, launch by launch (train.cuda_graph false)"]
    cpu_lines = []
    assert Trainer(data_dir, tmp_path / f"{word}_cpu", _config(cuda_graph=word), log=lambda m, **k: cpu_lines.append(m)).cuda_graph is False
    assert not any(ln.startswith("step: ") for ln in cpu_lines)


def _poison(monkeypatch, at_call):
    """NaN into a weight before the at_call-th forward with targets (1-based)."""
    real = GPT.forward_staged
    calls = {"n": 0}

    def forward_staged(self, a, **kw):
        calls["n"] += 1
        if calls["n"] == at_call:
            self.p["h.0.mlp.c_fc.bias"][0] = float("nan")
        return real(self, a, **kw)
    monkeypatch.setattr(GPT, "forward_staged", forward_staged)


def test_train_reads_the_device_only_when_it_logs(data_dir, tmp_path, monkeypatch):
    """log_interval 3 over 7 steps: reads after steps 3, 6 and 7 (the last), and metrics.jsonl
    still has every step's loss and grad_norm, equal to a log-every-step run's."""
    reads = []
    real = DeviceLoop.read
    monkeypatch.setattr(DeviceLoop, "read", lambda self: reads.append(self.step_count) or real(self))
    runs = {}
    for interval in (3, 1):
        reads.clear()
        trainer = Trainer(data_dir, tmp_path / f"every{interval}", _config(max_steps=7, log_interval=interval),
                          log=lambda *a: None, backend="gpu")
        trainer.run()
        runs[interval] = [json.loads(ln) for ln in (tmp_path / f"every{interval}" / "metrics.jsonl").open()]
        assert reads == ([3, 6, 7] if interval == 3 else list(range(1, 8)))
    assert [r["step"] for r in runs[3]] == list(range(1, 8))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in runs[3]] == [r[key] for r in runs[1]], key
    assert all(r["ms"] > 0 and r["tok_per_s"] > 0 for r in runs[3])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf - inf
def test_train_nan_skip_and_stop_on_the_device(data_dir, tmp_path, monkeypatch, capsys):
    """skip: the poisoned step and every later one (the NaN weight stays) are skipped on the device,
    AdamW's step count stays at the steps applied. stop: the run stops at the poisoned step,
    naming it, with the earlier steps' metrics written and no update applied after it."""
    _poison(monkeypatch, at_call=3)
    trainer = Trainer(data_dir, tmp_path / "skip", _config(max_steps=5, log_interval=5, on_nan="skip"),
                      backend="gpu")
    trainer.run()
    out = capsys.readouterr().out
    assert "step 3: the loss is not finite" in out and "batch skipped" in out and "step 5: the loss" in out
    assert trainer.opt.t == 2
    recs = [json.loads(ln) for ln in (tmp_path / "skip" / "metrics.jsonl").open()]
    assert [math.isfinite(r["loss"]) for r in recs] == [True, True, False, False, False]

    _poison(monkeypatch, at_call=2)
    run = tmp_path / "stop"
    trainer = Trainer(data_dir, run, _config(max_steps=5, log_interval=4), backend="gpu")
    from handgrad.training.rundir import TrainError
    with pytest.raises(TrainError, match=r"step 2: the loss is not finite .*not located .*stopped before"):
        trainer.run()
    assert [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").open()] == [1]
    assert trainer.opt.t == 1 and list_checkpoints(run) == []
    assert trainer.device_loop is None  # its stop flag was set: a later run() starts a fresh loop


def test_train_keeps_the_unread_steps_when_a_step_fails(data_dir, tmp_path, monkeypatch):
    """A failure inside a step (an OOM, a failed capture, a second Ctrl-C) still writes the steps
    that ran before it but were not read yet, then lets the error through."""
    real = DeviceLoop.step

    def step(self, batches):
        if self.step_count == 3:
            raise MemoryError("out of memory (simulated)")
        return real(self, batches)
    monkeypatch.setattr(DeviceLoop, "step", step)
    run = tmp_path / "oom"
    trainer = Trainer(data_dir, run, _config(max_steps=6, log_interval=5), log=lambda *a: None, backend="gpu")
    with pytest.raises(MemoryError, match="simulated"):
        trainer.run()
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").open()]
    assert [r["step"] for r in recs] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in recs)


@pytest.mark.skipif(not REAL_GPU, reason="CUDA graphs and torch's sync debug mode need a real GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_on_a_gpu_matches_eager_without_a_sync(dtype):
    """GPT-2 small's widths at B 4, T 256, two micro-batches: eager and cuda_graph loops give the same
    weights, and no step synchronises with the host (torch.cuda.set_sync_debug_mode('error'))."""
    config = GPTConfig(block_size=256, vocab_size=50257, n_layer=4, n_head=12, n_embd=768)
    t = _train_section(grad_accum_steps=2, max_steps=6)
    models = [GPT(config, backend="gpu", seed=5, dtype=dtype) for _ in range(2)]
    opts = [AdamW(m, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay) for m in models]
    loops = [DeviceLoop(models[0], opts[0], t, 0), DeviceLoop(models[1], opts[1], t, 0, cuda_graph=True)]
    for step in range(5):
        batches = _batches(20 + step, 2, B=4, T=256, V=50257)
        for loop in loops:
            if step >= 2:  # kernels compiled, graphs captured: from here on nothing may sync
                torch.cuda.set_sync_debug_mode("error")
            try:
                loop.step(batches)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    assert loops[1].graphs is not None
    a, b = loops[0].read(), loops[1].read()
    assert a == b, f"eager {a} != graphed {b}"
    assert torch.equal(models[0].flat_params, models[1].flat_params)
