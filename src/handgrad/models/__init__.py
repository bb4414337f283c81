"""Model families, by `model.arch`. Each is one module (gpt2.py, llama.py, gemma3.py); family.py says what a family
provides and holds what they share; decode.py is the KV-cache decoding and sampling they share."""
from . import gemma3, gpt2, llama
from .family import Family


FAMILIES = {f.arch: f for f in (gpt2.FAMILY, llama.FAMILY, gemma3.FAMILY)}


def get_family(arch) -> Family:
    """The family `model.arch` names, or a ValueError listing the ones there are."""
    if arch not in FAMILIES:
        raise ValueError(f"model.arch: unknown architecture {arch!r}; choose from {', '.join(FAMILIES)}")
    return FAMILIES[arch]


def family_of(config) -> Family:
    """The family whose architecture config `config` is (a GPTConfig, LlamaConfig or Gemma3Config)."""
    for family in FAMILIES.values():
        if isinstance(config, family.config):
            return family
    raise ValueError(f"not a model config: {type(config).__name__}")
