"""Fine-tuning on conversations (data/chat.py): the chat template rendered as transformers renders
it, the mask of assistant tokens against transformers' own, the loss over assistant tokens only
(against numpy, and unmoved by what follows the last reply), prepare's one-line refusals, and
`train` + `sample --chat` stopping at the end-of-turn token."""
import io
import shutil
import json
import sys

import numpy as np
import pytest

from handgrad.cli import main as cli
from handgrad.data import chat, chat_data
from handgrad.data.chat import load_chat_format
from handgrad.data.chat_data import ChatDataset
from handgrad.data.prepare import prepare
from handgrad.data.sources import DataError
from handgrad.models.llama import Llama
from handgrad.sample import SEPARATOR
from handgrad.config import LlamaConfig
from handgrad.interop.checkpoint import load_model, read_state, resolve
from handgrad.interop.load import model_sampling

transformers = pytest.importorskip("transformers")

WORDS = ("hello there how are you today fine thank very much the quick brown fox jumps over lazy dog "
         "what is your name my a cat sat on mat yes no maybe please tell me story").split()
SPECIALS = ["<|im_start|>", "<|im_end|>", "</s>", "<s>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# ChatML with transformers' {% generation %} marker around what the model must learn
CHATML_GEN = ("{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
              "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
              "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
          "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
          "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
          "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
          "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
          "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
MODEL = ["--preset", "llama-char", "--model.n_layer", "2", "--model.n_embd", "48", "--model.n_head", "6",
         "--model.n_kv_head", "2", "--model.ffn_hidden", "72", "--model.block_size", "48", "--train.batch_size", "4",
         "--train.sample_interval", "0", "--train.eval_interval", "0", "--train.warmup_steps", "1"]


def sentence(rng, lo=2, hi=6):
    return " ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi)))).capitalize() + "."


def conversations(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": sentence(rng)}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            msgs += [{"role": "user", "content": sentence(rng)}, {"role": "assistant", "content": sentence(rng)}]
        out.append(msgs)
    return out


def write_jsonl(path, convs):
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    return path


def model_dir(root, template, eos, specials=SPECIALS):
    """A Hugging Face tokenizer directory: a byte-level BPE trained here, with chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = np.random.default_rng(1)
    tok.train_from_iterator([sentence(rng, 3, 12) + " user assistant system" for _ in range(300)], trainer=trainer)
    root.mkdir(parents=True)
    tok.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": eos}
    if template is not None:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {"chatml": model_dir(root / "chatml", CHATML, "<|im_end|>"),
            "chatml_gen": model_dir(root / "chatml_gen", CHATML_GEN, "<|im_end|>"),
            "llama2": model_dir(root / "llama2", LLAMA2, "</s>"),
            "chatml_default": model_dir(root / "chatml_default", None, "<|im_end|>"),
            "plain": model_dir(root / "plain", None, "</s>", specials=["</s>", "<s>"]),
            "root": root}


@pytest.fixture(scope="module")
def data(dirs):
    """A chat data directory of 40 conversations (ChatML), block size 48."""
    src = write_jsonl(dirs["root"] / "chats.jsonl", conversations(40))
    prepare([str(src)], dirs["root"] / "data", tokenizer=str(dirs["chatml"]), format="chat", block_size=48,
            val_fraction=0.2, seed=3)
    return dirs["root"] / "data"


def hf_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


def runs(mask):
    """The [start, end) index ranges of the 1s in a 0/1 mask."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return list(zip(edges[::2], edges[1::2]))


# ---------------------------------------------------------------- rendering and the mask
@pytest.mark.parametrize("name", ["chatml", "llama2"])
def test_rendering_and_tokens_equal_transformers(dirs, name):
    fmt, ref = load_chat_format(dirs[name]), hf_tokenizer(dirs[name])
    for msgs in conversations(6):  # with system turns too (Llama 2 folds them into the first user turn)
        assert fmt.render(msgs) == ref.apply_chat_template(msgs, tokenize=False)
        assert fmt.render(msgs[:-1], True) == ref.apply_chat_template(msgs[:-1], tokenize=False,
                                                                       add_generation_prompt=True)
        ids, _ = fmt.encode(msgs)
        expect = ref.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
        assert ids.tolist() == list(expect)


def test_mask_equals_transformers_assistant_mask(dirs):
    """transformers marks the characters inside {% generation %} (content + <|im_end|>); ours is
    found prefix by prefix from the same template, which we render ignoring the marker."""
    fmt, ref = load_chat_format(dirs["chatml_gen"]), hf_tokenizer(dirs["chatml_gen"])
    assert fmt.end_of_turn == "<|im_end|>"
    for msgs in conversations(8, seed=5):
        ids, mask = fmt.encode(msgs)
        out = ref.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist() == list(out["input_ids"])
        assert mask.tolist() == list(out["assistant_masks"]), msgs


@pytest.mark.parametrize("name, eot, source", [("chatml", "<|im_end|>", "tokenizer_config.json"),
                                               ("llama2", "</s>", "tokenizer_config.json"),
                                               ("chatml_default", "<|im_end|>", "default ChatML"),
                                               ("plain", "</s>", "default plain")])
def test_mask_marks_each_reply_and_its_end_of_turn(dirs, name, eot, source):
    """A tokenizer with no template gets ChatML when it has <|im_start|> and <|im_end|>, else the
    plain one ("User: ...", "Assistant: ..." + eos)."""
    fmt = load_chat_format(dirs[name])
    assert (fmt.end_of_turn, fmt.source) == (eot, source)
    for msgs in conversations(9, seed=2):
        ids, mask = fmt.encode(msgs)
        replies = [m["content"] for m in msgs if m["role"] == "assistant"]
        spans = runs(mask)
        assert len(spans) == len(replies)
        for (a, b), reply in zip(spans, replies):
            assert ids[b - 1] == fmt.end_of_turn_id and fmt.end_of_turn_id not in ids[a:b - 1]
            assert fmt.hf.decode(ids[a:b - 1].tolist(), skip_special_tokens=False).strip() == reply


# ---------------------------------------------------------------- the data directory and the loss
def test_batches_are_whole_conversations_with_assistant_targets(dirs, data):
    fmt = load_chat_format(dirs["chatml"])
    encoded = [fmt.encode(m) for m in conversations(40)]
    ds = ChatDataset(data, "train")
    meta = json.loads((data / "meta.json").read_text())
    assert meta["kind"] == "chat" and ds.num_conversations == 32 and ChatDataset(data, "val").num_conversations == 8
    T = 40
    x, y = ds.get_batch(6, T, np.random.default_rng(0))
    for row_x, row_y in zip(x, y):
        # the row is the start of one of the conversations; its targets are its assistant tokens
        match = [(ids, m) for ids, m in encoded
                 if ids[:min(len(ids) - 1, T)].tolist() == row_x[:min(len(ids) - 1, T)].tolist()]
        assert len(match) == 1
        ids, mask = match[0]
        n = min(len(ids), T + 1)
        expect = np.full(T, -1)
        expect[:n - 1] = np.where(mask[1:n] == 1, ids[1:n], -1)
        assert row_y.tolist() == expect.tolist()
        assert (row_x[n - 1:] == fmt.end_of_turn_id).all()  # padding
    # data parallel: rows of one global batch, the same rng draws
    xr, yr = ds.get_batch(6, T, np.random.default_rng(0), rows=slice(2, 4))
    assert (xr == x[2:4]).all() and (yr == y[2:4]).all()


def test_loss_is_the_mean_over_assistant_tokens(data):
    ds = ChatDataset(data, "train")
    x, y = ds.get_batch(4, 48, np.random.default_rng(1))
    assert 0 < (y != -1).sum() < y.size
    model = Llama(LlamaConfig(block_size=48, vocab_size=ds.vocab_size, n_layer=1, n_head=4, n_kv_head=2,
                              n_embd=32, ffn_hidden=48), seed=0)
    loss = model.forward(x, y)
    logits = np.asarray(model.forward(x), dtype=np.float64)  # (B, T, V)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    b, t = np.nonzero(y != -1)
    assert loss == pytest.approx(-logp[b, t, y[b, t]].mean(), rel=1e-5)


def test_text_after_the_last_reply_changes_no_loss_or_gradient(dirs, tmp_path):
    """Two conversations equal up to a last user turn after the last reply: its positions have
    target -1 and no assistant token sees them (causal), so loss and every gradient are equal;
    changing the reply instead changes the loss."""
    head = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Fine thank you."}]
    batches = []
    for i, tail in enumerate(["Tell me a story.", "What is your name my cat?", None]):
        msgs = head + [{"role": "user", "content": tail}] if tail else \
            [head[0], {"role": "assistant", "content": "The quick brown fox."}, {"role": "user", "content": "Yes."}]
        prepare([str(write_jsonl(tmp_path / f"c{i}.jsonl", [msgs]))], tmp_path / f"d{i}", format="chat",
                tokenizer=str(dirs["chatml"]), block_size=48, val_fraction=0)
        batches.append(ChatDataset(tmp_path / f"d{i}", "train").get_batch(1, 48, np.random.default_rng(0)))
    (x0, y0), (x1, y1), (x2, y2) = batches
    assert (x0 != x1).any() and (y0 == y1).all()
    model = Llama(LlamaConfig(block_size=48, vocab_size=320, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                              ffn_hidden=48), seed=0)
    grads, losses = [], []
    for x, y in batches:
        model.zero_grad()
        losses.append(model.forward(x, y))
        model.backward()
        grads.append(np.array(model.flat_grad, copy=True))
    assert losses[0] == losses[1] and np.array_equal(grads[0], grads[1])
    assert losses[2] != losses[0]


# ---------------------------------------------------------------- prepare's refusals
GOOD = json.dumps({"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Yes."}]})
BAD = {
    "not-json": ('{"messages": [', "2: not valid JSON"),
    "role": (json.dumps({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}),
             "2: message 1 has role 'tool'; roles are system, user and assistant"),
    "empty-reply": (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]}),
                    "2: message 2 is an empty assistant turn; give it text or drop it"),
    "no-reply": (json.dumps({"messages": [{"role": "user", "content": "x"}]}),
                 "2: the conversation has no assistant turn, so nothing to learn; add one or drop the line"),
    "template-raises": (json.dumps({"messages": [{"role": "assistant", "content": "x"},
                                                 {"role": "user", "content": "y"}]}),
                        "2: the chat template refuses this conversation (Conversation roles must alternate "
                        "user/assistant/user/assistant/...)"),
}


