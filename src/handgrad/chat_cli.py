"""`handgrad chat`: a conversation with a chat model in the terminal.

Each turn renders the whole conversation (the system message, the turns so far, the new user
message) with the model's chat template and add_generation_prompt, as `sample --chat` renders its
one turn (data/chat.py's ChatFormat), and decodes the reply with models/decode.py's generate until
the template's end-of-turn token, streamed through sample.py's TextStream. So a first turn is what
`sample --chat` gives for the same prompt, seed and flags. The conversation is prefilled again
each turn (the KV cache lives for one reply).

Commands (HELP): /reset, /system TEXT, /save FILE, /help; Ctrl-D (end of input) leaves with status 0.
The loop reads lines from `inp` and writes to `out` (stdin and stdout by default), so tests drive it
with streams.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

from .data.chat import load_chat_format
from .data.sources import DataError
from .models.decode import SampleError, generate
from .models.sampling import resolve_sampling
from .sample import (TextStream, add_chat_model_arguments, add_sampling_arguments, load_run, resolve_run_sampling,
                     sampling_flags, until_stop)


PROMPT = "> "
HELP = """\
/reset         forget the conversation (the system message stays)
/system TEXT   set the system message and start over (/system alone: the template's default)
/save FILE     append the conversation so far to FILE as one chats.jsonl line, the layout
               `handgrad prepare --format chat` reads (turns dropped to fit the context included)
/help          this list
Ctrl-C         stop the reply being written; the part written so far stays in the conversation
Ctrl-D         leave"""


def add_arguments(parser):
    add_chat_model_arguments(parser)
    parser.add_argument("--system", default=None, metavar="TEXT",
                        help="the system message (default: none, or the one the chat template adds)")
    add_sampling_arguments(parser, "the longest reply, in tokens (default 200)")
    parser.epilog = "Commands, typed as a message:\n" + HELP
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the epilog's lines as written


class TooLong(ValueError):
    """A message that does not fit the context even with every earlier turn dropped."""


class Chat:
    """A conversation with one model: its system message, its turns (messages[start:] in view) and
    how its replies are sampled. Writes everything it shows to `out`. Replies sample as `sample` does:
    the flags given, else the model's own, else llama.cpp's defaults (sample.py's
    resolve_run_sampling); the first line says which."""

    def __init__(self, model, tokenizer, fmt, out, system=None, max_new_tokens=200, sampling=None, seed=1337,
                 dtype="float32"):
        self.model, self.tokenizer, self.fmt, self.out = model, tokenizer, fmt, out
        self.system = system
        self.sampling = (sampling or resolve_sampling()).kwargs()  # a models/sampling.py Sampling
        self.max_new_tokens, self.dtype = max_new_tokens, dtype
        self.rng = np.random.default_rng(seed)  # one stream for the session: turn 1 draws as `sample` does
        self.block_size = model.config.block_size
        self.room = min(max_new_tokens, max(1, self.block_size // 2))  # tokens kept free for the reply
        self.reset()

    def reset(self):
        self.messages = []  # user, assistant, user, assistant, ...: whole turns only
        self.start = 0  # messages[:start] were dropped to fit the context

    def _with_system(self, messages):
        return ([{"role": "system", "content": self.system}] if self.system else []) + messages

    def prompt_ids(self, user):
        """(ids asking for the reply to `user`, turns dropped from view): the fewest oldest turns
        dropped so that the prompt and room for the reply fit block_size. TooLong where none fits;
        DataError where the template refuses the conversation. Nothing changes until it fits.

        A turn needs its prompt plus `room` tokens for the reply within block_size, room being
        --max-new-tokens but at most half of block_size. Dropped turns (a user message and its reply;
        the system message stays) leave only the model's view: /save still writes them. A reply that
        runs past block_size goes on under generate's window policy."""
        turn = [{"role": "user", "content": user}]
        for start in range(self.start, len(self.messages) + 1, 2):
            ids = self.fmt.prompt_ids(self._with_system(self.messages[start:] + turn))
            if len(ids) + self.room <= self.block_size:
                dropped = (start - self.start) // 2
                self.start = start
                return ids, dropped
        raise TooLong(f"this message makes a prompt of {len(ids)} tokens, and with {self.room} for the reply "
                      f"the model's context holds {self.block_size}; shorten it (or the system message, or "
                      f"--max-new-tokens)")

    def reply(self, ids):
        """Stream the reply to prompt `ids`; return (its ids without the end-of-turn token, why it
        ended: "end", "length" or "interrupted"). Ctrl-C (KeyboardInterrupt) stops it."""
        T0, stop_id = len(ids), self.fmt.end_of_turn_id
        stream = TextStream(self.tokenizer.decode, self.out)
        so_far = [np.zeros(0, np.int64)]

        def on_token(step, ids_so_far):
            so_far[0] = until_stop(ids_so_far[0, T0:].copy(), stop_id)
            stream.update(so_far[0])

        try:
            out = generate(self.model, np.asarray([ids], np.int64), self.max_new_tokens, rng=self.rng,
                           on_token=on_token, stop_id=stop_id, vocab=self.tokenizer.vocab_size, dtype=self.dtype,
                           **self.sampling)
        except KeyboardInterrupt:
            return so_far[0], "interrupted"
        new = out[0, T0:]
        reply = until_stop(new, stop_id)
        stream.update(reply, final=True)
        return reply, "end" if len(reply) < len(new) else "length"

    def turn(self, user):
        """One exchange: the reply to `user`, streamed, then the turn kept (or not, said why). A reply
        stopped by Ctrl-C keeps the part written so far (it is what the user saw); a reply with no
        text yet is dropped with its user message, as is an empty reply (chats.jsonl refuses empty
        assistant turns)."""
        ids, dropped = self.prompt_ids(user)
        if dropped:
            self.say(f"({dropped} oldest turn{'s' * (dropped > 1)} dropped to fit the {self.block_size}-token "
                     f"context)")
        reply, why = self.reply(ids)
        text = self.tokenizer.decode([int(i) for i in reply])
        if why == "interrupted":
            text = text.rstrip("\ufffd")  # a character cut in half
        self.out.write("\n")
        if not text.strip():
            self.say("(stopped before any text; the turn is not kept)" if why == "interrupted"
                     else "(an empty reply; the turn is not kept)")
            return
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": text}]
        if why == "interrupted":
            self.say("(stopped; the reply so far stays in the conversation)")
        elif why == "length":
            self.say(f"(cut at --max-new-tokens {self.max_new_tokens})")

    def save(self, path):
        """Append the conversation (every turn since the last reset) to `path` as one chats.jsonl line."""
        if not self.messages:
            self.say("nothing to save yet: a conversation needs an assistant turn")
            return
        line = json.dumps({"messages": self._with_system(self.messages)}, ensure_ascii=False)
        path = Path(path).expanduser()
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError as e:
            self.say(f"error: {path}: {e.strerror or e}; give a file you can write")
            return
        self.say(f"({len(self.messages) // 2} turn{'s' * (len(self.messages) > 2)} appended to {path})")

    def command(self, line):
        """Act on a line starting with '/'."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name == "/reset" and not arg:
            self.reset()
            self.say("(conversation forgotten)")
        elif name == "/system":
            self.system = arg or None
            self.reset()
            self.say(f"(system message {'set' if arg else 'cleared'}; conversation forgotten)")
        elif name == "/save" and arg:
            self.save(arg)
        elif name == "/help" and not arg:
            self.say(HELP)
        else:
            self.say(f"error: unknown command {line!r}; /help lists the commands")

    def say(self, text):
        self.out.write(text + "\n")
        self.out.flush()


def _read(inp, out):
    """The next line typed (without its newline), or None at the end of the input. When the input
    is not a terminal the line is echoed after the prompt, so a piped session's output reads as it
    would on a terminal."""
    if inp is sys.stdin and out is sys.stdout and inp.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        try:
            return input(PROMPT)
        except EOFError:
            return None
    out.write(PROMPT)
    out.flush()
    line = inp.readline()
    if not line:
        return None
    out.write(line if line.endswith("\n") else line + "\n")  # echoed: the input is not a terminal
    return line.rstrip("\r\n")


def loop(chat, inp=None, out=None):
    """Read lines until the end of the input: commands, or user messages answered by the model."""
    inp, out = inp if inp is not None else sys.stdin, out if out is not None else sys.stdout
    while True:
        try:
            line = _read(inp, out)
        except KeyboardInterrupt:  # at the prompt: a fresh prompt, as a shell does
            chat.say("\n(Ctrl-D leaves)")
            continue
        except UnicodeDecodeError:
            chat.say("error: that line is not UTF-8 text; type it again")
            continue
        if line is None:
            out.write("\n")
            out.flush()
            return 0
        if not line.strip():
            continue
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            chat.say("error: that line is not UTF-8 text; type it again")
            continue
        if line.startswith("/"):
            chat.command(line.strip())
            continue
        try:
            chat.turn(line)
        except (TooLong, DataError) as e:
            chat.say(f"error: {e}")


def main(args, inp=None, out=None):
    """`handgrad chat`: load the model and its chat template, then talk until the input ends."""
    out = out if out is not None else sys.stdout
    asked = sampling_flags(args)
    if args.max_new_tokens < 1:
        raise SampleError(f"--max-new-tokens must be >= 1 for a reply, got {args.max_new_tokens}")
    if args.system is not None and not args.system.strip():
        raise SampleError("--system is empty; give the system message's text or leave the flag out")
    model, tokenizer, tok_path = load_run(args.run, args.tokenizer, args.quant)
    sampling = resolve_run_sampling(args.run, asked)
    try:
        fmt = load_chat_format(tok_path)
    except DataError as e:
        raise SampleError(f"--run {args.run}: no chat template to talk with ({e})") from None
    chat = Chat(model, tokenizer, fmt, out, system=args.system, max_new_tokens=args.max_new_tokens,
                sampling=sampling, seed=args.seed, dtype=args.dtype)
    chat.say(f"sampling: {sampling.describe()}")
    chat.say(f"{args.run}: {model.num_params:,} parameters, context {model.config.block_size} tokens, "
             f"chat template from {fmt.source} (replies end at {fmt.end_of_turn}). /help lists the commands; "
             f"Ctrl-D leaves.")
    return loop(chat, inp, out)
