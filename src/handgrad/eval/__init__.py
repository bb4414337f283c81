"""`handgrad eval`: zero-shot benchmarks scored as lm-evaluation-harness scores them. tasks.py reads
llm-foundry's JSONL rows into one form, score.py scores them (one prefill per query, its choices
continued from the KV cache), command.py is the command and its report."""
