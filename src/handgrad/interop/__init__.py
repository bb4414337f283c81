"""Models in and out: Hugging Face (hf.py) and llm.c (llmc.py) formats, handgrad runs, and
`handgrad convert` (convert.py), all through one common form: (config, {name: float32 array})."""
