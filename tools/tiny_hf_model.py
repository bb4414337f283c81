"""A small random Hugging Face model to try `--init-from`, `prepare --tokenizer`, chat fine-tuning
and `convert --format hf` on a machine that cannot download a published one (README, "Fine-tune a
published model"). It has the layout of the real thing, not its knowledge:

* a byte-level BPE tokenizer trained here on the corpus given (Hugging Face `tokenizers`), with
  SmolLM2's special tokens (<|endoftext|>, <|im_start|>, <|im_end|>) and its ChatML chat template;
* a LlamaForCausalLM (or, with --qwen2, a Qwen2ForCausalLM with q/k/v biases; with --qwen3, a
  Qwen3ForCausalLM with q/k norms and heads 64 wide over hidden 128) with random weights,
  made and saved by `transformers` (`save_pretrained`), in bfloat16 as published models are;
* with --pad-vocab N, an embedding of N rows above the tokenizer's size, as Qwen2 pads its own.

    python tools/tiny_hf_model.py OUT_DIR --corpus SOURCE... [--vocab-size 2048] [--qwen2 | --qwen3] [--pad-vocab N]
                                     [--chats FILE]

Needs the test extra (torch, transformers): pip install -e ".[test]".
"""
import argparse
import json
import sys
from pathlib import Path

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")  # SmolLM2-Instruct's
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus_texts(specs):
    """The documents' texts of handgrad prepare's SOURCE arguments (files, globs, shakespeare, ...)."""
    from handgrad.data.sources import iter_documents, resolve_sources
    return [doc.text for doc in iter_documents(resolve_sources(specs))]


def train_tokenizer(texts, vocab_size, out):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
              "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>", "model_max_length": 2048,
              "clean_up_tokenization_spaces": False, "chat_template": CHATML}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.get_vocab_size()


def write_chats(texts, path, n=2000):
    """n conversations from consecutive non-empty lines of the corpus: "Next line: A" -> "B"."""
    lines = [line.strip() for text in texts for line in text.splitlines() if line.strip()]
    with open(path, "w", encoding="utf-8") as f:
        for a, b in list(zip(lines, lines[1:]))[:n]:
            messages = [{"role": "user", "content": f"Next line: {a}"}, {"role": "assistant", "content": b}]
            f.write(json.dumps({"messages": messages}) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--corpus", nargs="+", required=True, metavar="SOURCE",
                   help="text to train the tokenizer on, as handgrad prepare's SOURCE (files, globs, shakespeare)")
    p.add_argument("--vocab-size", type=int, default=2048, help="the tokenizer's size (default 2048)")
    p.add_argument("--pad-vocab", type=int, default=0, help="embedding rows, if above the tokenizer's size")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--qwen2", action="store_true", help="a Qwen2ForCausalLM (q/k/v biases) instead of a Llama")
    kind.add_argument("--qwen3", action="store_true", help="a Qwen3ForCausalLM (q/k norms, head_dim 64) instead of a Llama")
    p.add_argument("--chats", type=Path, default=None, metavar="FILE",
                   help="also write FILE: conversations in JSONL (one line each), a user giving a line of the "
                        "corpus and the assistant answering with the next one")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    try:
        import torch
        import transformers
    except ImportError as e:
        sys.exit(f"error: {Path(__file__).name} needs torch and transformers ({e.name or e} is not installed): "
                 f"pip install -e '.[test]'")

    args.out.mkdir(parents=True)
    texts = corpus_texts(args.corpus)
    n_tokens = train_tokenizer(texts, args.vocab_size, args.out)
    vocab = max(n_tokens, args.pad_vocab)
    # SmolLM2-135M's shape, narrowed: 4 layers of 128 wide, 4 query heads sharing 2 key/value heads;
    # rope_theta 10000 (Llama 2's and the TinyStories Llamas'), the one llama2.c's run.c can run
    fields = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    if args.qwen3:  # Qwen3's heads are wider than hidden / heads (128 over 1024 / 16 in Qwen3-0.6B)
        cls, cfg = transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**fields, head_dim=64)
    elif args.qwen2:
        cls, cfg = transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**fields)
    else:
        cls, cfg = transformers.LlamaForCausalLM, transformers.LlamaConfig(**fields)
    from handgrad.torch_ref import quiet_transformers
    torch.manual_seed(args.seed)
    with quiet_transformers():  # no "Writing model shards" bar before this tool's own line
        model = cls(cfg)
        model.to(torch.bfloat16).save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    if args.chats is not None:
        write_chats(texts, args.chats)
    print(f"wrote {args.out}: a random {cls.__name__} ({n / 1e6:.2f}M parameters, vocab_size {vocab}) and a "
          f"{n_tokens}-token BPE tokenizer with a ChatML chat template")


if __name__ == "__main__":
    main()
