"""Compile every Triton kernel the gpu tests launch to an sm_90 (H100) cubin, without a GPU.

Step 1 (`record`, under TRITON_INTERPRET=1): runs the given pytest arguments with every kernel
launch recorded as (module, kernel, argument types, constexprs) into a JSON file. `record-sizes`
records instead the launches of full-size training steps and decoding without running the kernels
(their outputs are left as garbage; only the launch parameters matter), with the launch choices a
GPU would make: one block of GPT-2 124M's widths at B 2, T 1024, float32 and bf16, its lm_head padded
to 50,304 rows as train pads it on the gpu, head sizes 64
(two micro-batches), 32 and 128, and two tokens of KV-cache decoding each; smollm2-135m's blocks at
T 2048, plain and fine-tuned (LoRA and dropout), and decoding.
Step 2 (`compile`, without the interpreter): compiles each recorded specialisation with
triton.compile for GPUTarget("cuda", 90, 32), using the ptxas Triton ships. A kernel that only
the interpreter accepts fails here.

    python tools/compile_sm90.py record kernels.json tests/test_gpu_rowwise.py ...
    python tools/compile_sm90.py record-sizes sizes.json [--quick]   # --quick: head size 64, B 1 only
    python tools/compile_sm90.py compile kernels.json
"""
import inspect
import json
import os
import sys


