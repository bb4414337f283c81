"""handgrad: GPT-2 training with every forward and backward pass written by hand."""
from .config import GPTConfig
from .model import GPT

__version__ = "0.1.0"
__all__ = ["GPT", "GPTConfig", "__version__"]
