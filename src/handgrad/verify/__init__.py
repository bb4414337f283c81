"""Check every op's forward and backward, and the whole model, against PyTorch autograd.

handgrad computes in float32 (or float64 when asked); the reference is torch autograd in float64
on the same inputs with the same random upstream gradient. For each output and gradient we report
max |ours - ref| and that error relative to max |ref|, and pass it when the relative error is
within the tolerance. `handgrad verify` prints the table; the tests call the same checks over a
matrix of shapes.
"""
import json
from dataclasses import asdict


from ..config import Gemma3Config, GPTConfig, LlamaConfig
from .common import TOL32, TOL64, Row, compare, ops_for  # noqa: F401  (the tests use them from here)
from .llama_ops import (check_geglu, check_gqa_attention, check_rmsnorm, check_rmsnorm_linear, check_rope,
                        check_swiglu)
from .model import check_model_adamw, check_model_step
from .ops import (
    check_adamw,
    check_attention,
    check_crossentropy,
    check_dropout,
    check_encoder,
    check_gelu,
    check_layernorm,
    check_layernorm_linear,
    check_linear,
    check_lora_linear,
    check_residual,
)


OP_CHECKS = {
    "encoder": check_encoder, "layernorm": check_layernorm, "linear": check_linear,
    "layernorm_linear": check_layernorm_linear, "attention": check_attention, "gelu": check_gelu,
    "residual": check_residual, "crossentropy": check_crossentropy, "adamw": check_adamw,
    "rmsnorm": check_rmsnorm, "rmsnorm_linear": check_rmsnorm_linear, "swiglu": check_swiglu,
    "lora_linear": check_lora_linear, "dropout": check_dropout, "geglu": check_geglu,
}


LLAMA_OPS = ("rmsnorm", "rmsnorm_linear", "swiglu")  # checked on the backends that have them


VERIFY_CONFIG = GPTConfig(block_size=32, vocab_size=1000, n_layer=2, n_head=3, n_embd=96)
# the Llama family against transformers' LlamaForCausalLM (6 query heads on 2 kv heads, tied) and
# Qwen2ForCausalLM (q/k/v biases, 6 on 3 kv heads, an untied lm_head); C 96, head size 16
VERIFY_LLAMA = (
    LlamaConfig(block_size=32, vocab_size=1000, n_layer=2, n_head=6, n_kv_head=2, n_embd=96, ffn_hidden=200),
    LlamaConfig(block_size=32, vocab_size=1000, n_layer=2, n_head=6, n_kv_head=3, n_embd=96, ffn_hidden=200,
                qkv_bias=True, tie_embeddings=False),
    # Qwen3: q/k norms per head, head_dim 32 with q 192 wide over n_embd 96
    LlamaConfig(block_size=32, vocab_size=1000, n_layer=2, n_head=6, n_kv_head=2, n_embd=96, head_dim=32,
                ffn_hidden=200, qk_norm=True, tie_embeddings=False))


# Gemma 3 against transformers' Gemma3ForCausalLM: 6 query heads on 2 kv heads 16 wide over n_embd 72,
# local layers (a 5-key window under T 17) around a global one, scores scaled by 20 ** -0.5, softcapped logits
VERIFY_GEMMA3 = (Gemma3Config(block_size=32, vocab_size=1000, n_layer=3, n_head=6, n_kv_head=2, n_embd=72, head_dim=16,
                              ffn_hidden=200, sliding_window=5, sliding_window_pattern=2, query_pre_attn_scalar=20.0,
                              final_logit_softcapping=30.0),)


def _has_llama(backend):
    """Whether the backend has every op of the Llama family (both backends do now), so the llama
    model checks can run on it."""
    return all(hasattr(ops_for(backend), f"{op}_forward") for op in ("rmsnorm", "swiglu", "rope", "gqa_attention"))