def _type_of(value):
    import torch
    if isinstance(value, torch.Tensor):
        return "*" + {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16",
                      torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8",
                      torch.bool: "i1"}[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    if value is None:
        return "constexpr"
    raise TypeError(f"argument of type {type(value).__name__}")


def _recording(seen, execute=True):
    """Patch the interpreter so each launch is recorded into `seen` (and run only if execute)."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction
    real = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        bound = dict(zip(names, args), **kwargs)
        consts = {n for n, p in inspect.signature(self.fn).parameters.items() if "constexpr" in str(p.annotation)}
        sig = {n: ("constexpr" if n in consts else _type_of(bound[n])) for n in names}
        constexprs = {n: bound[n] for n in names if n in consts}
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        key = json.dumps([self.fn.__module__, self.fn.__name__, sig, constexprs, options], sort_keys=True,
                         default=str)
        seen[key] = 1
        if execute:
            return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


def _save(seen, out, what):
    with open(out, "w") as f:
        json.dump([json.loads(k) for k in seen], f, indent=0)
    print(f"{len(seen)} kernel specialisations recorded into {out} ({what})")


def _device_blocks():
    """The block sizes a GPU launches with where the interpreter's are wider (adamw.BLOCK, dropout.BLOCK:
    chosen at import, and the recording imports under TRITON_INTERPRET=1)."""
    from handgrad.backends.gpu import adamw, dropout
    adamw.BLOCK, dropout.BLOCK = adamw.DEVICE_BLOCK, dropout.DEVICE_BLOCK


def record(out, pytest_args):
    seen = {}
    _recording(seen)
    _device_blocks()
    import pytest
    rc = pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args])
    _save(seen, out, f"pytest exit {rc}")
    return int(rc)


def _no_products():
    """The matrix products (cuBLAS's on a GPU, torch's on the CPU here) skipped: their outputs are
    never read, since no kernel runs, and at full size they were most of the recording's time
    (bf16 products on a CPU without bf16 instructions, minutes each on the 2-core AMD EPYC)."""
    import torch

    def mm(a, b, out=None):
        return out if out is not None else torch.empty(a.shape[0], b.shape[1], dtype=a.dtype)

    def addmm(bias, a, b, out=None, **kw):
        return out if out is not None else torch.empty(a.shape[0], b.shape[1], dtype=a.dtype)

    torch.mm, torch.addmm = mm, addmm
    torch.Tensor.addmm_ = lambda self, a, b, **kw: self


def record_sizes(out, quick=False):
    seen = {}
    _recording(seen, execute=False)
    import numpy as np
    from handgrad import GPT, GPTConfig
    from handgrad.config import load_run_config
    from handgrad.training.device_loop import DeviceLoop
    from handgrad.training.optim import AdamW
    from handgrad.models.decode import generate
    from handgrad.backends.gpu import gqa_attention
    gqa_attention.interpreting = lambda: False  # launch parameters chosen as on a GPU (the kernels do not run)
    _device_blocks()
    _no_products()
    rng = np.random.default_rng(0)
    for dtype in ("float32", "bfloat16"):
        heads = ((12, 1, 2),) if quick else ((12, 1, 2), (24, 1, 1), (6, 1, 1))  # head sizes 64, 32, 128
        for n_head, n_layer, accum in heads:
            config = GPTConfig(block_size=1024, vocab_size=50257, n_layer=n_layer, n_head=n_head, n_embd=768)
            model = GPT(config, backend="gpu", dtype=dtype, vocab_pad=64)  # train's default on the gpu
            t = load_run_config("gpt2-124m", overrides={"train.grad_accum_steps": accum, "train.max_steps": 3}).train
            loop = DeviceLoop(model, AdamW(model, lr=t.lr, weight_decay=t.weight_decay), t, 0)
            B = 1 if quick else 2
            batch = [(rng.integers(0, 50257, (B, 1024)), rng.integers(0, 50257, (B, 1024)))] * accum
            loop.step(batch)
            generate(model, np.zeros((2, 1), np.int64), 2, temperature=0.0)
        _llama_step(dtype, quick)
        _llama_step(dtype, quick, fine_tune=True)
    _save(seen, out, "full-size steps, kernels not run")
    return 0


def _llama_step(dtype, quick, fine_tune=False):
    """A training step and decoding of smollm2-135m's shape (C 576, 9 query heads on 3 kv heads of
    64, SwiGLU 1536, vocab 49152, T 2048; one layer when quick, as the GPT-2 steps): every Llama
    kernel launch with the sizes a real run gives it. fine_tune: with rank-16 LoRA adapters on every
    linear, their dropout, and model.dropout (the attention kernels' dropout variants)."""
    import numpy as np
    from handgrad.config import LlamaConfig, LoRAConfig, load_run_config
    from handgrad.models.decode import generate
    from handgrad.models.llama import Llama
    from handgrad.training.device_loop import DeviceLoop
    from handgrad.training.optim import AdamW
    config = LlamaConfig(block_size=2048, vocab_size=49152, n_layer=1 if quick else 2, n_head=9, n_kv_head=3,
                         n_embd=576, ffn_hidden=1536, rope_theta=100000.0)
    lora = LoRAConfig(16, 32.0, tuple(Llama.LORA_MODULES), dropout=0.05) if fine_tune else None
    model = Llama(config, backend="gpu", dtype=dtype, lora=lora, dropout=0.1 if fine_tune else 0.0)
    t = load_run_config("smollm2-135m", overrides={"train.max_steps": 3, "train.grad_accum_steps": 1}).train
    loop = DeviceLoop(model, AdamW(model, lr=t.lr, weight_decay=t.weight_decay), t, 0)
    rng = np.random.default_rng(0)
    loop.step([(rng.integers(0, 49152, (1, 2048)), rng.integers(0, 49152, (1, 2048)))])
    if not fine_tune:
        generate(model, np.zeros((2, 1), np.int64), 2, temperature=0.0)


def compile_all(path):
    import importlib
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", 90, 32)
    failed = 0
    kernels = json.load(open(path))
    for module, name, sig, constexprs, options in kernels:
        fn = getattr(importlib.import_module(module), name)
        try:
            src = ASTSource(fn=fn, signature=sig, constexprs={k: v for k, v in constexprs.items()})
            kernel = triton.compile(src, target=target, options=options)
            smem = kernel.metadata.shared
            if smem > 227 * 1024:  # an H100's shared memory per block
                raise ValueError(f"needs {smem:,} bytes of shared memory, the H100 has 232,448")
            print(f"ok   {module}.{name} {constexprs} {options} ({len(kernel.asm['cubin']):,} bytes, "
                  f"{smem:,} bytes shared memory)")
        except Exception as e:  # report every failure, then exit non-zero
            failed += 1
            print(f"FAIL {module}.{name} {constexprs}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    print(f"triton {triton.__version__}: {len(kernels) - failed} of {len(kernels)} compiled for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "record":
        sys.exit(record(sys.argv[2], sys.argv[3:]))
    if len(sys.argv) in (3, 4) and sys.argv[1] == "record-sizes":
        sys.exit(record_sizes(sys.argv[2], quick=sys.argv[3:] == ["--quick"]))
    if len(sys.argv) == 3 and sys.argv[1] == "compile":
        sys.exit(compile_all(sys.argv[2]))
    sys.exit(__doc__)
