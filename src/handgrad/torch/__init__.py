"""handgrad's kernels inside PyTorch: each op as a torch.autograd.Function and an nn.Module.

One rung per layer, as in the rest of handgrad:
    backend op     handgrad.backends.<device>.x_forward / x_backward (write into preallocated arrays)
    -> Function    XFunction: checks and converts tensors, allocates outputs and gradients, saves
                   what the backward needs
    -> function    x(...), what a PyTorch user calls, and the module X that holds the parameters

    module                              replaces                                   parameters
    LayerNorm(C)                        nn.LayerNorm(C) (eps 1e-5)                 weight, bias (C)
    Linear(C, OC, bias=True)            nn.Linear(C, OC)                           weight (OC, C), bias (OC)
    LayerNormLinear(C, OC, bias=True)   nn.LayerNorm(C) then nn.Linear(C, OC)      ln_weight, ln_bias (C),
                                                                                   weight (OC, C), bias (OC)
    GELU()                              nn.GELU(approximate="tanh")                -
    CausalSelfAttention(C, NH)          nanoGPT's CausalSelfAttention, no dropout  c_attn, c_proj (Linear)
    CrossEntropyLoss()                  nn.CrossEntropyLoss(ignore_index=-1)       -
  the Llama family (transformers' modeling_llama):
    RMSNorm(C, eps=1e-6)                LlamaRMSNorm(C, eps)                       weight (C)
    SwiGLU(C, H, bias=False)            LlamaMLP (hidden_act "silu")               gate_proj, up_proj,
                                                                                   down_proj (Linear)
    CausalSelfAttention(C, NH,          LlamaAttention (grouped-query, RoPE)       q_proj, k_proj, v_proj, o_proj
      n_kv_head=NKV, rope_theta=1e4)                                               (Linear)
    apply_rope(q, k, cos, sin)          apply_rotary_pos_emb(q, k, cos, sin)       -
  LoRA (PEFT's LoraLayer on an nn.Linear):
    LoRALinear(C, OC, r=8, alpha=2r,    nn.Linear frozen + a rank-r adapter        weight, bias (frozen),
      dropout=0.0, bias=True)           (PEFT's lora.Linear)                       lora_A (r, C), lora_B (OC, r)

Weight layout. handgrad's ops take GPT-2's Conv1D layout W [in, out] (out = x @ W). These modules
keep nn.Linear's layout [out, in] (out = x @ weight.T) and hand the ops the transposed view
weight.T, which BLAS reads in place (no copy); the weight gradient is written through the same
kind of view. So nn.Linear / nanoGPT state_dicts load unchanged, an lm_head can be tied to an
nn.Embedding's (V, C) weight, and a Hugging Face GPT-2 Conv1D weight loads as weight = W.T.

Backends. The backend is picked from the tensors' device. CPU tensors run on the cpu backend. CUDA
tensors run on the gpu backend (Triton kernels, cuBLAS products) in the Llama family's Functions
(rms_norm, swiglu, rope, gqa_attention), lora_linear and linear, so RMSNorm, SwiGLU,
CausalSelfAttention(n_kv_head=...) and LoRALinear run on CUDA; the other GPT-2 Functions
(`backend_for`) still refuse CUDA tensors. A tensor on another device raises NotImplementedError
naming the missing backend.

dtypes: float32 and float64 (gradcheck) on the CPU; float32 and bfloat16 on CUDA; anything else
raises TypeError. Double backward is not
supported (the backwards are hand-written kernels, marked once_differentiable).
"""
from .common import FLOATS, backend_for  # noqa: F401
from .functions import (CausalAttentionFunction, CrossEntropyFunction, GELUFunction, LayerNormFunction,  # noqa: F401
                        LayerNormLinearFunction, LinearFunction, causal_attention, cross_entropy, gelu, layernorm,
                        layernorm_linear, linear)
from .llama import (GQAAttentionFunction, RMSNormFunction, RoPEFunction, SwiGLUFunction, apply_rope,  # noqa: F401
                    gqa_attention, rms_norm, rope, rope_cache, swiglu)
from .lora import LoRALinear, LoRALinearFunction, lora_linear  # noqa: F401
from .modules import (GELU, CausalSelfAttention, CrossEntropyLoss, LayerNorm, LayerNormLinear, Linear,  # noqa: F401
                      RMSNorm, SwiGLU)
