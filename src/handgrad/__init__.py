"""handgrad: transformer training with every forward and backward pass written by hand.

Where things are (docs/ARCHITECTURE.md has the whole map):
    backends/cpu, backends/gpu   the ops, forward and backward side by side (Numba / Triton)
    models/                      model families (GPT-2), which only orchestrate the ops; decoding
    training/                    the trainer, optimizer, checkpoints, data parallel, the gpu's loop
    data/                        corpora, tokenizers, token shards
    interop/                     Hugging Face and llm.c formats
    bench/                       handgrad beside PyTorch: ops, training steps, loss curves
    machine.py                   cores, BLAS, the measured sgemm peak
    cli.py, sample.py, verify/   the commands; torch/ the ops as torch.autograd Functions
"""
__version__ = "0.1.0"  # first: data/prepare.py records it, and is imported below

from .config import GPTConfig  # noqa: E402
from .interop.load import from_pretrained  # noqa: E402
from .models.gpt2 import GPT  # noqa: E402

# GPT.from_pretrained(path, backend="cpu"): the format readers (interop/) build on the models, so
# models/gpt2.py cannot import them; the class method is attached here, where both are loaded.
GPT.from_pretrained = classmethod(lambda cls, path, backend="cpu": from_pretrained(path, backend))

__all__ = ["GPT", "GPTConfig", "from_pretrained", "__version__"]
