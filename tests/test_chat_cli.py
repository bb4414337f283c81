"""`handgrad chat` (chat_cli.py), driven through streams on a tiny random Llama run with a ChatML
tokenizer: a greedy first turn is `sample --chat`'s token for token; later turns see the earlier
ones; /reset, /system and /save (its file prepares with `prepare --format chat` and gives back the
same messages); the oldest turns leave the view when the context is full, and the user is told;
Ctrl-C stops a reply and the loop goes on; the end of the input leaves with status 0; bad flags
and a model with no chat template are one line and status 2."""
import io
import json
import sys

import numpy as np
import pytest

from handgrad import chat_cli, sample
from handgrad.cli import main as cli
from handgrad.data.chat import load_chat_format, read_conversations
from handgrad.data.chat_data import ChatDataset
from handgrad.data.prepare import prepare
from handgrad.models.decode import generate
from handgrad.sample import SEPARATOR
from helpers import BLOCK, WORDS, tiny_run

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("chat_cli") / "run")


@pytest.fixture
def spy(monkeypatch):
    """The prompts chat_cli hands generate, and the ids it gets back, in order."""
    seen = {"prompts": [], "outs": []}
    real = chat_cli.generate

    def generate(model, prompt, *args, **kwargs):
        seen["prompts"].append(np.asarray(prompt)[0].tolist())
        out = real(model, prompt, *args, **kwargs)
        seen["outs"].append(out[0].tolist())
        return out
    monkeypatch.setattr(chat_cli, "generate", generate)
    return seen


