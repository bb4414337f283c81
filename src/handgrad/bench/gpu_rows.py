"""The rows of `handgrad bench ops --device gpu` (bench/gpu.py times them): one op each, handgrad's
forward and backward on device tensors beside a torch function of the same inputs, whose autograd
gives the reference gradients. GPT-2's ops at GPT-2 124M's widths, the Llama family's at
smollm2-135m's (the shapes: bench/gpu.py)."""


class _Row:
    """One op: handgrad's forward and backward on device tensors, and a torch function of the
    same inputs (requires_grad leaves) whose autograd gives the reference gradients."""

    name = ""
    sdpa = None  # an alternative torch function (attention: scaled_dot_product_attention)

    def check_pairs(self):
        """(name, handgrad tensor, torch tensor) after one handgrad fwd+bwd and one torch fwd+bwd."""
        self.hg_forward()
        self.hg_backward()
        y = self.torch_fn(*self.leaves)
        y.backward(self.dy)
        pairs = [("y", self.hg_out, y.detach())]
        pairs += [(f"d{n}", g, leaf.grad) for n, g, leaf in zip(self.grad_names, self.hg_grads, self.leaves)]
        return pairs


class LayerNorm(_Row):
    def __init__(self, ops, torch, s, dtype):
        F = torch.nn.functional
        N, C = s["B"] * s["T"], s["C"]
        self.name = f"layernorm N={N} C={C}"
        g = torch.Generator(device="cpu").manual_seed(0)
        x, w, b = (torch.randn(shape, generator=g) for shape in ((N, C), (C,), (C,)))
        dy = torch.randn((N, C), generator=g)
        dev = ops.device()
        self.x, self.dy = x.to(dev, dtype), dy.to(dev, dtype)
        self.w, self.b = w.to(dev), b.to(dev)
        self.out, self.dx = torch.empty_like(self.x), torch.zeros_like(self.x)
        self.mean, self.rstd = (torch.empty(N, device=dev) for _ in range(2))
        self.dw, self.db = torch.zeros_like(self.w), torch.zeros_like(self.b)
        self.ops = ops
        self.hg_out, self.hg_grads, self.grad_names = self.out, [self.dx, self.dw, self.db], ["x", "w", "b"]
        self.leaves = [t.clone().requires_grad_(True) for t in (self.x, self.w, self.b)]
        # as autocast runs it: in float32, then back to x's dtype (CUDA's layer_norm refuses a bf16 x
        # with float32 w and b, which the CPU's accepts: found on the first H200 run)
        self.torch_fn = lambda x, w, b: F.layer_norm(x.float(), (C,), w, b, 1e-5).to(x.dtype)

    def hg_forward(self):
        self.ops.layernorm_forward(self.out, self.mean, self.rstd, self.x, self.w, self.b)

    def hg_backward(self):  # accumulates (+=) into dx, dw, db: zeroed before the check, not per timed call
        self.ops.layernorm_backward(self.dx, self.dw, self.db, self.dy, self.x, self.w, self.mean, self.rstd)


class Gelu(_Row):
    def __init__(self, ops, torch, s, dtype):
        F = torch.nn.functional
        N, C = s["B"] * s["T"], 4 * s["C"]
        self.name = f"gelu+bias N={N} C={C}"
        g = torch.Generator(device="cpu").manual_seed(1)
        dev = ops.device()
        self.h0 = torch.randn((N, C), generator=g).to(dev, dtype)
        self.b = (0.1 * torch.randn(C, generator=g)).to(dev)
        self.dy = torch.randn((N, C), generator=g).to(dev, dtype)
        self.h = self.h0.clone()  # the forward adds the bias into it in place (the pre-activation)
        self.out, self.dh = torch.empty_like(self.h), torch.empty_like(self.h)
        self.db = torch.zeros_like(self.b)
        self.ops = ops
        self.hg_out, self.hg_grads, self.grad_names = self.out, [self.dh, self.db], ["h", "b"]
        self.leaves = [t.clone().requires_grad_(True) for t in (self.h0, self.b)]
        self.torch_fn = lambda h, b: F.gelu(h + b.to(h.dtype), approximate="tanh")

    def hg_forward(self):
        # the bias goes into h in place, so a timed loop keeps adding it (values drift by b per
        # call: no effect on the time); the check starts from a fresh copy
        self.ops.gelu_forward(self.out, self.h, self.b)

    def hg_backward(self):
        self.ops.gelu_backward(self.dh, self.db, self.dy, self.h)

    def check_pairs(self):
        self.h.copy_(self.h0)
        return super().check_pairs()


