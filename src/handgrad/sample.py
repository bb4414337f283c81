"""`handgrad sample`: text from a run, a Hugging Face directory or an llm.c model file, streamed
as it is decoded (the decoding itself, with its KV cache, is models/decode.py).

`--chat`: the prompt (--prompt, or stdin) is one user turn, rendered with the chat template of the
run (its chat.json, copied from chat data: data/chat_data.py) or of the Hugging Face directory, with
add_generation_prompt; the reply is generated until the template's end-of-turn token and printed
alone."""
import sys
import time

import numpy as np

from .backends.cpu.compiles import announce_compiles, compile_watch
from .data.chat import load_chat_format
from .data.sources import DataError
from .data.tokenizer import load_tokenizer
from .interop.checkpoint import CheckpointError, load_model, read_state, resolve
from .interop.common import ConvertError
from .interop.load import foreign_format, load_base, load_pretrained, model_sampling, model_tokenizer_path
from .config import CHOICES
from .models.decode import DTYPES, SampleError, check_sampling, generate
from .models.sampling import FIELDS, resolve_sampling
from .models import family_of


SEPARATOR = "---------------"


# ---------------------------------------------------------------- streaming text
class TextStream:
    """Prints the text of a growing list of ids as it grows.

    A token may end inside a multi-byte UTF-8 character; its decoded text then ends in U+FFFD
    (the tokenizer's replacement character), which is held back until a later token completes it.
    Only the ids since the last complete character are decoded again, so a step costs O(1) ids.
    They are decoded with one id of context before them, whose own text is then cut off: a
    SentencePiece-style decoder (Llama 2's, llama2.c's) strips the space a word begins with only at
    the start of a text, so decoding the new ids alone would glue the words together.
    """

    def __init__(self, decode, file=None):
        self.decode, self.file = decode, file if file is not None else sys.stdout
        self.start = 0   # ids before this index are printed in full
        self.shown = 0   # characters of the text of ids[start:] already printed

    def _text(self, ids):
        """The text ids[start:] adds to ids[:start]."""
        new = [int(i) for i in ids[self.start:]]
        if self.start == 0:
            return self.decode(new)
        context = self.decode([int(ids[self.start - 1])])
        text = self.decode([int(ids[self.start - 1])] + new)
        return text[len(context):] if text.startswith(context) else self.decode(new)

    def new_text(self, ids, final=False):
        """The text ids adds to what earlier calls returned (a character still incomplete at the end
        is held back, unless final)."""
        text = self._text(ids)
        stable = text if final else text.rstrip("\ufffd")
        out = stable[self.shown:]
        if len(stable) == len(text):
            self.start, self.shown = len(ids), 0
        else:
            self.shown = max(self.shown, len(stable))
        return out

    def update(self, ids, final=False):
        out = self.new_text(ids, final)
        if out:
            self.file.write(out)
            self.file.flush()


# ---------------------------------------------------------------- the `handgrad sample` command
def add_chat_model_arguments(parser):
    """--run and --tokenizer, as `chat` and `serve` take them."""
    parser.add_argument("--run", required=True, metavar="MODEL",
                        help="the chat model: anything `handgrad sample --run` takes (a run, a Hugging Face "
                             "directory, a GGUF file, a PEFT adapter, `smollm2-135m-instruct`, ...)")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="the tokenizer and chat template, where --run has none beside it")


# a sampling flag left out: the model's own setting (its generation_config.json, a GGUF's general.sampling.*)
SAMPLING_DEFAULTS = "default: the model's own, else llama.cpp's"


def add_sampling_arguments(parser, max_new_tokens_help):
    """--max-new-tokens, the sampling flags (resolve_run_sampling: a flag left out is the model's own
    setting, else llama.cpp's default) and --seed, as `sample` and `chat` take them."""
    parser.add_argument("--max-new-tokens", type=int, default=200, metavar="N", help=max_new_tokens_help)
    parser.add_argument("--temperature", type=float, default=None, metavar="T",
                        help=f"divide the logits by T; 0 = greedy ({SAMPLING_DEFAULTS} 0.8)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K",
                        help=f"sample only from the K most likely tokens; 0 = off ({SAMPLING_DEFAULTS} 40)")
    parser.add_argument("--top-p", type=float, default=None, metavar="P",
                        help=f"sample only from the smallest set of tokens with probability >= P; 1 = off "
                             f"({SAMPLING_DEFAULTS} 0.95)")
    parser.add_argument("--min-p", type=float, default=None, metavar="P",
                        help=f"sample only from tokens at least P times as likely as the most likely one; 0 = off "
                             f"({SAMPLING_DEFAULTS} 0.05)")
    parser.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                        help=f"divide the positive logits of tokens already in the prompt or reply by R, multiply "
                             f"the negative ones; 1 = off (default: the model's own, else off, as llama.cpp's)")
    parser.add_argument("--seed", type=int, default=1337, help="seed of the sampling (default 1337)")
    add_dtype_argument(parser)


QUANT_CHOICES = CHOICES["train.base_quant"]


