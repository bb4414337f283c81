"""Typed configuration. GPTConfig and LlamaConfig describe the two architectures (every field checked
at creation); RunConfig a training run, as `model.*` and `train.*` keys from presets, files and flags."""
import difflib
import math
from dataclasses import asdict, dataclass, field, fields

from .presets import RUN_PRESETS


def _check_heads(n_embd, n_head):
    """Both families split the residual stream into n_head heads of equal width."""
    if n_embd % n_head:
        raise ValueError(f"model.n_embd ({n_embd}) must be divisible by model.n_head ({n_head}); "
                         f"pick n_head from the divisors of n_embd")


def _check_positive_ints(config, names):
    """Each of config's fields `names` is an integer above 0 (a bool is not one)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"model.{name} must be an integer, got {value!r}")
        if value <= 0:
            raise ValueError(f"model.{name} must be positive, got {value}")


def _check_kv_heads(n_head, n_kv_head):
    """Grouped-query attention: each kv head serves the same number of query heads."""
    if n_head % n_kv_head:
        raise ValueError(f"model.n_head ({n_head}) must be divisible by model.n_kv_head "
                         f"({n_kv_head}); pick n_kv_head from the divisors of n_head")


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-2 architecture: pre-LN blocks, learned positions, lm_head tied to wte."""

    block_size: int = 1024  # longest sequence the model accepts (rows of wpe)
    vocab_size: int = 50257  # rows of wte; token ids lie in [0, vocab_size)
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads; must divide n_embd
    n_embd: int = 768  # width of the residual stream

    def __post_init__(self):
        _check_positive_ints(self, [f.name for f in fields(self)])
        _check_heads(self.n_embd, self.n_head)

    def to_dict(self):
        return asdict(self)


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-style architecture: pre-norm blocks with RMSNorm, rotary positions (Hugging Face's
    rotate_half convention), a SwiGLU MLP, grouped-query attention, no biases but Qwen2's q/k/v;
    Qwen3's per-head RMSNorm of q and k (qk_norm) and a head width of its own (head_dim)."""

    block_size: int = 2048  # longest sequence the model accepts (RoPE has no table limit; training's T)
    vocab_size: int = 32000  # rows of embed_tokens
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # query heads; must divide n_embd
    n_embd: int = 768  # width of the residual stream
    n_kv_head: int = 12  # key/value heads; must divide n_head (n_head: ordinary attention, 1: multi-query)
    ffn_hidden: int = 2048  # width of the SwiGLU MLP (gate and up each)
    rope_theta: float = 10000.0  # RoPE base
    norm_eps: float = 1e-5  # RMSNorm's epsilon
    tie_embeddings: bool = True  # lm_head is embed_tokens (else its own lm_head.weight)
    qkv_bias: bool = False  # q/k/v projections with bias (Qwen2)
    rope_factor: float = 0.0  # Llama 3.x's RoPE scaling (rope type "llama3", transformers' names); 0: none
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    head_dim: int = 0  # width of one attention head; 0: n_embd / n_head (Qwen3 sets its own: 128 at n_embd 1024, 16 heads)
    qk_norm: bool = False  # an RMSNorm over each head's q and k, before RoPE (Qwen3)

    def __post_init__(self):
        derived = self.head_dim == 0
        if derived:  # the derived width, stored: every reader sees one number
            _check_heads(self.n_embd, self.n_head)
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        _check_positive_ints(self, ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "n_kv_head",
                                    "ffn_hidden", "rope_original_max_position_embeddings", "head_dim"))
        _check_kv_heads(self.n_head, self.n_kv_head)
        if self.head_dim % 2:
            width = f"model.n_embd / model.n_head = {self.head_dim}" if derived else f"model.head_dim = {self.head_dim}"
            raise ValueError(f"{width} must be even (RoPE rotates pairs); pick another "
                             f"{'n_head' if derived else 'head_dim'}")
        for name in ("rope_theta", "norm_eps"):
            if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) > 0):
                raise ValueError(f"model.{name} must be a positive number, got {getattr(self, name)!r}")
        if self.rope_factor < 0 or self.rope_factor and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(f"model.rope_factor {self.rope_factor!r} (llama3 RoPE scaling) needs factor > 0 and 0 < "
                             f"rope_low_freq_factor < rope_high_freq_factor, got {self.rope_scaling[1:3]}")
        for name in ("tie_embeddings", "qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model.{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def rope_scaling(self):  # None, or (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
        return (self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                self.rope_original_max_position_embeddings) if self.rope_factor else None

    def to_dict(self):
        return asdict(self)


@dataclass(frozen=True)
class Gemma3Config:
    """A Gemma 3 text architecture: Llama's block with RMSNorms that scale by (1 + w) before and after
    both halves (four a block), q/k norms, a tanh-GELU gated MLP (GeGLU), embeddings scaled by
    sqrt(n_embd) and tied to the lm_head, attention scaled by query_pre_attn_scalar ** -0.5, and
    local layers (causal attention inside a window of sliding_window positions, RoPE base
    rope_local_base_freq) between global ones (full causal attention, rope_theta): layer l is global
    where (l + 1) % sliding_window_pattern == 0, transformers' default layer_types."""

    block_size: int = 2048
    vocab_size: int = 262144
    n_layer: int = 18
    n_head: int = 4
    n_embd: int = 640
    n_kv_head: int = 1
    ffn_hidden: int = 2048  # width of the GeGLU MLP (gate and up each)
    head_dim: int = 256  # explicit: Gemma's heads are wider than n_embd / n_head
    rope_theta: float = 1e6  # the global layers' RoPE base
    rope_local_base_freq: float = 10000.0  # the local layers' RoPE base
    norm_eps: float = 1e-6
    sliding_window: int = 512  # a local layer's query attends its own and the sliding_window - 1 positions before it
    sliding_window_pattern: int = 6  # every sliding_window_pattern-th layer is global
    query_pre_attn_scalar: float = 256.0  # the attention scores are q.k * query_pre_attn_scalar ** -0.5
    final_logit_softcapping: float = 0.0  # logits <- cap tanh(logits / cap); 0: none

    # what Llama's code reads of a config, fixed for Gemma 3
    tie_embeddings = True
    qkv_bias = False
    qk_norm = True
    rope_scaling = None

    def __post_init__(self):
        _check_positive_ints(self, ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "n_kv_head",
                                    "ffn_hidden", "head_dim", "sliding_window", "sliding_window_pattern"))
        _check_heads(self.n_embd, self.n_head)  # as transformers' Gemma3TextConfig checks, though head_dim is its own
        _check_kv_heads(self.n_head, self.n_kv_head)
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim = {self.head_dim} must be even (RoPE rotates pairs); pick another head_dim")
        for name in ("rope_theta", "rope_local_base_freq", "norm_eps", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"model.{name} must be a positive number, got {value!r}")
        if isinstance(self.final_logit_softcapping, bool) or not (
                isinstance(self.final_logit_softcapping, (int, float)) and self.final_logit_softcapping >= 0):
            raise ValueError(f"model.final_logit_softcapping must be >= 0 (0: none), got {self.final_logit_softcapping!r}")

    def is_global(self, l):
        """Whether layer l attends over every earlier position (else within sliding_window)."""
        return (l + 1) % self.sliding_window_pattern == 0

    @property
    def layer_types(self):
        """transformers' layer_types: "full_attention" or "sliding_attention" per layer."""
        return ["full_attention" if self.is_global(l) else "sliding_attention" for l in range(self.n_layer)]

    def to_dict(self):
        return asdict(self)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA fine-tuning (train.lora_*): rank-r adapters y = x W + (alpha / r) dropout(x) A B on the
    `targets` linears of every block (the family's short names: models/gpt2.py, models/llama.py),
    their base weights frozen; norms and embeddings frozen unless train_norms / train_embeddings.
    base_quant: how the frozen base's block linears are held (train.base_quant): none (as loaded),
    keep (a GGUF base's blocks as stored), q8_0 or q4_0 (quantized at load)."""

    rank: int
    alpha: float
    targets: tuple
    dropout: float = 0.0
    train_norms: bool = False
    train_embeddings: bool = False
    base_quant: str = "none"

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"train.lora_rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"train.lora_alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"train.lora_dropout must be in [0, 1), got {self.dropout!r}")
        if not self.targets:
            raise ValueError("train.lora_targets names no linear")
        if self.base_quant not in CHOICES["train.base_quant"]:
            raise ValueError(f"train.base_quant must be one of {', '.join(CHOICES['train.base_quant'])}, "
                             f"got {self.base_quant!r}")

    @property
    def scale(self):
        return self.alpha / self.rank

    def to_dict(self):
        return dict(asdict(self), targets=list(self.targets))


# ---------------------------------------------------------------- training runs
@dataclass
class ModelSection:
    """The architecture a run trains; vocab_size is the prepared data's unless set (a pretrained
    model's padded embedding, from --init-from). What each key means: config_keys.py (a key added
    here needs its line there; `handgrad train --help` and docs/CONFIG.md show them)."""

    arch: str = "gpt2"
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    block_size: int = 64
    vocab_size: int = 0
    n_kv_head: int = 0
    ffn_hidden: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    rope_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    head_dim: int = 0
    qk_norm: bool = False
    dropout: float = 0.0
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    query_pre_attn_scalar: float = 0.0
    rope_local_base_freq: float = 10000.0
    final_logit_softcapping: float = 0.0
    vocab_pad: int = 0


@dataclass
class TrainSection:
    """The optimisation loop. Steps count optimizer updates. What each key means: config_keys.py."""

    batch_size: int = 8
    grad_accum_steps: int = 1
    max_steps: int = 200
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    eval_interval: int = 50
    eval_steps: int = 10
    eval_tasks: str = ""
    eval_limit: int = 0
    loss_chunk: int = 0
    recompute: str = "none"
    sample_interval: int = 100
    sample_tokens: int = 200
    checkpoint_interval: int = 100
    keep_checkpoints: int = 3
    log_interval: int = 10
    seed: int = 1337
    on_nan: str = "stop"
    dtype: str = "float32"
    cuda_graph: str = "auto"
    zero_stage: int = 0
    threads: int = 0
    dist_timeout: float = 300.0
    log_to: str = "none"
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: str = ""
    lora_dropout: float = 0.0
    lora_train_norms: bool = False
    lora_train_embeddings: bool = False
    objective: str = "cross_entropy"
    dpo_beta: float = 0.1
    dpo_reference: str = "precompute"
    base_quant: str = "none"


SECTIONS = {"model": ModelSection, "train": TrainSection}
ARCHS = ("gpt2", "llama", "gemma3")  # the model families' names, as handgrad.models.FAMILIES lists them (a test checks)
# model.* keys each family has (the rest is the other family's: given explicitly, an error)
_GEMMA3_ONLY = ("sliding_window", "sliding_window_pattern", "query_pre_attn_scalar", "rope_local_base_freq",
                "final_logit_softcapping")
ARCH_KEYS = {"gpt2": ("arch", "n_layer", "n_head", "n_embd", "block_size", "vocab_size", "dropout", "vocab_pad"),
             "llama": tuple(f.name for f in fields(ModelSection) if f.name not in _GEMMA3_ONLY),
             "gemma3": ("arch", "n_layer", "n_head", "n_embd", "block_size", "vocab_size", "n_kv_head", "ffn_hidden",
                        "head_dim", "rope_theta", "norm_eps", "vocab_pad") + _GEMMA3_ONLY}
# the keys that take one of a few words: checked at load time, listed by `handgrad train --help`
# train.lora_targets' names per family, in block order (models/gpt2.py and models/llama.py map them to modules)
LORA_TARGETS = {"gpt2": ("c_attn", "c_proj", "c_fc", "mlp.c_proj"), "llama": ("q", "k", "v", "o", "gate", "up", "down"),
                "gemma3": ("q", "k", "v", "o", "gate", "up", "down")}
CHOICES = {"model.arch": ARCHS, "train.on_nan": ("stop", "skip"), "train.dtype": ("float32", "bfloat16"),
           "train.log_to": ("none", "tensorboard", "wandb"), "train.recompute": ("none", "block", "full"),
           "train.objective": ("cross_entropy", "dpo"), "train.dpo_reference": ("precompute", "adapters_off"),
           "train.base_quant": ("none", "keep", "q8_0", "q4_0"), "train.cuda_graph": ("auto", "true", "false")}


@dataclass
class RunConfig:
    """A training run: `model.*` and `train.*` keys, as in config files and --section.key flags."""

    model: ModelSection = field(default_factory=ModelSection)
    train: TrainSection = field(default_factory=TrainSection)
    given: set = field(default_factory=set, repr=False, compare=False)  # model.* keys set by a preset, file or flag

    def to_dict(self):
        """model.* (the arch's own keys) and train.*, as config.json and checkpoints hold them."""
        model = {k: v for k, v in asdict(self.model).items() if k in ARCH_KEYS.get(self.model.arch, ())}
        return {"model": model, "train": asdict(self.train)}

    def gpt_config(self, vocab_size):
        """The architecture config of model.arch's family (GPTConfig, LlamaConfig or Gemma3Config), with the
        data's vocab_size, or model.vocab_size where set (never below the data's)."""
        m = self.model
        if m.vocab_size and m.vocab_size < vocab_size:
            raise ConfigError(f"model.vocab_size: {m.vocab_size} is below the data's vocab_size {vocab_size} (the "
                              f"data has token ids the model has no embedding for); prepare the data with the "
                              f"model's tokenizer, or raise model.vocab_size")
        vocab_size = m.vocab_size or vocab_size
        if m.arch == "llama":  # model.* as they are, but the three whose 0 stands for something
            keys = {k: getattr(m, k) for k in ARCH_KEYS["llama"] if k not in ("arch", "dropout", "vocab_pad")}
            return LlamaConfig(**dict(keys, vocab_size=vocab_size, n_kv_head=m.n_kv_head or m.n_head,
                                      ffn_hidden=m.ffn_hidden or default_ffn_hidden(m.n_embd)))
        if m.arch == "gemma3":  # n_kv_head, ffn_hidden, head_dim and query_pre_attn_scalar: 0 stands for something
            keys = {k: getattr(m, k) for k in ARCH_KEYS["gemma3"] if k not in ("arch", "vocab_pad")}
            head_dim = m.head_dim or (m.n_embd // m.n_head)
            return Gemma3Config(**dict(keys, vocab_size=vocab_size, n_kv_head=m.n_kv_head or m.n_head,
                                       head_dim=head_dim, ffn_hidden=m.ffn_hidden or default_ffn_hidden(m.n_embd),
                                       query_pre_attn_scalar=m.query_pre_attn_scalar or float(head_dim)))
        return GPTConfig(block_size=m.block_size, vocab_size=vocab_size, n_layer=m.n_layer,
                         n_head=m.n_head, n_embd=m.n_embd)

    def vocab_pad(self, backend, lora=False):
        """model.vocab_pad as the model takes it (models/family.py): the lm_head's rows padded to a multiple
        of it. 0, the default, is 64 where a GPT-2 trains in full on the gpu (llm.c's padding of 50,257 to
        50,304: aligned logits rows for cuBLAS's tensor-core kernels), else 1 (none). lora: the run trains
        adapters (train.lora_rank, or an adapter it continues)."""
        m, t = self.model, self.train
        lora = lora or bool(t.lora_rank)
        if m.vocab_pad > 1 and lora:
            raise ConfigError(f"model.vocab_pad {m.vocab_pad}: a padded vocabulary needs the lm_head to train, and a "
                              f"LoRA run's is frozen; drop model.vocab_pad (or set it to 1)")
        if m.vocab_pad:
            return m.vocab_pad
        return 64 if backend == "gpu" and m.arch == "gpt2" and not lora else 1

    def lora_config(self):
        """train.lora_* as a LoRAConfig, or None for full fine-tuning (lora_rank 0)."""
        t = self.train
        if not t.lora_rank:
            return None
        known = LORA_TARGETS[self.model.arch]  # checked here: --init-from sets model.arch after the config loads
        targets = tuple(s.strip() for s in t.lora_targets.split(",") if s.strip()) or known
        for name in targets:
            if name not in known:
                raise ConfigError(f"train.lora_targets: {name!r} is not a linear of model.arch {self.model.arch}; "
                                  f"choose from {','.join(known)}")
        try:
            return LoRAConfig(rank=t.lora_rank, alpha=t.lora_alpha or 2.0 * t.lora_rank, targets=targets,
                              dropout=t.lora_dropout, train_norms=t.lora_train_norms,
                              train_embeddings=t.lora_train_embeddings, base_quant=t.base_quant)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def default_ffn_hidden(n_embd):
    """The multiple of 64 nearest 8/3 n_embd (Llama's SwiGLU width, for plain configs)."""
    return max(64, 64 * round(8 * n_embd / 3 / 64))


class ConfigError(ValueError):
    """A bad key or value in a run config; the message names the key."""


def _coerce(key, value, typ):
    """A value from a file or the command line, as the field's type, or a ConfigError naming key."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        try:
            f = float(value) if isinstance(value, (float, str)) else None
        except ValueError:
            f = None
        if f is not None and f.is_integer():
            return int(f)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if not math.isfinite(number):  # nan or inf would surface only later, as a NaN loss
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return number
    if typ is str:
        return str(value)
    raise ConfigError(f"{key}: unsupported type {typ}")


_FIELD_TYPES = {sec: {f.name: {"int": int, "float": float, "bool": bool, "str": str}.get(f.type, f.type)
                      for f in fields(cls)} for sec, cls in SECTIONS.items()}


def close_key(key):
    """The known key a mistyped one most likely meant, or None: 'train.max_step' -> 'train.max_steps'
    (the name against its section's names), 'model.lr' and a bare 'lr' -> 'train.lr' (the same name
    in another section), 'trian.lr' -> 'train.lr' (against every key)."""
    section, dot, name = key.partition(".")
    if not dot:
        section, name = "", key
    same_name = [f"{s}.{name}" for s in SECTIONS if name in _FIELD_TYPES[s]]
    if section in SECTIONS:
        close = difflib.get_close_matches(name, list(_FIELD_TYPES[section]), n=1)
        return f"{section}.{close[0]}" if close else next(iter(same_name), None)
    close = same_name or difflib.get_close_matches(key, [f"{s}.{n}" for s in SECTIONS for n in _FIELD_TYPES[s]], n=1)
    return next(iter(close), None)


def _unknown_keys(keys, sections, source):
    """One line naming every unknown key (each with close_key's guess) and section of one source."""
    notes = [(key, f"did you mean {close_key(key)}?" if close_key(key) else None) for key in keys]
    notes += [(name, f"unknown section: sections are {', '.join(SECTIONS)}") for name in sections]
    known = ", ".join(f"{s}.{n}" for s in SECTIONS for n in _FIELD_TYPES[s])
    tail = f"; known keys: {known}" if any(note is None for _, note in notes) else ""
    if len(notes) == 1:
        name, note = notes[0]
        if sections:
            return f"{name}: unknown section ({source}); sections are {', '.join(SECTIONS)}"
        return f"{name}: unknown config key ({source}){'; ' + note if note else tail}"
    named = ", ".join(f"{name} ({note})" if note else name for name, note in notes)
    return f"{source}: {len(notes)} unknown config keys: {named}{tail}"


def apply_overrides(config, overrides, source="override"):
    """Set `section.key` values (a flat dict, or nested {section: {key: value}}) on a RunConfig. Every
    unknown key and section of `overrides` is named in one ConfigError, before any value is set."""
    flat, sections = {}, []
    for k, v in overrides.items():
        if isinstance(v, dict):
            if k not in SECTIONS:
                sections.append(k)
                continue
            flat.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            flat[k] = v
    unknown = [key for key in flat if key.partition(".")[2] not in _FIELD_TYPES.get(key.partition(".")[0], ())]
    if unknown or sections:
        raise ConfigError(_unknown_keys(unknown, sections, source))
    for key, value in flat.items():
        section, _, name = key.partition(".")
        setattr(getattr(config, section), name, _coerce(key, value, _FIELD_TYPES[section][name]))
        if section == "model" and source != "saved config":
            config.given.add(name)
    return config


def validate_run_config(config):
    """Range checks, each failing with the key's name."""
    m, t = config.model, config.train
    if m.arch not in ARCHS:
        raise ConfigError(f"model.arch: unknown architecture {m.arch!r}; choose from {', '.join(ARCHS)}")
    foreign = sorted(config.given - set(ARCH_KEYS[m.arch]))
    if foreign:
        raise ConfigError(f"model.{foreign[0]}: has no meaning for model.arch {m.arch} (it is another family's); "
                          f"drop it, or set model.arch")
    for key in ("n_layer", "n_head", "n_embd", "block_size"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key}: must be positive, got {getattr(m, key)}")
    if m.vocab_size < 0:
        raise ConfigError(f"model.vocab_size: must be >= 0 (0 = the data's), got {m.vocab_size}")
    try:
        config.gpt_config(1)  # the family's own checks: n_head divides n_embd, and Llama's even head size, ...
    except ValueError as e:
        raise ConfigError(str(e)) from None
    # a yes/no word as the bool keys take it (a config file's true is read as "True"); any other word
    # is left for the choices' check below, which names them
    t.cuda_graph = str(t.cuda_graph).lower()
    if t.cuda_graph != "auto":
        try:
            t.cuda_graph = "true" if _coerce("train.cuda_graph", t.cuda_graph, bool) else "false"
        except ConfigError:
            pass
    for key in ("log_to", "recompute", "dtype", "objective", "dpo_reference", "base_quant", "cuda_graph"):
        if getattr(t, key) not in CHOICES[f"train.{key}"]:
            raise ConfigError(f"train.{key}: must be one of {', '.join(CHOICES['train.' + key])}, got {getattr(t, key)!r}")
    for key in ("batch_size", "grad_accum_steps", "max_steps", "eval_steps", "keep_checkpoints", "log_interval"):
        if getattr(t, key) <= 0:
            raise ConfigError(f"train.{key}: must be positive, got {getattr(t, key)}")
    for key in ("warmup_steps", "eval_interval", "eval_limit", "loss_chunk", "sample_interval", "sample_tokens",
                "checkpoint_interval", "seed", "lr", "min_lr", "weight_decay", "grad_clip"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}: must be >= 0, got {getattr(t, key)}")
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr ({t.min_lr}) must not exceed train.lr ({t.lr})")
    if t.zero_stage not in (0, 1):
        raise ConfigError(f"train.zero_stage: must be 0 (plain data parallel) or 1 (sharded AdamW moments), "
                          f"got {t.zero_stage}")
    if not t.dist_timeout > 0:
        raise ConfigError(f"train.dist_timeout: must be a positive number of seconds, got {t.dist_timeout}")
    if t.base_quant != "none" and not t.lora_rank:
        raise ConfigError(f"train.base_quant {t.base_quant}: a base held quantized cannot train, so it needs LoRA "
                          f"adapters over it (set train.lora_rank, e.g. 8), or train.base_quant none for a full "
                          f"fine-tune")
    if not t.dpo_beta > 0:
        raise ConfigError(f"train.dpo_beta: must be > 0, got {t.dpo_beta}")
    if t.on_nan not in ("skip", "stop"):
        raise ConfigError(f"train.on_nan: must be skip or stop, got {t.on_nan!r}")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(t, key) < 1:
            raise ConfigError(f"train.{key}: must be in [0, 1), got {getattr(t, key)}")
    if m.vocab_pad < 0:
        raise ConfigError(f"model.vocab_pad: must be >= 0 (0 = automatic, 1 = no padding), got {m.vocab_pad}")
    for key, value in (("model.dropout", m.dropout), ("train.lora_dropout", t.lora_dropout)):
        if not 0 <= value < 1:
            raise ConfigError(f"{key}: must be in [0, 1), got {value}")
    for key, zero in (("threads", "automatic"), ("lora_rank", "full fine-tuning"), ("lora_alpha", "2 x lora_rank")):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}: must be >= 0 (0 = {zero}), got {getattr(t, key)}")
    return config


def read_config_file(path):
    """A TOML, JSON or YAML file of {section: {key: value}}."""
    import json
    import pathlib
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                          f"save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
    if p.suffix not in (".toml", ".json", ".yaml", ".yml"):
        raise ConfigError(f"{path}: config files must end in .toml, .json, .yaml or .yml")
    try:
        if p.suffix == ".toml":
            import tomllib
            data = tomllib.loads(text)
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml
            data = yaml.safe_load(text) or {}
    except Exception as e:  # each parser raises its own error type
        raise ConfigError(f"{path}{_where(e)}: cannot parse: {_first_line(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
    return data


def _where(e):
    """':LINE:COLUMN' (1-based) of a YAML or JSON parse error, or '' (TOML's message says it)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)  # yaml.MarkedYAMLError
    if mark is not None:
        return f":{mark.line + 1}:{mark.column + 1}"
    if hasattr(e, "lineno") and hasattr(e, "colno"):  # json.JSONDecodeError
        return f":{e.lineno}:{e.colno}"
    return ""


def _first_line(e):
    """A parser's message as one line: YAML's `problem` (its str() adds the quoted source and a
    caret on further lines), else the message up to its first line break."""
    problem = getattr(e, "problem", None)
    if problem:
        context = getattr(e, "context", None)
        return f"{context}: {problem}" if context else problem
    return (getattr(e, "msg", None) or str(e)).splitlines()[0]


def load_run_config(preset=None, config_file=None, overrides=None, base=None):
    """Defaults, then `base` (a saved run's config), the preset, the file, and command-line
    overrides, each on top of the last; validated."""
    config = RunConfig()
    if base is not None:
        apply_overrides(config, base, "saved config")
    return validate_run_config(apply_sources(config, preset, config_file, overrides))


def apply_sources(config, preset=None, config_file=None, overrides=None):
    """The preset, the file and the command-line overrides on config, each on top of the last: the
    preset's name, the file, every key and each value's type checked (the ranges are
    validate_run_config's, once the sources are all applied)."""
    if preset is not None:
        if preset not in RUN_PRESETS:
            raise ConfigError(f"--preset {preset}: unknown preset; choose from {', '.join(RUN_PRESETS)}")
        apply_overrides(config, RUN_PRESETS[preset], f"preset {preset}")
    if config_file is not None:
        apply_overrides(config, read_config_file(config_file), str(config_file))
    if overrides:
        apply_overrides(config, overrides, "command line")
    return config
