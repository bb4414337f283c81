"""What each `model.*` and `train.*` key of a run means: one line per key, and what its default
means where the default is a 0 or "" that stands for something else. The one source of
`handgrad train --help`'s key lines and of docs/CONFIG.md (`python3 tools/config_doc.py --write`;
tests/test_config_keys.py fails when the page is stale). The keys, their types and defaults are
config.py's ModelSection and TrainSection; a key added there needs its line here (a test checks)."""
from dataclasses import MISSING, fields

from .config import ARCH_KEYS, ARCHS, CHOICES, LORA_TARGETS, RUN_PRESETS, SECTIONS, default_ffn_hidden


def _lora_targets():
    return "; ".join(f"{arch}: {','.join(names)}" for arch, names in LORA_TARGETS.items())


# key: its description, or (its description, what its default means)
KEYS = {
    "model": {
        "arch": "Model family (handgrad.models); with --init-from, the model's",
        "n_layer": "Transformer blocks",
        "n_head": "Attention heads (llama, gemma3: query heads); must divide n_embd",
        "n_embd": "Width of the residual stream",
        "block_size": "Context length in tokens: the longest sequence the model takes, and training's T",
        "vocab_size": ("Rows of the embedding and the logits; more than the data's pads them (Qwen2: 151,936 "
                       "for 151,665 tokens), fewer is an error",
                       "the data's vocab_size (with --init-from, the model's)"),
        "n_kv_head": ("Key/value heads of grouped-query attention; must divide n_head (1: multi-query)",
                      "n_head (no grouping)"),
        "ffn_hidden": ("Width of the gated MLP, SwiGLU (gemma3: GeGLU): its gate and up projections each",
                       f"the multiple of 64 nearest 8/3 x n_embd ({default_ffn_hidden(64)} at n_embd 64)"),
        "rope_theta": "Base of the rotary position embedding's frequencies (RoPE's theta)",
        "norm_eps": "RMSNorm's epsilon",
        "tie_embeddings": "lm_head is embed_tokens (false: its own lm_head.weight)",
        "qkv_bias": "Biases on the q, k and v projections (Qwen2)",
        "rope_factor": ("Llama 3.x's RoPE scaling (rope_type llama3): frequencies whose wavelength exceeds "
                        "rope_original_max_position_embeddings / rope_low_freq_factor are divided by this, those "
                        "below ... / rope_high_freq_factor kept, those between blended", "no RoPE scaling"),
        "rope_low_freq_factor": "Llama 3.x's RoPE scaling: low_freq_factor (used where rope_factor is set)",
        "rope_high_freq_factor": "Llama 3.x's RoPE scaling: high_freq_factor, above rope_low_freq_factor",
        "rope_original_max_position_embeddings": "Llama 3.x's RoPE scaling: the context length the model was "
                                                 "pretrained at, before the scaling",
        "head_dim": ("Width of one attention head (Qwen3: 128, Gemma 3: 256, with q's width n_head x head_dim not "
                     "n_embd)",
                     "n_embd / n_head"),
        "qk_norm": "An RMSNorm over each head's q and k after their projections, before RoPE (Qwen3)",
        "dropout": ("Training only: dropout on the attention probabilities, each residual branch and the "
                    "embeddings, as nanoGPT's", "no dropout"),
        "sliding_window": "A local layer's window: a query attends its own position and the sliding_window - 1 "
                          "before it",
        "sliding_window_pattern": "Every sliding_window_pattern-th layer is global (full causal attention, "
                                  "rope_theta); the others are local (the window, rope_local_base_freq)",
        "query_pre_attn_scalar": ("The attention scores are q.k x query_pre_attn_scalar ** -0.5", "head_dim"),
        "rope_local_base_freq": "RoPE's base in the local (sliding-window) layers",
        "final_logit_softcapping": ("The logits as cap x tanh(logits / cap)", "no softcapping"),
        "vocab_pad": ("The lm_head's rows (GPT-2's tied wte) held padded with zero rows to a multiple of this, as "
                      "llm.c pads 50,257 to 50,304, so each row of logits has an aligned length; the loss, "
                      "sampling, checkpoints and exports use the real vocab_size (1: no padding)",
                      "64 for a GPT-2 trained in full on the gpu, else no padding"),
    },
    "train": {
        "batch_size": "Sequences per micro-batch (train.objective dpo: preference pairs, each a chosen and a rejected sequence)",
        "grad_accum_steps": "Micro-batches per optimizer step (a step's tokens: batch_size x block_size x this "
                            "x processes)",
        "max_steps": "Optimizer steps in the run",
        "lr": "Peak learning rate, reached after warmup",
        "min_lr": "Learning rate at the end of the cosine decay (at most lr)",
        "warmup_steps": "Steps of linear warmup from 0 to lr",
        "weight_decay": "AdamW's decoupled weight decay, on 2-D tensors only",
        "beta1": "AdamW's first-moment decay",
        "beta2": "AdamW's second-moment decay",
        "grad_clip": "Largest global gradient norm (a larger gradient is scaled down to it); 0: no clipping",
        "eval_interval": "Steps between validation losses (and eval_tasks' scores), and at the last step; 0: none",
        "eval_steps": "Validation batches per evaluation",
        "eval_tasks": ("Comma-separated benchmarks, as handgrad eval --tasks takes them: standard task names "
                       "(arc_easy, piqa, ...) or JSONL files or directories; scored at each evaluation",
                       "none (the validation loss alone)"),
        "eval_limit": ("Rows of each of eval_tasks scored at each evaluation", "every row"),
        "loss_chunk": ("Rows (of batch_size x block_size) whose logits the loss forms at once: the head's memory is "
                       "loss_chunk x vocab_size instead of the whole batch's, for one more head product", "all rows"),
        "recompute": ("Activations kept for the backward: none keeps every block's; block keeps each block's input "
                      "(and on Llama models the attention's results) and forms the rest again in the backward (the same "
                      "gradients, bit for bit, for one more forward of the blocks: on Llama models of their qkv and "
                      "MLP input products only); full keeps each block's input alone, as transformers' gradient "
                      "checkpointing does (on Llama models the attention and o_proj run again too; on GPT-2 it is "
                      "block)", "none"),
        "sample_interval": "Steps between text samples printed during training; 0: no samples",
        "sample_tokens": "Tokens per sample",
        "checkpoint_interval": "Steps between checkpoints; the last step and a Ctrl-C always save one; 0: those alone",
        "keep_checkpoints": "Newest checkpoints kept on disk (older ones are removed)",
        "log_interval": "Steps between log lines (metrics.jsonl records every step)",
        "seed": "Seeds the initial weights, the batches and the samples",
        "on_nan": "What a NaN or Inf loss or gradient does: stop (the last good checkpoint kept) or skip the batch",
        "dtype": "float32, or bfloat16 mixed precision (gpu: bf16 activations; cpu: bf16 products); trained "
                 "weights stay float32, a LoRA run's frozen base matrices are bf16 on the cpu",
        "cuda_graph": ("Replay each step as captured CUDA graphs: auto where the run allows them (--device gpu on "
                       "CUDA, one process, no dropout, not DPO), true to insist (refused where it cannot), false "
                       "never", "auto"),
        "zero_stage": ("Under torchrun: 1 shards the AdamW moments across the ranks (ZeRO stage 1)",
                       "plain data parallel (every rank holds all the moments)"),
        "threads": ("BLAS and Numba threads per process (--device cpu)",
                    "the libraries' own (every core) in one process; under torchrun, this machine's cores / "
                    "processes on it"),
        "dist_timeout": "Seconds a rank waits for the others before giving up (torchrun runs)",
        "log_to": "Also log the metrics to TensorBoard (RUN_DIR/tb) or Weights & Biases (offline unless set up)",
        "lora_rank": ("Rank of LoRA adapters on lora_targets, the base weights frozen",
                      "full fine-tuning (no adapters, every weight trains)"),
        "lora_alpha": ("LoRA's alpha: the adapters' output is scaled by lora_alpha / lora_rank", "2 x lora_rank"),
        "lora_targets": ("Comma-separated linears of every block that get adapters", f"every linear ({_lora_targets()})"),
        "lora_dropout": ("Dropout on the adapters' input (PEFT's lora_dropout)", "no dropout"),
        "lora_train_norms": "LoRA runs: also train the norm gains (and GPT-2's norm biases)",
        "lora_train_embeddings": "LoRA runs: also train the embeddings (and an untied lm_head)",
        "objective": ("What the run minimises: cross_entropy, the next token's (text, or chat data's assistant "
                      "tokens); dpo, DPO's sigmoid loss on preference data (prepare --format preference), batch_size "
                      "then counting pairs"),
        "dpo_beta": "DPO's beta: the strength of the pull towards the reference model (TRL's default 0.1)",
        "dpo_reference": ("Where DPO's reference log-probabilities come from: precompute, one pass of the starting "
                          "model over the data before the first step, kept in RUN_DIR/reference_logps.safetensors "
                          "(a forward per pair once); adapters_off, LoRA runs only, the model with its adapters off "
                          "beside each step (a forward per pair per step, nothing stored)"),
        "base_quant": ("LoRA runs on the cpu: the frozen base's block linears held quantized, each dequantized a "
                       "matrix at a time for its products: keep, a GGUF base's blocks as stored; q8_0 or q4_0, "
                       "quantized at load (the embeddings and norms stay as they are)", "none (held as loaded)"),
    },
}


