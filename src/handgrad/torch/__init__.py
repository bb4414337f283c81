"""handgrad's kernels inside PyTorch: each op as a torch.autograd.Function and an nn.Module.

One rung per layer, as in the rest of handgrad: the backend op (handgrad.backends.<device>'s
x_forward / x_backward, writing into preallocated arrays) -> XFunction (checks and converts tensors,
allocates outputs and gradients, saves what the backward needs) -> x(...) and the module X, a drop-in
for the torch, nanoGPT, transformers or PEFT module its docstring names (docs/PYTHON.md has the table).

The non-obvious idea, the weight layout: handgrad's ops take GPT-2's Conv1D layout W [in, out]
(out = x @ W), the modules keep nn.Linear's [out, in] and hand the ops the view weight.T, which BLAS
reads in place. So nn.Linear, nanoGPT and Hugging Face state_dicts load unchanged.

The backend follows the tensors' device: CPU tensors (float32, float64 for gradcheck) on the cpu
backend; CUDA tensors (float32, bfloat16) on the gpu backend for the Llama family's Functions, lora_linear
and linear (the other GPT-2 Functions refuse them). No double backward: the backwards are hand-written.
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