class Attention(_Row):
    def __init__(self, ops, torch, s, dtype):
        from .. import torch_ref
        B, T, C, NH = s["B"], s["T"], s["C"], s["NH"]
        self.name = f"attention T={T} C={C} NH={NH}"
        g = torch.Generator(device="cpu").manual_seed(2)
        dev = ops.device()
        self.qkv = torch.randn((B, T, 3 * C), generator=g).to(dev, dtype)
        self.dy = torch.randn((B, T, C), generator=g).to(dev, dtype)
        self.out, self.dqkv = torch.empty((B, T, C), device=dev, dtype=dtype), torch.empty_like(self.qkv)
        self.state = torch.empty(ops.attention_state_shape(B, NH, T), device=dev, dtype=torch.float32)
        self.ops, self.NH = ops, NH
        self.hg_out, self.hg_grads, self.grad_names = self.out, [self.dqkv], ["qkv"]
        self.leaves = [self.qkv.clone().requires_grad_(True)]
        self.torch_fn = lambda qkv: torch_ref.attention(qkv, NH)
        self.sdpa = lambda qkv: torch_ref.attention_sdpa(qkv, NH)

    def hg_forward(self):
        self.ops.attention_forward(self.out, self.state, self.qkv, self.NH)

    def hg_backward(self):
        self.ops.attention_backward(self.dqkv, self.dy, self.qkv, self.state, self.NH, out=self.out)