def keys():
    """(section, name, type name, default) of every key, in the dataclasses' order."""
    return [(section, f.name, getattr(f.type, "__name__", str(f.type)), f.default)
            for section, cls in SECTIONS.items() for f in fields(cls) if f.default is not MISSING]


def shown(value):
    """A value as a config file or a flag writes it: true/false, "" for an empty string."""
    if isinstance(value, bool):
        return str(value).lower()
    return '""' if value == "" else str(value)


def description(section, name):
    """The key's one line, with the families it belongs to (where not both) and its words to choose from."""
    entry = KEYS[section][name]
    text = entry[0] if isinstance(entry, tuple) else entry
    if section == "model" and (archs := [a for a in ARCHS if name in ARCH_KEYS[a]]) != list(ARCHS):
        text = f"({' and '.join(archs)} only) {text}"
    key = f"{section}.{name}"
    return f"{text} (one of {', '.join(CHOICES[key])})" if key in CHOICES else text


def default_means(section, name):
    """What the key's default stands for, or None where the value says it."""
    entry = KEYS[section][name]
    return entry[1] if isinstance(entry, tuple) else None


def help_line(section, name, value):
    """`handgrad train --help`'s text for --section.name, `value` the default shown (a preset's, with
    --preset NAME): 'Rows of the embedding ... Default 0: the data's vocab_size ...'."""
    default = next(f.default for f in fields(SECTIONS[section]) if f.name == name)
    means = default_means(section, name) if value == default and type(value) is type(default) else None
    return f"{description(section, name)}. Default {shown(value)}{f': {means}' if means else ''}"


