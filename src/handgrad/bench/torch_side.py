"""The PyTorch side of the training benches (bench learn, bench train on the cpu and on the gpu): the
family's PyTorch model from handgrad's weights, trained step by step as PyTorch's users train it.

One class serves every variant the benches compare against: eager or under torch.compile, float32
or under torch.autocast bf16, the whole model or PEFT's LoRA adapters, on the CPU or a GPU. The
step is zero_grad, the forward of each micro-batch and its backward, clip_grad_norm_, AdamW; the
losses stay tensors on the device, so a caller that must not wait for the GPU reads them later."""
import time


def reference_model(family, config, fast):
    """The family's PyTorch model in float32, by its arch, its weights still to load: fast, as its
    users run it (GPT-2: nanoGPT's addmm linears and scaled_dot_product_attention; the Llama family:
    transformers' own classes with SDPA attention over grouped heads); not fast, the plain reference
    spelling (GPT-2's ops as torch_ref writes them, transformers' eager attention)."""
    from ..torch_ref import TorchGPT, TorchLlama, torch
    models = {"gpt2": lambda: TorchGPT(config, torch.float32, fast=fast),
              "llama": lambda: TorchLlama(config, torch.float32, attn_implementation="sdpa" if fast else "eager")}
    models["gemma3"] = models["llama"]  # TorchLlama holds transformers' Gemma3ForCausalLM for a Gemma3Config
    return models[family.arch]()


class TorchSide:
    """The family's model in float32 PyTorch, its weights `state` (handgrad's names), and its AdamW
    (weight decay on the 2-D tensors, as handgrad's), for the hyperparameters of `t` (lr, beta1,
    beta2, weight_decay, grad_clip).

    fast: the model as its users run it (reference_model); device: where it lives ("cpu", "cuda");
    autocast: every forward under torch.autocast(device, bfloat16); fused: torch.optim.AdamW's
    fused kernel (None: torch's default); lora: PEFT's LoRA on the Llama model
    (torch_ref.TorchLlama.with_peft), its initial adapters handgrad's for `seed`, AdamW over the
    adapters alone (all 2-D: decayed, as handgrad's); checkpointing: transformers' gradient
    checkpointing (the Llama family), each layer's forward run again in the backward; compile: the
    model (its forward and, through AOTAutograd, its backward) under torch.compile (a string: its
    mode, e.g. "max-autotune-no-cudagraphs"), the optimizer eager."""

    def __init__(self, family, config, state, t, *, fast, device="cpu", autocast=False, fused=None, lora=None,
                 seed=0, checkpointing=False, compile=False):
        from ..torch_ref import torch
        self.torch, self.dev, self.autocast, self.grad_clip = torch, torch.device(device), autocast, t.grad_clip
        model = reference_model(family, config, fast).load_numpy(state).to(self.dev)
        if checkpointing:
            model.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora is None:
            self.opt = model.adamw(lr=t.lr, weight_decay=t.weight_decay, betas=(t.beta1, t.beta2), fused=fused)
        else:
            self.opt = torch.optim.AdamW(model.with_peft(lora, seed), lr=t.lr, weight_decay=t.weight_decay,
                                         betas=(t.beta1, t.beta2), fused=fused)
        self.params = list(model.parameters())  # the adapters' too, once PEFT has added them
        mode = {"mode": compile} if isinstance(compile, str) else {}
        self.model = torch.compile(model, **mode) if compile else model

    def prepare(self, x, y):
        """A batch of token ids (NumPy) as the model takes it: int64 tensors on the device."""
        return self.torch.from_numpy(x).long().to(self.dev), self.torch.from_numpy(y).long().to(self.dev)

    def loss(self, batch):
        """The mean loss of one prepared batch, under autocast where the side runs in bf16."""
        with self.torch.autocast(self.dev.type, dtype=self.torch.bfloat16, enabled=self.autocast):
            _, loss = self.model(*batch)
        return loss

    def eval_loss(self, batch):
        """The loss of one prepared batch without gradients, as a float."""
        with self.torch.no_grad():
            return self.loss(batch).item()

    def step(self, batches, lr=None):
        """One optimizer step over the prepared micro-batches (the gradient their mean loss's), at
        learning rate lr (None: the optimizer's own). Returns each micro-batch's loss, a tensor on
        the device, read by no one yet."""
        self.opt.zero_grad(set_to_none=True)
        losses = []
        for batch in batches:
            loss = self.loss(batch)
            (loss / len(batches) if len(batches) > 1 else loss).backward()  # one batch: no division in the step
            losses.append(loss.detach())
        if self.grad_clip > 0:
            self.torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        if lr is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr
        self.opt.step()
        return losses

    def compile_now(self, batch):
        """Seconds to compile: one forward and backward on a prepared batch (the gradients dropped,
        the weights untouched, so the timed steps start where the other sides' do)."""
        t0 = time.perf_counter()
        self.loss(batch).backward()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0