@pytest.mark.parametrize("case", BAD)
def test_prepare_refuses_bad_lines_and_leaves_nothing(dirs, tmp_path, case, capsys):
    line, message = BAD[case]
    src = tmp_path / "chats.jsonl"
    src.write_text(GOOD + "\n" + line + "\n" + GOOD + "\n")
    out = tmp_path / "data"
    assert cli(["prepare", str(src), "--format", "chat", "--tokenizer", str(dirs["llama2"]), "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {src}:{message}"), err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["chats.jsonl"]


def test_prepare_chat_option_errors(dirs, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", conversations(3))
    with pytest.raises(DataError, match=r"^--format chat: --tokenizer char is not a model's tokenizer"):
        prepare([str(src)], tmp_path / "o", tokenizer="char", format="chat")
    with pytest.raises(DataError, match=r"^--block-size applies only to --format chat"):
        prepare([str(src)], tmp_path / "o", block_size=8)
    with pytest.raises(DataError, match=r"^--block-size 0: must be a positive integer"):
        prepare([str(src)], tmp_path / "o", tokenizer=str(dirs["chatml"]), format="chat", block_size=0)
    assert not (tmp_path / "o").exists()
    (tmp_path / "t.txt").write_text("some text\n" * 20)
    prepare([str(tmp_path / "t.txt")], tmp_path / "char", tokenizer="char")
    with pytest.raises(DataError, match=r"tokenizer.json: not a Hugging Face tokenizers file; chat needs a Hugging "
                                        r"Face tokenizer \(a model directory's tokenizer.json\)$"):
        load_chat_format(tmp_path / "char")


def test_truncation_is_counted(dirs, tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", conversations(10))
    assert cli(["prepare", str(src), "--format", "chat", "--tokenizer", str(dirs["chatml"]), "--block-size", "24",
                "--val-fraction", "0.2", "--out", str(tmp_path / "d")]) == 0
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["tokenizer"] == "hf" and meta["kind"] == "chat"
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [
        "chat.json", "conversations.safetensors", "meta.json", "tokenizer.json", "tokenizer_config.json",
        "train_000000.bin", "train_mask_000000.bin", "val_000000.bin", "val_mask_000000.bin"]
    assert chat_data.summary(meta) in capsys.readouterr().err
    c = meta["chat"]
    lengths = [len(load_chat_format(dirs["chatml"]).encode(m)[0]) for m in conversations(10)]
    assert c["truncated"] + c["dropped"] >= sum(n > 25 for n in lengths) > 0
    assert c["conversations"]["train"] + c["conversations"]["val"] == 10 - c["dropped"]
    assert "truncated to 25 tokens" in chat_data.summary(meta)
    # padded rows: a split with fewer tokens than block_size + 1 still trains (text data could not)
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["val_tokens"] < 65
    assert cli(["train", "--data", str(tmp_path / "d"), "--out", str(tmp_path / "run"), *MODEL,
                "--model.block_size", "64", "--train.max_steps", "1", "--train.eval_interval", "1",
                "--train.eval_steps", "1"]) == 0


# ---------------------------------------------------------------- train, then sample --chat
def test_train_then_sample_chat_stops_at_end_of_turn(dirs, data, tmp_path, capsys, monkeypatch):
    run, tuned = tmp_path / "run", tmp_path / "tuned"
    assert cli(["train", "--data", str(data), "--out", str(run), *MODEL, "--train.max_steps", "2"]) == 0
    # fine-tuning starts from a run's weights (--init-from also takes Hugging Face directories)
    assert cli(["train", "--init-from", str(run), "--data", str(data), "--out", str(tuned),
                "--train.max_steps", "3", "--train.batch_size", "4", "--train.sample_interval", "0",
                "--train.eval_interval", "0"]) == 0
    losses = [json.loads(line)["loss"] for line in (tuned / "metrics.jsonl").read_text().splitlines()
              if "loss" in line and json.loads(line).get("step")]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert (tuned / chat.CHAT_FILE).is_file()
    capsys.readouterr()

    import handgrad.models.decode as decode
    import handgrad.sample as sample
    fmt, model = load_chat_format(tuned), load_model(tuned)
    seen, real = {}, decode.sample_logits

    def sample_logits(logits, *args):  # the third token sampled is the end of turn
        seen["calls"] = seen.get("calls", 0) + 1
        return np.full(len(logits), fmt.end_of_turn_id) if seen["calls"] == 3 else real(logits, *args)

    def generate(model, prompt, *args, **kwargs):
        seen["prompt"] = prompt[0].tolist()
        return real_generate(model, prompt, *args, **kwargs)

    real_generate = sample.generate
    monkeypatch.setattr(decode, "sample_logits", sample_logits)
    monkeypatch.setattr(sample, "generate", generate)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there.\n"))
    assert cli(["sample", "--run", str(tuned), "--chat", "--max-new-tokens", "20", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    expect = hf_tokenizer(dirs["chatml"]).apply_chat_template([{"role": "user", "content": "Hello there."}],
                                                               tokenize=True, add_generation_prompt=True,
                                                               return_dict=True)["input_ids"]
    assert seen["prompt"] == list(expect) and seen["calls"] == 3  # stopped: no fourth token
    ids = decode.generate(model, [expect], 2, temperature=0)[0, len(expect):]
    reply = fmt.hf.decode(ids.tolist(), skip_special_tokens=False)
    assert out == f"{reply}\n{SEPARATOR}\n"
    assert "<|im_end|>" not in out and "Hello there" not in out


def test_generate_stops_at_stop_id():
    from handgrad.models.decode import generate
    model = Llama(LlamaConfig(block_size=32, vocab_size=50, n_layer=1, n_head=4, n_kv_head=2, n_embd=32,
                              ffn_hidden=48), seed=3)
    full = generate(model, [[1, 2, 3]], 12, temperature=0)[0]
    stop = int(full[3 + 4])
    first = 3 + int(np.flatnonzero(full[3:] == stop)[0])
    cut = generate(model, [[1, 2, 3]], 12, temperature=0, stop_id=stop)[0]
    assert cut.tolist() == full[:first + 1].tolist()


def test_hf_model_dir_trains_on_chat_data_and_samples_its_reply(dirs, data, tmp_path, capsys):
    """A Hugging Face Llama directory: --init-from it on chat data, and `sample --chat` on it gives
    transformers' own greedy reply to the same templated prompt."""
    import torch
    hf_dir = tmp_path / "hf"
    shutil.copytree(dirs["chatml"], hf_dir)
    torch.manual_seed(0)
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab, max_position_embeddings=64, tie_word_embeddings=True)).eval()
    hf.generation_config.do_sample, hf.generation_config.temperature, hf.generation_config.top_p = True, 0.6, 0.9
    hf.save_pretrained(hf_dir)
    assert cli(["train", "--init-from", str(hf_dir), "--data", str(data), "--out", str(tmp_path / "run"),
                "--train.max_steps", "2", "--train.batch_size", "2",
                "--train.sample_interval", "0", "--train.eval_interval", "0"]) == 0
    assert read_state(resolve(tmp_path / "run"))["model_config"]["block_size"] == 48  # the data's, not the model's 64
    # the model's sampling settings stay the fine-tune's (`sample`, `chat` and `serve` read them)
    assert model_sampling(tmp_path / "run") == model_sampling(hf_dir) == ({"temperature": 0.6, "top_p": 0.9},
                                                                          "the model's generation_config.json")
    capsys.readouterr()
    assert cli(["sample", "--run", str(hf_dir), "--chat", "--prompt", "Tell me a story.", "--temperature", "0",
                "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    ref = hf_tokenizer(hf_dir)
    prompt = ref.apply_chat_template([{"role": "user", "content": "Tell me a story."}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        ids = hf.generate(prompt, do_sample=False, max_new_tokens=12, eos_token_id=ref.convert_tokens_to_ids(
            "<|im_end|>"), pad_token_id=0)[0, prompt.shape[1]:].tolist()
    if ref.convert_tokens_to_ids("<|im_end|>") in ids:
        ids = ids[:ids.index(ref.convert_tokens_to_ids("<|im_end|>"))]
    assert out == f"{ref.decode(ids)}\n{SEPARATOR}\n"
    # the model's tokenizer settings (chat template, eos) travel through convert: HF -> run -> HF
    assert cli(["convert", str(hf_dir), str(tmp_path / "conv")]) == 0
    assert "tokenizer_config.json" in capsys.readouterr().out
    assert cli(["sample", "--run", str(tmp_path / "conv"), "--chat", "--prompt", "Tell me a story.",
                "--temperature", "0", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == out
    assert cli(["convert", str(tmp_path / "conv"), str(tmp_path / "back"), "--format", "hf"]) == 0
    back = json.loads((tmp_path / "back" / "tokenizer_config.json").read_text())
    assert back["chat_template"] == CHATML and back["eos_token"] == "<|im_end|>"
    assert hf_tokenizer(tmp_path / "back").apply_chat_template([{"role": "user", "content": "Hi."}],
                                                               tokenize=False) == ref.apply_chat_template(
        [{"role": "user", "content": "Hi."}], tokenize=False)