def checks(backend="cpu"):
    """Every check the backend has, by name (what `verify --only` picks): each op at an awkward shape
    (C = 96 with 3 heads, V = 1000, B*T = 2*17 = 34), then the models. A name -> a function of no
    arguments returning its rows."""
    shape = dict(B=2, T=17)
    ops = ops_for(backend)
    out = {
        "encoder": lambda: check_encoder(**shape, C=96, V=1000, block_size=32, backend=backend),
        "layernorm": lambda: check_layernorm(**shape, C=96, backend=backend),
        "linear": lambda: check_linear(**shape, C=96, OC=288, backend=backend),
        "layernorm_linear": lambda: check_layernorm_linear(**shape, C=96, OC=384, backend=backend),
        "attention": lambda: check_attention(**shape, C=96, NH=3, backend=backend),
        "gelu": lambda: check_gelu(**shape, C=384, backend=backend),
        "residual": lambda: check_residual(**shape, C=96, backend=backend),
        "crossentropy": lambda: check_crossentropy(**shape, V=1000, backend=backend),
        "adamw": lambda: check_adamw(backend=backend),
        "model": lambda: (check_model_step(VERIFY_CONFIG, B=2, T=32, backend=backend)
                          + check_model_adamw(VERIFY_CONFIG, B=2, T=32, steps=10, backend=backend)),
    }
    if hasattr(ops, "lora_linear_forward"):  # both backends have them
        out["lora_linear"] = lambda: check_lora_linear(**shape, C=96, OC=288, r=8, scale=2.0, backend=backend)
        out["dropout"] = lambda: check_dropout(**shape, C=96, p=0.2, backend=backend)
    if hasattr(ops, "rmsnorm_forward"):  # the Llama family's ops, as far as the backend has them
        out["rmsnorm"] = lambda: check_rmsnorm(**shape, C=96, backend=backend)
        out["rmsnorm_linear"] = lambda: check_rmsnorm_linear(**shape, C=96, OC=344, bias=True, backend=backend)
        out["swiglu"] = lambda: check_swiglu(**shape, H=344, backend=backend)
    if hasattr(ops, "rope_forward"):
        out["rope"] = lambda: check_rope(**shape, NH=6, NKV=2, hs=16, offset=5, backend=backend)
    if _has_llama(backend):
        out["gqa_attention"] = lambda: (
            check_gqa_attention(**shape, NH=6, NKV=2, hs=16, backend=backend)
            + check_gqa_attention(**shape, NH=6, NKV=2, hs=16, backend=backend, rope=True, dropout_p=0.1))
        out["sliding_attention"] = lambda: check_gqa_attention(**shape, NH=6, NKV=2, hs=16, backend=backend,
                                                               rope=True, window=5, scale=0.2)
        out["document_attention"] = lambda: (
            check_gqa_attention(**shape, NH=6, NKV=2, hs=16, backend=backend, rope=True, documents=True)
            + check_gqa_attention(**shape, NH=6, NKV=2, hs=16, backend=backend, rope=True, window=5, documents=True))
        out["llama_model"] = lambda: [row for config in VERIFY_LLAMA
                                      for row in (check_model_step(config, B=2, T=17, backend=backend)
                                                  + check_model_adamw(config, B=2, T=17, steps=10, backend=backend))]
    if hasattr(ops, "geglu_forward"):
        out["geglu"] = lambda: check_geglu(**shape, H=344, backend=backend)
        out["gemma3_model"] = lambda: [row for config in VERIFY_GEMMA3
                                       for row in (check_model_step(config, B=2, T=17, backend=backend)
                                                   + check_model_adamw(config, B=2, T=17, steps=10, backend=backend))]
    return out


def run_all(backend="cpu", only=None):
    """The rows of every check (or of the names in `only`, in the order checks() lists them)."""
    table = checks(backend)
    if only is not None:
        unknown = [n for n in only if n not in table]
        if unknown:
            raise ValueError(f"verify --only: no check named {unknown[0]!r} on the {backend} backend; choose from "
                             f"{', '.join(table)}")
    return [row for name, check in table.items() if only is None or name in only for row in check()]


def main(backend="cpu", as_json=False, only=None):
    from ..torch_ref import require_torch
    torch = require_torch()
    # The reference runs on tiny tensors: one thread is as fast, and keeps torch's OpenMP pool from
    # spin-waiting against handgrad's threads between calls (measured: 16.6 s -> 3.6 s on 2 cores).
    torch.set_num_threads(1)
    if backend == "gpu":
        from ..backends.gpu.common import device
        device()  # no CUDA and no interpreter: one line saying what to do
    try:
        rows = run_all(backend, only)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    failed = [r for r in rows if not r.ok]
    if as_json:
        print(json.dumps({"backend": backend, "ok": not failed, "rows": [asdict(r) for r in rows]}, indent=1))
    else:
        print(f"handgrad verify --backend {backend}: float32 against PyTorch autograd in float64")
        print(f"model check: {VERIFY_CONFIG}")
        if _has_llama(backend):
            print("llama checks (against transformers' LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM):")
            for config in VERIFY_LLAMA:
                print(f"  {config}")
            print("gemma3 check (against transformers' Gemma3ForCausalLM):")
            for config in VERIFY_GEMMA3:
                print(f"  {config}")
        print()
        print(f"{'op':<18} {'quantity':<28} {'max abs':>10} {'max rel':>10} {'tol':>8}")
        for r in rows:
            print(r.line())
        print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0