class CrossEntropy(_Row):
    def __init__(self, ops, torch, s, dtype):
        from .. import torch_ref
        B, T, V = s["B"], s["T"], s["V"]
        self.name = f"crossentropy N={B * T} V={V}"
        g = torch.Generator(device="cpu").manual_seed(3)
        dev = ops.device()
        self.logits = (2.0 * torch.randn((B, T, V), generator=g)).to(dev, dtype)
        targets = torch.randint(0, V, (B, T), generator=g, dtype=torch.int32)
        targets[0, : max(1, T // 8)] = -1  # some ignored positions, as padding gives
        self.targets = targets.to(dev)
        self.losses = torch.empty((B, T), device=dev)
        self.lse = torch.empty((B, T), device=dev)
        self.dlogits = torch.empty_like(self.logits)
        self.mean = torch.zeros((), device=dev)
        self.ops = ops
        self.dy = torch.ones((), device=dev)
        self.hg_out, self.hg_grads, self.grad_names = self.mean, [self.dlogits], ["logits"]
        self.leaves = [self.logits.clone().requires_grad_(True)]
        tt = self.targets.long()
        self.torch_fn = lambda z: torch_ref.crossentropy(z.float(), tt)

    def hg_forward(self):
        self.mean.copy_(self.ops.crossentropy_forward(self.losses, self.lse, self.logits, self.targets))

    def hg_backward(self):  # out of place, so the logits stay the same from call to call
        self.ops.crossentropy_backward(self.dlogits, self.logits, self.lse, self.targets)



class LMHead(_Row):
    """The tied lm_head's three products: logits = x @ wte^T, dx = dlogits @ wte, dwte += dlogits^T x.
    At GPT-2's V = 50,257 every one of them has a row of V bf16 elements, 100,514 bytes, which is not
    a multiple of 16: cuBLAS's tensor-core kernels want 16-byte-aligned rows. torch.compile pads
    such products (Inductor's pad_mm) and eager torch does not, as handgrad does not: this row says
    what that costs (nanoGPT and llm.c pad the vocabulary to 50,304 instead)."""

    LABEL = "lm_head"

    def __init__(self, ops, torch, s, dtype):
        B, T, C, V = s["B"], s["T"], s["C"], self.vocab(s["V"])
        self.name = f"{self.LABEL} N={B * T} C={C} V={V}"
        g = torch.Generator(device="cpu").manual_seed(10)
        dev = ops.device()
        self.x = torch.randn((B, T, C), generator=g).to(dev, dtype)
        self.wte = (0.02 * torch.randn((V, C), generator=g)).to(dev)  # a float32 parameter
        self.dy = torch.randn((B, T, V), generator=g).to(dev, dtype)
        self.out, self.dx = torch.empty_like(self.dy), torch.empty_like(self.x)
        self.dwte = torch.zeros_like(self.wte)
        self.ops = ops
        self.hg_out, self.hg_grads, self.grad_names = self.out, [self.dx, self.dwte], ["x", "wte"]
        self.leaves = [t.clone().requires_grad_(True) for t in (self.x, self.wte)]
        # as autocast runs it: the float32 weight cast to the activations' dtype, one product
        self.torch_fn = lambda x, w: torch.nn.functional.linear(x, w.to(x.dtype))

    def hg_forward(self):
        self.ops.linear_forward(self.out, self.x, self.wte.t())

    def hg_backward(self):  # accumulates (+=) into dwte: zeroed before the check, not per timed call
        self.ops.linear_backward(self.dx, self.dwte.t(), None, self.dy, self.x, self.wte.t())

    @staticmethod
    def vocab(V):
        return V


class LMHeadPadded(LMHead):
    """LMHead at V rounded up to a multiple of 64 (50,304 for GPT-2: llm.c's padded vocabulary), so
    every bf16 row is 128-byte aligned. Beside LMHead's row: if handgrad's time per product falls here
    by more than the 0.1% more work, unaligned rows are the cost, and padding the cure."""

    LABEL = "lm_head-padded"

    @staticmethod
    def vocab(V):
        return -(-V // 64) * 64


# ---------------------------------------------------------------- the Llama family's ops
class RMSNorm(_Row):
    def __init__(self, ops, torch, s, dtype):
        from .. import torch_ref
        N, C = s["B"] * s["T"], s["C"]
        self.name = f"rmsnorm N={N} C={C}"
        g = torch.Generator(device="cpu").manual_seed(5)
        dev = ops.device()
        self.x, self.dy = (torch.randn((N, C), generator=g).to(dev, dtype) for _ in range(2))
        self.w = (1.0 + 0.1 * torch.randn(C, generator=g)).to(dev)
        self.out, self.dx = torch.empty_like(self.x), torch.zeros_like(self.x)
        self.rstd, self.dw = torch.empty(N, device=dev), torch.zeros_like(self.w)
        self.ops = ops
        self.hg_out, self.hg_grads, self.grad_names = self.out, [self.dx, self.dw], ["x", "w"]
        self.leaves = [t.clone().requires_grad_(True) for t in (self.x, self.w)]
        # transformers' LlamaRMSNorm: the statistics in float32, the result cast back
        self.torch_fn = lambda x, w: (torch_ref.rmsnorm(x.float(), w, 1e-5)).to(x.dtype)

    def hg_forward(self):
        self.ops.rmsnorm_forward(self.out, self.rstd, self.x, self.w, 1e-5)

    def hg_backward(self):  # accumulates (+=) into dx, dw: zeroed before the check, not per timed call
        self.ops.rmsnorm_backward(self.dx, self.dw, self.dy, self.x, self.w, self.rstd)


class Rope(_Row):
    """RoPE over the q and k heads (NH + NKV of them), out of place (decoding rotates qkv's q and k
    columns in place; training has the attention kernels rotate them: RopeGQAttention)."""

    def __init__(self, ops, torch, s, dtype):
        from .. import torch_ref
        B, T, NH, NKV = s["B"], s["T"], s["NH"], s["NKV"]
        hs, heads = s["C"] // NH, NH + NKV
        self.name = f"rope T={T} heads={heads} hs={hs}"
        g = torch.Generator(device="cpu").manual_seed(6)
        dev = ops.device()
        self.x, self.dy = (torch.randn((B, T, heads * hs), generator=g).to(dev, dtype) for _ in range(2))
        self.cos, self.sin = ops.rope_cache(T, hs, s["theta"])
        self.out, self.dx = torch.empty_like(self.x), torch.empty_like(self.x)
        self.ops, self.heads = ops, heads
        self.hg_out, self.hg_grads, self.grad_names = self.out, [self.dx], ["x"]
        self.leaves = [self.x.clone().requires_grad_(True)]
        self.torch_fn = lambda x: torch_ref.rope(x.float(), self.cos, self.sin, heads).to(x.dtype)

    def hg_forward(self):
        self.ops.rope_forward(self.out, self.x, self.cos, self.sin, self.heads)

    def hg_backward(self):
        self.ops.rope_backward(self.dx, self.dy, self.cos, self.sin, self.heads)


class GQAttention(_Row):
    """Causal grouped-query attention: torch eager as transformers' eager path (k and v repeated per
    group, the scores materialised); SDPA with enable_gqa (no repeat) beside it."""

    ROPE = False  # RopeGQAttention: q and k come in before RoPE, which the kernels apply

    def __init__(self, ops, torch, s, dtype):
        from .. import torch_ref
        F = torch.nn.functional
        B, T, C, NH, NKV = s["B"], s["T"], s["C"], s["NH"], s["NKV"]
        hs = C // NH
        self.name = f"{'rope+' if self.ROPE else ''}gqa-attention T={T} NH={NH} NKV={NKV}"
        self.rope = ops.rope_cache(T, hs, s["theta"]) if self.ROPE else None
        g = torch.Generator(device="cpu").manual_seed(7)
        dev = ops.device()
        self.qkv = torch.randn((B, T, (NH + 2 * NKV) * hs), generator=g).to(dev, dtype)
        self.dy = torch.randn((B, T, C), generator=g).to(dev, dtype)
        self.out, self.dqkv = torch.empty((B, T, C), device=dev, dtype=dtype), torch.empty_like(self.qkv)
        self.state = torch.empty(ops.gqa_attention_state_shape(B, NH, T), device=dev, dtype=torch.float32)
        self.ops, self.NH, self.NKV = ops, NH, NKV
        self.hg_out, self.hg_grads, self.grad_names = self.out, [self.dqkv], ["qkv"]
        self.leaves = [self.qkv.clone().requires_grad_(True)]

        def heads(qkv):
            if self.ROPE:  # the rotation in float32, as transformers' apply_rotary_pos_emb under autocast
                QK = (NH + NKV) * hs
                qk = torch_ref.rope(qkv[:, :, :QK].float(), *self.rope, NH + NKV).to(qkv.dtype)
                qkv = torch.cat([qk, qkv[:, :, QK:]], dim=2)
            q, k, v = qkv.split([NH * hs, NKV * hs, NKV * hs], dim=2)
            return (t.reshape(B, T, -1, hs).transpose(1, 2) for t in (q, k, v))

        def eager(qkv):
            q, k, v = heads(qkv)
            k, v = (t.repeat_interleave(NH // NKV, dim=1) for t in (k, v))
            att = (q @ k.transpose(-2, -1)) / hs ** 0.5
            mask = torch.ones(T, T, dtype=torch.bool, device=qkv.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
            return (att @ v).transpose(1, 2).reshape(B, T, C)

        def sdpa(qkv):
            q, k, v = heads(qkv)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return y.transpose(1, 2).reshape(B, T, C)

        self.torch_fn, self.sdpa = eager, sdpa

    def hg_forward(self):
        self.ops.gqa_attention_forward(self.out, self.state, self.qkv, self.NH, self.NKV, rope=self.rope)

    def hg_backward(self):
        self.ops.gqa_attention_backward(self.dqkv, self.dy, self.qkv, self.state, self.NH, self.NKV, out=self.out,
                                        rope=self.rope)


class RopeGQAttention(GQAttention):
    """RoPE and grouped-query attention as the model trains them: handgrad's kernels rotate q and k
    as they load them (and dq, dk on the way out); torch rotates first, then attends."""

    ROPE = True


class SwiGLU(_Row):
    def __init__(self, ops, torch, s, dtype):
        from .. import torch_ref
        N, H = s["B"] * s["T"], s["F"]
        self.name = f"swiglu N={N} H={H}"
        g = torch.Generator(device="cpu").manual_seed(8)
        dev = ops.device()
        self.gu = (2.0 * torch.randn((N, 2 * H), generator=g)).to(dev, dtype)
        self.dy = torch.randn((N, H), generator=g).to(dev, dtype)
        self.out, self.dgu = torch.empty((N, H), device=dev, dtype=dtype), torch.empty_like(self.gu)
        self.ops = ops
        self.hg_out, self.hg_grads, self.grad_names = self.out, [self.dgu], ["gu"]
        self.leaves = [self.gu.clone().requires_grad_(True)]
        self.torch_fn = torch_ref.swiglu

    def hg_forward(self):
        self.ops.swiglu_forward(self.out, self.gu)

    def hg_backward(self):
        self.ops.swiglu_backward(self.dgu, self.dy, self.gu)


ROWS = (LayerNorm, Gelu, Attention, CrossEntropy, LMHead, LMHeadPadded)
LLAMA_ROWS = (RMSNorm, Rope, GQAttention, RopeGQAttention, SwiGLU)