def _cell(text):
    return str(text).replace("|", "\\|")


def markdown():
    """docs/CONFIG.md: every key with its type, default and description, then the presets' values."""
    out = ["# Config keys", "",
           "<!-- generated by `python3 tools/config_doc.py --write` from src/handgrad/config_keys.py; "
           "do not edit -->", "",
           "A `handgrad train` run's `model.*` and `train.*` keys, set in this order, each on top of the last: "
           "the defaults below, `--preset NAME` (its values are in the last table), `--config FILE` (TOML, JSON "
           "or YAML, with a `[model]` and a `[train]` table), then `--model.KEY V` and `--train.KEY V` flags. "
           "`handgrad train --help` lists the same keys and descriptions; with `--preset NAME --help` it shows "
           "that preset's values.", "",
           "A flag is never abbreviated, and an unknown key is an error (exit status 2, one line) naming the key "
           "it most likely meant: `--train.max_step 5` gives `unrecognized arguments: --train.max_step 5 (did "
           "you mean --train.max_steps?)`. A file's unknown keys are named together, in one line naming the "
           "file: `run.toml: 2 unknown config keys: train.max_step (did you mean train.max_steps?), "
           "model.n_layers (did you mean model.n_layer?)`. These mistakes are reported before `--out`'s: a "
           "RUN_DIR that already holds checkpoints, or nothing to `--resume`.", ""]
    for section in SECTIONS:
        out += [f"## {section}.*", "", "| key | type | default | description |", "|---|---|---|---|"]
        for sec, name, typ, default in keys():
            if sec == section:
                means = default_means(sec, name)
                value = f"`{shown(default)}`" + (f": {means}" if means else "")
                out.append(f"| `{sec}.{name}` | {typ} | {_cell(value)} | {_cell(description(sec, name))} |")
        out.append("")
    names = list(RUN_PRESETS)
    out += ["## Presets", "", "The keys each `--preset` sets; a blank cell keeps the default.", "",
            "| key | " + " | ".join(f"`{n}`" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for section, name, _, _ in keys():
        values = [RUN_PRESETS[n].get(section, {}).get(name) for n in names]
        if any(v is not None for v in values):
            out.append(f"| `{section}.{name}` | " + " | ".join("" if v is None else shown(v) for v in values) + " |")
    return "\n".join(out) + "\n"
