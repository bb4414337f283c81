"""Data: corpus readers (sources.py), tokenizers (tokenizer.py), llm.c token shards and the
training Dataset (shards.py), and `handgrad prepare` (prepare.py)."""
