"""Whole models against an independent implementation with the same weights: one step (logits, loss,
every gradient) and ten AdamW steps. GPT-2 against torch_ref.TorchGPT; the Llama family against
transformers' own LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM; Gemma 3 against Gemma3ForCausalLM."""
import numpy as np

from ..config import Gemma3Config, LlamaConfig
from ..models.gemma3 import Gemma3
from ..models.gpt2 import GPT
from ..models.llama import Llama
from ..training.optim import AdamW, clip_scale, grad_norm
from .common import compare


# ---------------------------------------------------------------- whole model
def _model_and_ref(config, seed, backend, loss_chunk=0):
    """handgrad's model of config's family, and the float64 reference with its weights: TorchGPT for
    GPT-2, transformers' own LlamaForCausalLM (or Qwen2ForCausalLM) for the Llama family.
    loss_chunk: the model's (its loss over that many rows of logits at a time)."""
    import torch

    from ..torch_ref import TorchGPT, TorchLlama
    if isinstance(config, (LlamaConfig, Gemma3Config)):
        model = (Gemma3 if isinstance(config, Gemma3Config) else Llama)(config, backend=backend, seed=seed,
                                                                         loss_chunk=loss_chunk)
        return model, TorchLlama(config, torch.float64).load_numpy(model.state_dict())
    model = GPT(config, backend=backend, seed=seed, loss_chunk=loss_chunk)
    return model, TorchGPT(config, torch.float64).load_numpy(model.state_dict())


def _model_op(config):
    """The verify table's op column for a whole-model row: model (GPT-2), llama, qwen3 (qk_norm) or gemma3."""
    if isinstance(config, Gemma3Config):
        return "gemma3"
    if isinstance(config, LlamaConfig):
        return "qwen3" if config.qk_norm else "llama"
    return "model"


def _batch(config, B, T, seed):
    rng = np.random.default_rng(seed + 1)
    idx = rng.integers(0, config.vocab_size, (B, T))
    targets = rng.integers(0, config.vocab_size, (B, T))
    targets[0, 0] = -1
    return idx, targets


def _group(name):
    """h.3.attn.c_attn.weight -> h.*.attn.c_attn.weight, model.layers.3.mlp.up_proj.weight ->
    model.layers.*.mlp.up_proj.weight (one table row per tensor kind)."""
    parts = name.split(".")
    if parts[0] == "h":
        return "h.*." + ".".join(parts[2:])
    if parts[:2] == ["model", "layers"]:
        return "model.layers.*." + ".".join(parts[3:])
    return name


def check_model_step(config, B, T, seed=0, backend="cpu", tol=1e-4, per_tensor=False, loss_chunk=0):
    """One forward/backward: logits, loss and every parameter gradient against torch float64."""
    import torch
    model, ref = _model_and_ref(config, seed, backend, loss_chunk)
    idx, targets = _batch(config, B, T, seed)
    logits = model.forward(idx)
    loss = model.forward(idx, targets)
    model.zero_grad()
    model.backward()
    rlogits, rloss = ref(torch.from_numpy(idx), torch.from_numpy(targets))
    rloss.backward()
    op = _model_op(config)
    rows = [compare(op, "logits", logits, rlogits.detach(), tol),
            compare(op, "loss", loss, rloss.detach(), tol)]
    grads, rgrads = model.grads(), ref.grads_numpy()
    groups = {}
    for name in grads:
        row = compare(op, "grad " + (name if per_tensor else _group(name)), grads[name], rgrads[name], tol)
        prev = groups.get(row.quantity)
        if prev is None or row.max_rel > prev.max_rel:
            groups[row.quantity] = row
    return rows + list(groups.values())


def check_model_adamw(config, B, T, steps=10, seed=0, backend="cpu", lr=1e-3, weight_decay=0.1,
                      max_norm=1.0, tol=1e-4, update_tol=2e-2, loss_chunk=0):
    """`steps` AdamW steps with clipping: every step's loss, and the final weights, against torch."""
    import torch
    model, ref = _model_and_ref(config, seed, backend, loss_chunk)
    w0 = model.state_dict()
    opt = AdamW(model, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    ropt = ref.adamw(lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    idx, targets = _batch(config, B, T, seed)
    ours, theirs = [], []
    for _ in range(steps):
        ours.append(model.forward(idx, targets, grad=True))  # as train steps: the loss and dlogits in one call
        model.zero_grad()
        model.backward()
        opt.step(grad_scale=clip_scale(grad_norm(model, opt.chunks), max_norm))
        ropt.zero_grad()
        _, rloss = ref(torch.from_numpy(idx), torch.from_numpy(targets))
        rloss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ropt.step()
        theirs.append(rloss.item())
    op = _model_op(config)
    rows = [compare(op, f"loss, AdamW step {i + 1}", a, b, tol) for i, (a, b) in enumerate(zip(ours, theirs))]
    # Weights: compare the updates (w_final - w_0) relative to the largest update. AdamW divides
    # each gradient by its own magnitude, so an element whose true gradient is ~1e-6 of the
    # tensor's largest (float32 rounding level) still moves by ~lr, in a direction rounding picks;
    # hence the looser update_tol. The optimizer itself is checked exactly in check_adamw.
    final = model.state_dict()
    worst = max((compare(op, f"weight updates, {steps} steps", final[n] - w0[n],
                         ref[n].detach().numpy() - w0[n], update_tol) for n in final),
                key=lambda r: r.max_rel)
    return rows + [worst]