def add_dtype_argument(parser):
    """--dtype: the decoding weights' dtype (sample, chat, serve), and --quant."""
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="the weights the decoding multiplies (default float32); bfloat16: bf16 copies of the "
                             "matrices, bf16 x bf16 products with float32 accumulation, half the bytes read per token")
    add_quant_argument(parser)


def add_quant_argument(parser):
    """--quant: the block matrices held quantized (sample, chat, serve, eval)."""
    parser.add_argument("--quant", default=None, choices=QUANT_CHOICES,
                        help="hold every block's matrices quantized and decode from their blocks: keep, a GGUF "
                             "file's as stored; q8_0 or q4_0, quantized as the model loads; none, as loaded "
                             "(default: as loaded, or as a LoRA run's train.base_quant held its base)")


def add_arguments(parser):
    parser.add_argument("--run", required=True, metavar="MODEL",
                        help="a run directory (its newest complete checkpoint), one checkpoint "
                             "directory (RUN_DIR/ckpt/step_NNNNNNNN), a Hugging Face GPT-2, Llama, Qwen2 or "
                             "Qwen3 directory, a GGUF file, a PEFT adapter directory (its base read from "
                             "adapter_config.json), an llm.c or llama2.c model file, or a published model's "
                             "name (smollm2-135m-instruct)")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="the tokenizer, where --run has none beside it: a tokenizer.json, a directory "
                             "holding one (or GPT-2's vocab.json + merges.txt), or `gpt2` (tiktoken)")
    parser.add_argument("--prompt", default=None,
                        help="text to continue (default: sample unconditionally, from the "
                             "end-of-text token)")
    add_sampling_arguments(parser, "tokens to generate per sample (default 200)")
    parser.add_argument("--chat", action="store_true",
                        help="a chat model: --prompt (or stdin) is a user turn in the run's chat template; print "
                             "the assistant's reply, up to its end-of-turn token")
    parser.add_argument("--num-samples", type=int, default=1, metavar="N",
                        help="samples to draw, in one batch (default 1)")


def _tokenizer_dir(path):
    """The run directory of a run or checkpoint path (RUN_DIR/ckpt/step_N -> RUN_DIR)."""
    import pathlib
    p = pathlib.Path(path)
    return p.parent.parent if p.parent.name == "ckpt" else p


def _prompt_ids(prompt, tokenizer, block_size):
    if prompt is None:
        if tokenizer.eot_id is not None:
            return [int(tokenizer.eot_id)], False
        return list(tokenizer.encode("\n")), False
    if prompt == "":
        raise SampleError("empty prompt: give some text or omit --prompt to sample unconditionally")
    _check_utf8(prompt)
    ids = list(tokenizer.encode(prompt))
    _note_length(ids, block_size)
    return ids, True


def _check_utf8(prompt):
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 arrive as lone surrogates
        c = ord(prompt[e.start])
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"unpaired surrogate U+{c:04X}"
        raise SampleError(f"--prompt is not valid UTF-8 ({what} at character {e.start}); pass UTF-8 text, "
                          f"e.g. convert it with `iconv -t utf-8`") from None


def _note_length(ids, block_size):
    if len(ids) > block_size:
        print(f"note: the prompt is {len(ids)} tokens; the model sees only its last {block_size} "
              f"(block_size)", file=sys.stderr)


def _chat_prompt(prompt, tok_path, block_size):
    """(prompt ids, end-of-turn id) of --chat: the user turn (`prompt`, else stdin) in the chat
    template, asking for the assistant's reply."""
    text = sys.stdin.read().rstrip("\n") if prompt is None else prompt
    if not text.strip():
        raise SampleError("--chat: empty user turn; pass --prompt TEXT or the text on stdin")
    _check_utf8(text)
    try:
        fmt = load_chat_format(tok_path)
        ids = fmt.prompt_ids([{"role": "user", "content": text}])
    except DataError as e:
        raise SampleError(f"--chat: {e}") from None
    _note_length(ids, block_size)
    return ids, fmt.end_of_turn_id


def _pads_vocab(run):
    """Whether a run's config sets model.vocab_size (an embedding padded past its tokenizer)."""
    try:
        return bool(read_state(resolve(run))["config"]["model"].get("vocab_size"))
    except (CheckpointError, KeyError, TypeError, AttributeError):
        return False


def until_stop(ids, stop_id):
    """ids up to, not including, the first stop_id (all of them when stop_id is None or absent)."""
    if stop_id is None:
        return ids
    hits = np.flatnonzero(np.asarray(ids) == stop_id)
    return ids[:hits[0]] if len(hits) else ids


