"""`handgrad serve`: the model behind an OpenAI-compatible HTTP API and a chat page.

Loads what `--run` names as `sample` does (sample.py's load_run), starts the decoding engine
(serve/engine.py) and serves serve/app.py's routes with uvicorn. The HTTP stack is the optional
`serve` extra (Starlette, uvicorn); without it the command says what to install.
Binds to 127.0.0.1 unless --host says otherwise. Logs one line per request on stderr unless --quiet.
"""
import sys
from types import SimpleNamespace

from ..data.chat import load_chat_format
from ..data.sources import DataError
from ..models.sampling import SampleError, resolve_sampling
from ..sample import add_chat_model_arguments, add_dtype_argument, load_run, run_sampling
from .app import Server, Starlette, stderr_line
from .engine import Engine

DEFAULT_CONTEXT = 2048  # positions per stream unless the model's block_size is smaller


def add_arguments(parser):
    add_chat_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every "
                             "interface)")
    parser.add_argument("--port", type=int, default=8000, help="the port (default 8000)")
    parser.add_argument("--name", default=None,
                        help="the model's id in /v1/models and in responses (default: --run's last path part)")
    parser.add_argument("--max-streams", type=int, default=8, metavar="N",
                        help="sequences decoded together in one batched step (default 8); each holds a KV cache "
                             "of --context positions")
    parser.add_argument("--max-waiting", type=int, default=32, metavar="N",
                        help="sequences that may wait for a free stream; more get 429 (default 32)")
    parser.add_argument("--context", type=int, default=None, metavar="N",
                        help=f"positions per stream, prompt and reply together (default: the model's block_size, "
                             f"at most {DEFAULT_CONTEXT})")
    parser.add_argument("--max-tokens", type=int, default=1024, metavar="N",
                        help="the largest max_tokens a request may ask for, and the default (default 1024)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                        help="the longest prompt, in tokens (default: --context - 1)")
    parser.add_argument("--max-body", type=int, default=1 << 20, metavar="BYTES",
                        help="the largest request body (default 1 MiB); more gets 413")
    add_dtype_argument(parser)
    parser.add_argument("--quiet", action="store_true",
                        help="no request log (default: one line per request on stderr: method, path, status, "
                             "tokens generated, milliseconds)")


def _check(args, block_size):
    """The limits, checked: SampleError naming the first bad flag."""
    for flag in ("max_streams", "max_tokens", "max_body", "port"):
        if getattr(args, flag) < 1:
            raise SampleError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_waiting < 0:
        raise SampleError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    context = args.context if args.context is not None else min(block_size, DEFAULT_CONTEXT)
    if not 2 <= context <= block_size:
        raise SampleError(f"--context must be in [2, {block_size}] (the model's block_size), got {context}")
    max_prompt = args.max_prompt_tokens if args.max_prompt_tokens is not None else context - 1
    if not 1 <= max_prompt < context:
        raise SampleError(f"--max-prompt-tokens must be in [1, {context - 1}] (--context - 1), got {max_prompt}")
    return context, SimpleNamespace(max_streams=args.max_streams, max_tokens=args.max_tokens,
                                    max_prompt_tokens=max_prompt, max_body=args.max_body)


# handgrad is installed from its clone (`pip install -e .`), not by name from an index, so the
# extra's spelling differs: from the clone's directory the path form, anywhere the two packages.
NO_HTTP_STACK = ("serve needs its HTTP stack, Starlette and uvicorn: pip install -e '.[serve]' in handgrad's "
                 "clone, or pip install starlette uvicorn")

def build(args):
    """(Server, Engine not yet started) for the parsed arguments; SampleError for a user's mistake."""
    if Starlette is None:
        raise SampleError(NO_HTTP_STACK)
    model, tokenizer, tok_path = load_run(args.run, args.tokenizer, args.quant)
    sampling = run_sampling(args.run)  # the model's own; a request's fields go over them
    context, limits = _check(args, model.config.block_size)
    try:
        fmt = load_chat_format(tok_path)
    except DataError:
        fmt = None  # /v1/completions only; /v1/chat/completions says so
    engine = Engine(model, slots=args.max_streams, length=context, max_waiting=args.max_waiting,
                    vocab=tokenizer.vocab_size, dtype=args.dtype)
    name = args.name or str(args.run).rstrip("/").split("/")[-1]
    return Server(engine, tokenizer, fmt, name, limits, sampling=sampling), engine


def main(args):
    try:
        import uvicorn
    except ImportError:
        uvicorn = None
    if uvicorn is None:
        raise SampleError(NO_HTTP_STACK)
    server, engine = build(args)
    kv = engine.cache.k.nbytes * 2 / 2 ** 20
    print(f"{server.name}: {engine.model.num_params:,} parameters; {engine.slots} streams of {engine.length} "
          f"positions ({kv:.0f} MiB of KV cache); chat template: "
          f"{'yes' if server.fmt is not None else 'none (/v1/completions only)'}; sampling where a request sets "
          f"none: {resolve_sampling(server.sampling).describe()}", file=sys.stderr)
    print(f"serving on http://{args.host}:{args.port}/ (the chat page) and http://{args.host}:{args.port}/v1",
          file=sys.stderr)
    engine.start()
    try:
        # the request log is handgrad's (AccessLog), so uvicorn's own access log stays off
        uvicorn.run(server.app(log=None if args.quiet else stderr_line), host=args.host, port=args.port,
                    log_level="warning", access_log=False,
                    limit_concurrency=args.max_streams + args.max_waiting + 64, timeout_graceful_shutdown=2)
    finally:
        engine.stop()
    return 0
