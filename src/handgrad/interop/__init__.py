"""Models in and out: Hugging Face (hf.py, hf_llama.py), llm.c (llmc.py), llama2.c (llama2c.py) and
PEFT (peft.py) formats and handgrad's own checkpoints (checkpoint.py), all through one common form:
(config, {name: float32 array}); load.py reads any of them, `handgrad convert` (convert.py) writes."""