def load_run(run, tokenizer=None, quant=None):
    """(model, tokenizer, tokenizer path) of what `--run` names: a handgrad run or checkpoint (a LoRA
    run: its base, then the adapters), or any format load_pretrained reads (a Hugging Face
    directory, an llm.c or llama2.c file, a GGUF file, a PEFT adapter, a published model's name).
    `tokenizer` overrides where the tokenizer is read from. quant (--quant): how the block matrices
    are held (keep, q8_0, q4_0, none; None: as the run holds them). Mistakes raise SampleError
    naming --run or --quant."""
    padded = True  # a model from elsewhere may pad its embedding past its tokenizer (Qwen2's)
    try:
        if foreign_format(run) is None:
            model = load_model(run, base=load_base, quant=quant)  # a LoRA run: its base, then the adapters
            tok_path = tokenizer or _tokenizer_dir(run)
            padded = _pads_vocab(run)
        else:
            config, weights, info = load_pretrained(run)
            model = family_of(config).model(config, seed=None, quant=quant or "none")
            model.load_state_dict(weights)
            tok_path = tokenizer or model_tokenizer_path(run, info, config)
        tok = load_tokenizer(tok_path)
    except FileNotFoundError as e:
        raise SampleError(f"--run {run}: {e}") from None
    except ValueError as e:  # a quantized hold the weights do not allow (keep without a GGUF file, rows)
        if quant in (None, "none"):
            raise
        raise SampleError(f"--quant {quant}: {e}") from None
    if tok.vocab_size > model.config.vocab_size or (tok.vocab_size < model.config.vocab_size and not padded):
        raise SampleError(f"--run {run}: its tokenizer.json has {tok.vocab_size} tokens but the model "
                          f"{model.config.vocab_size}; put back the tokenizer.json of the data it was trained on "
                          f"(or pass --tokenizer)")
    return model, tok, tok_path


def sampling_flags(args):
    """The sampling flags the user gave ({field: value}, None where left out), checked: SampleError
    naming the first bad flag."""
    asked = {f: getattr(args, f) for f in FIELDS}
    check_sampling(**{**asked, "temperature": 1.0 if asked["temperature"] is None else asked["temperature"]},
                   max_new_tokens=args.max_new_tokens, cli=True)
    return asked


def run_sampling(run):
    """The sampling settings of the model --run names (interop/load.py's model_sampling), or None;
    a setting it cannot sample with is a SampleError naming --run."""
    try:
        return model_sampling(run)
    except ConvertError as e:
        raise SampleError(f"--run {run}: {e}") from None


def resolve_run_sampling(run, asked):
    """The Sampling `sample` and `chat` draw with (models/sampling.py's resolve_sampling): the flags
    asked, else the settings of the model --run names, else llama.cpp's defaults."""
    return resolve_sampling(run_sampling(run), **asked)


def main(args, file=None):
    """`handgrad sample`: load a run, stream sample 0 as it is generated, then print the others,
    each followed by a separator line. Returns the exit code; user errors raise SampleError."""

    file = file if file is not None else sys.stdout
    asked = sampling_flags(args)
    if args.num_samples < 1:
        raise SampleError(f"--num-samples must be >= 1, got {args.num_samples}")
    announce_compiles()
    model, tokenizer, tok_path = load_run(args.run, args.tokenizer, args.quant)
    sampling = resolve_run_sampling(args.run, asked)
    stop_id = None
    if args.chat:
        ids, stop_id = _chat_prompt(args.prompt, tok_path, model.config.block_size)
        show_prompt = False  # print the reply alone
    else:
        ids, show_prompt = _prompt_ids(args.prompt, tokenizer, model.config.block_size)
    T0 = len(ids)
    prompt = np.tile(np.asarray(ids, dtype=np.int64), (args.num_samples, 1))

    stream = TextStream(tokenizer.decode, file)
    shown_from = 0 if show_prompt else T0  # unconditional: don't print the start token
    watch = compile_watch()
    t0, compiling = time.perf_counter(), watch.seconds
    out = generate(model, prompt, args.max_new_tokens, rng=np.random.default_rng(args.seed),
                   on_token=lambda step, so_far: stream.update(until_stop(so_far[0, shown_from:], stop_id)),
                   stop_id=stop_id, vocab=tokenizer.vocab_size, dtype=args.dtype, **sampling.kwargs())
    stream.update(until_stop(out[0, shown_from:], stop_id), final=True)
    file.write(f"\n{SEPARATOR}\n")
    for row in out[1:]:
        file.write(tokenizer.decode([int(i) for i in until_stop(row[shown_from:], stop_id)]) + f"\n{SEPARATOR}\n")
    file.flush()
    dt, compiling = time.perf_counter() - t0, watch.seconds - compiling
    n = args.num_samples * (out.shape[1] - T0)
    print(decoding_report(n, dt, compiling), file=sys.stderr)
    return 0


def decoding_report(n, seconds, compiling=0.0):
    """`sample`'s last line: n tokens in `seconds`, and the speed of the decoding itself, without the
    `compiling` seconds Numba spent compiling kernels on the first call (none on a warm cache)."""
    if compiling <= 0:
        return f"{n} tokens in {seconds:.2f} s ({n / max(seconds, 1e-9):.1f} tokens/s)"
    return (f"{n} tokens in {seconds:.2f} s, {compiling:.2f} s of it compiling kernels "
            f"({n / max(seconds - compiling, 1e-9):.1f} tokens/s without it)")