def chat(run, lines, *flags, capsys=None, monkeypatch=None):
    """(exit status, stdout) of `handgrad chat --run run` reading `lines` from stdin."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    code = cli(["chat", "--run", str(run), "--temperature", "0", "--max-new-tokens", "6", *flags])
    return code, capsys.readouterr().out


def msgs(*pairs, system=None):
    out = [{"role": "system", "content": system}] if system else []
    for user, reply in pairs:
        out += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return out


def saved(path):
    return [m for _, m in read_conversations(path)]


# ---------------------------------------------------------------- turns
def test_a_greedy_first_turn_is_sample_chats_token_for_token(run, spy, capsys, monkeypatch):
    outs = []
    real = sample.generate
    monkeypatch.setattr(sample, "generate", lambda *a, **k: outs.append(real(*a, **k)) or outs[-1])
    assert cli(["sample", "--run", str(run), "--chat", "--prompt", "hello there how are you", "--temperature", "0",
                "--max-new-tokens", "6"]) == 0
    sampled = capsys.readouterr().out
    assert sampled.endswith(f"\n{SEPARATOR}\n")
    code, out = chat(run, ["hello there how are you"], capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0
    assert spy["outs"] == [outs[0][0].tolist()]  # the prompt and every token of the reply
    reply = sampled[:-len(f"\n{SEPARATOR}\n")]
    assert f"> hello there how are you\n{reply}\n" in out
    assert out.endswith("> \n")  # the end of the input: a last prompt, then the line closed


def test_a_second_turn_sees_the_first(run, spy, capsys, monkeypatch):
    code, out = chat(run, ["hello there", "what is your name"], "--system", "be brief",
                     capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0 and len(spy["prompts"]) == 2
    fmt = load_chat_format(run)
    first = fmt.hf.decode(spy["outs"][0][len(spy["prompts"][0]):], skip_special_tokens=False)
    first = first.split(fmt.end_of_turn)[0]
    expect = fmt.prompt_ids(msgs(("hello there", first), system="be brief")
                            + [{"role": "user", "content": "what is your name"}])
    assert spy["prompts"][1] == expect
    text = fmt.hf.decode(spy["prompts"][1], skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>") and "hello there" in text and first in text


def test_the_first_line_says_how_replies_are_sampled_and_they_are(run, spy, capsys, monkeypatch):
    """No sampling flags and a model with no settings of its own: llama.cpp's defaults, said on the
    first line, and the reply drawn with them (seed 1337, as `sample` draws)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\n"))
    assert cli(["chat", "--run", str(run), "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("sampling: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05 (llama.cpp's "
                                   "defaults; the model has none)")
    assert out.splitlines()[1].startswith(f"{run}: ")
    fmt, (model, tok, _) = load_chat_format(run), chat_cli.load_run(str(run))
    prompt = spy["prompts"][0]
    want = generate(model, [prompt], 8, 0.8, 40, 0.95, np.random.default_rng(1337), min_p=0.05,
                    stop_id=fmt.end_of_turn_id, vocab=tok.vocab_size)
    assert spy["outs"] == [want[0].tolist()]
    assert generate(model, [prompt], 8, 0.8, rng=np.random.default_rng(1337), stop_id=fmt.end_of_turn_id,
                    vocab=tok.vocab_size)[0].tolist() != want[0].tolist()  # the filters changed this reply
    code, out = chat(run, [], capsys=capsys, monkeypatch=monkeypatch)  # --temperature 0
    assert code == 0 and out.splitlines()[0] == "sampling: greedy, temperature 0 (as asked)"


def test_reset_system_and_save_round_trip_through_prepare(run, spy, capsys, monkeypatch, tmp_path):
    f = tmp_path / "chats.jsonl"
    code, out = chat(run, ["hello there", "tell me a story", f"/save {f}",
                           "/reset", "how are you", "/system you are a fox", "the quick brown fox", f"/save {f}",
                           "/help"], "--system", "be brief", capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0
    fmt = load_chat_format(run)
    texts = [fmt.hf.decode(p, skip_special_tokens=False) for p in spy["prompts"]]
    assert "hello there" in texts[1]
    assert "hello there" not in texts[2] and "tell me a story" not in texts[2]  # /reset: forgotten ...
    assert texts[2].startswith("<|im_start|>system\nbe brief<|im_end|>")  # ... but the system message stays
    assert texts[3].startswith("<|im_start|>system\nyou are a fox<|im_end|>\n<|im_start|>user\nthe quick brown fox")
    assert "(2 turns appended to" in out and "(1 turn appended to" in out and "/save FILE" in out  # /help
    convs = saved(f)
    replies = [fmt.hf.decode(o[len(p):], skip_special_tokens=False).split(fmt.end_of_turn)[0]
               for p, o in zip(spy["prompts"], spy["outs"])]
    assert convs == [msgs(("hello there", replies[0]), ("tell me a story", replies[1]), system="be brief"),
                     msgs(("the quick brown fox", replies[3]), system="you are a fox")]
    # the file is chat data: prepare reads it back, each conversation encoded as the template does
    prepare([str(f)], tmp_path / "data", tokenizer=str(run), format="chat", val_fraction=0, seed=0)
    got = []
    for split in ("train", "val"):  # val: none, with --val-fraction 0
        ds = ChatDataset(tmp_path / "data", split)
        for j in range(ds.num_conversations):
            s, lo = ds.conv_shard[j], ds.offsets[j] - ds.shard_start[ds.conv_shard[j]]
            got.append(ds.shards[s][lo:lo + ds.offsets[j + 1] - ds.offsets[j]].tolist())
    assert sorted(got) == sorted(fmt.encode(m)[0].tolist() for m in convs)


def test_save_before_any_reply_and_to_an_unwritable_path(run, capsys, monkeypatch, tmp_path):
    code, out = chat(run, [f"/save {tmp_path / 'a.jsonl'}", "hello", f"/save {tmp_path / 'no' / 'a.jsonl'}",
                           "/nonsense", "/reset now"], capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0 and not (tmp_path / "a.jsonl").exists()
    assert "nothing to save yet" in out
    assert f"error: {tmp_path / 'no' / 'a.jsonl'}: No such file or directory" in out
    assert "error: unknown command '/nonsense'; /help lists the commands" in out
    assert "error: unknown command '/reset now'" in out


# ---------------------------------------------------------------- the context
def test_the_oldest_turns_leave_when_the_context_is_full(run, spy, capsys, monkeypatch, tmp_path):
    users = [f"message {i}: " + " ".join(WORDS[i:i + 4]) for i in range(8)]
    f = tmp_path / "c.jsonl"
    code, out = chat(run, users + [f"/save {f}"], "--system", "be brief", capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0
    fmt, room = load_chat_format(run), 6
    lines = [line for line in out.splitlines() if "dropped to fit" in line]
    assert lines and all(line.endswith(f"dropped to fit the {BLOCK}-token context)") for line in lines)
    dropped = sum(int(line.split()[0].lstrip("(")) for line in lines)
    turns = saved(f)[0]  # /save keeps every turn, the dropped ones too
    assert [m["content"] for m in turns if m["role"] == "user"] == users
    history = turns[1:]
    last = spy["prompts"][-1]
    assert len(last) + room <= BLOCK
    # the last prompt is the system message and the turns after the dropped ones: no more were dropped
    expect = fmt.prompt_ids(turns[:1] + history[2 * dropped:-1])
    assert last == expect
    one_fewer = fmt.prompt_ids(turns[:1] + history[2 * dropped - 2:-1])
    assert len(one_fewer) + room > BLOCK
    assert fmt.hf.decode(last, skip_special_tokens=False).startswith("<|im_start|>system\nbe brief")


def test_a_message_too_long_for_the_context_is_refused_and_the_loop_goes_on(run, spy, capsys, monkeypatch):
    code, out = chat(run, ["hello there", " ".join(WORDS * 4), "how are you"], capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0 and len(spy["prompts"]) == 2
    assert "error: this message makes a prompt of" in out and f"the model's context holds {BLOCK}" in out
    assert "hello there" in load_chat_format(run).hf.decode(spy["prompts"][1])  # nothing was dropped for it


# ---------------------------------------------------------------- Ctrl-C and Ctrl-D
def interrupt_at(monkeypatch, step):
    """generate's on_token raises KeyboardInterrupt (Ctrl-C) at `step` of the first reply."""
    real, calls = chat_cli.generate, []

    def generate(model, prompt, *args, on_token=None, **kwargs):
        calls.append(np.asarray(prompt)[0].tolist())

        def interrupting(s, ids):
            if len(calls) == 1 and s == step:
                raise KeyboardInterrupt
            on_token(s, ids)
        return real(model, prompt, *args, on_token=interrupting, **kwargs)
    monkeypatch.setattr(chat_cli, "generate", generate)
    return calls


def test_ctrl_c_stops_the_reply_keeps_what_was_written_and_the_loop_goes_on(run, capsys, monkeypatch, tmp_path):
    f = tmp_path / "c.jsonl"
    calls = interrupt_at(monkeypatch, 3)
    code, out = chat(run, ["hello there", "how are you", f"/save {f}"], "--max-new-tokens", "20",
                     capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0 and len(calls) == 2
    assert "(stopped; the reply so far stays in the conversation)" in out
    fmt = load_chat_format(run)
    greedy = generate(chat_cli.load_run(str(run))[0], [calls[0]], 3, temperature=0)[0, len(calls[0]):].tolist()
    partial = fmt.hf.decode(greedy, skip_special_tokens=False).rstrip("\ufffd")
    conv = saved(f)[0]
    assert conv[:2] == msgs(("hello there", partial)) and conv[2]["content"] == "how are you"
    assert f"> hello there\n{partial}\n(stopped;" in out


def test_ctrl_c_before_any_text_drops_the_turn(run, capsys, monkeypatch, tmp_path):
    f = tmp_path / "c.jsonl"
    calls = interrupt_at(monkeypatch, 0)
    code, out = chat(run, ["hello there", "how are you", f"/save {f}"], capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0 and "(stopped before any text; the turn is not kept)" in out
    assert "hello there" not in load_chat_format(run).hf.decode(calls[1])
    assert [m["content"] for m in saved(f)[0] if m["role"] == "user"] == ["how are you"]


def test_end_of_input_leaves_with_status_0(run, capsys, monkeypatch):
    code, out = chat(run, [], capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0 and "/help lists the commands; Ctrl-D leaves." in out and out.endswith("> \n")


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("flags, match", [
    (["--temperature", "-1"], "error: --temperature must be a finite number >= 0"),
    (["--max-new-tokens", "0"], "error: --max-new-tokens must be >= 1 for a reply, got 0"),
    (["--top-p", "2"], "error: --top-p must be in (0, 1]"),
    (["--system", " "], "error: --system is empty"),
    (["--max-new-tokens", "x"], "error: argument --max-new-tokens: invalid int value"),
])
def test_bad_flags_are_one_line_and_status_2(run, flags, match, capsys):
    try:
        code = cli(["chat", "--run", str(run), *flags])
    except SystemExit as e:  # argparse's own refusals exit from the parser
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(match) and err.count("\n") == 1


def test_a_model_without_a_chat_template_is_one_line_and_status_2(tmp_path, capsys):
    bare = tiny_run(tmp_path / "bare", template=None, specials=("<|im_start|>",))  # no template, no eos to end on
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    del cfg["eos_token"]
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert cli(["chat", "--run", str(bare)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --run {bare}: no chat template to talk with (") and err.count("\n") == 1
    assert "add eos_token (or a chat_template)" in err
