"""Typed configuration. GPTConfig describes the architecture; every field is checked at creation."""
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-2 architecture: pre-LN blocks, learned positions, lm_head tied to wte."""

    block_size: int = 1024  # longest sequence the model accepts (rows of wpe)
    vocab_size: int = 50257  # rows of wte; token ids lie in [0, vocab_size)
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads; must divide n_embd
    n_embd: int = 768  # width of the residual stream

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"model.{f.name} must be an integer, got {value!r}")
            if value <= 0:
                raise ValueError(f"model.{f.name} must be positive, got {value}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head}); "
                f"pick n_head from the divisors of n_embd"
            )

    def to_dict(self):
        return asdict(self)


MODEL_PRESETS = {
    "tiny": GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=2, n_embd=64),
    "mid": GPTConfig(block_size=256, vocab_size=8192, n_layer=6, n_head=8, n_embd=512),
    "gpt2-124m": GPTConfig(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768),
}
