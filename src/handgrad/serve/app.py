"""`handgrad serve`'s HTTP side: OpenAI's chat-completions and completions protocol over the
engine (serve/engine.py), on Starlette (ASGI, run by uvicorn: serve/command.py).

Routes: POST /v1/chat/completions, POST /v1/completions (stream true/false: server-sent events as
OpenAI sends them, ending in `data: [DONE]`), GET /v1/models, GET /health, and the chat page at /
(serve/page.html). Server.app(log=...) adds the request log, one line per request (AccessLog).

Why Starlette and not FastAPI: it streams a response from an async generator while listening for
the client's disconnect (which cancels the generator: the sequence's row is freed before the
engine's next step), and FastAPI's request models would answer a bad field with their own 422 shape
where OpenAI's clients expect a 400 with OpenAI's error object. So the fields are checked here, each
mistake naming its field (sampling_fields, ApiError).
"""
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

from ..models.sampling import FIELDS, resolve_sampling
from ..sample import TextStream
from ..data.sources import DataError
from .engine import Busy, Sequence

try:
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
    from starlette.routing import Route
except ImportError:  # the optional extra: serve/command.py says what to install
    Starlette = None

PAGE = Path(__file__).with_name("page.html")
CHUNK_WAIT_S = 0.25  # how often a non-streaming request checks that its client is still there
SEQUENCES = "handgrad.sequences"  # in a request's ASGI scope: the sequences it decoded, for AccessLog


class ApiError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error object,
        {"error": {"message": ..., "type": "invalid_request_error", "param": FIELD, "code": null}}."""

    def __init__(self, status, message, param=None, kind="invalid_request_error", code=None):
        super().__init__(message)
        self.status, self.body = status, {"error": {"message": message, "type": kind, "param": param,
                                                    "code": code}}


def _error_response(e):
    return JSONResponse(e.body, status_code=e.status)


# ---------------------------------------------------------------- the request's fields
def _number(data, name, default, lo, hi, integer=False):
    x = data.get(name)
    if x is None:
        return default
    ok = isinstance(x, int) if integer else isinstance(x, (int, float))
    if isinstance(x, bool) or not ok or not lo <= x <= hi:
        what = "an integer" if integer else "a number"
        raise ApiError(400, f"'{name}' must be {what} in [{lo}, {hi}], got {json.dumps(x)}", name)
    return x


def _stop(data):
    stop = data.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    return stops


def sampling_fields(data, limits):
    """The fields both completions routes take, checked: a dict of them. Fields: max_tokens
    (max_completion_tokens), temperature, top_p, top_k, min_p, repetition_penalty, seed, stop (a
    string or up to 4), n, stream, stream_options.include_usage; other fields are ignored, as
    OpenAI-compatible servers do. A sampling field left out is the model's own setting, else
    llama.cpp's default (models/sampling.py's resolve_sampling, as `sample` and `chat` resolve their
    flags)."""
    if "model" in data and not isinstance(data["model"], str):
        raise ApiError(400, "'model' must be a string", "model")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", "stream")
    options = data.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    name = "max_completion_tokens" if data.get("max_tokens") is None and "max_completion_tokens" in data \
        else "max_tokens"
    return dict(max_tokens=_number(data, name, None, 1, limits.max_tokens, integer=True), max_tokens_field=name,
                temperature=_number(data, "temperature", None, 0, 2),
                top_p=_number(data, "top_p", None, 1e-9, 1), top_k=_number(data, "top_k", None, 0, 2 ** 31, True),
                min_p=_number(data, "min_p", None, 0, 1),
                repetition_penalty=_number(data, "repetition_penalty", None, 1e-9, 100),
                seed=_number(data, "seed", None, -2 ** 63, 2 ** 64 - 1, integer=True),
                n=_number(data, "n", 1, 1, limits.max_streams, integer=True), stop=_stop(data), stream=stream,
                include_usage=options.get("include_usage", False))


def _messages(data):
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"'{where}.role' must be system, user or assistant", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"'{where}.content' parts must be {{\"type\": \"text\", \"text\": ...}}: "
                                    f"this model reads text only", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"'{where}.content' must be a string", f"{where}.content")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


def _prompts(data):
    prompt = data.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ApiError(400, "'prompt' must be a non-empty string or a list of them", "prompt")
    return prompts


async def read_json(request, max_body):
    """The request's body as a JSON object, at most max_body bytes (413 beyond: read no further)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body:
        raise ApiError(413, f"the body is {declared} bytes; the server takes at most {max_body} (--max-body)")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body:
            raise ApiError(413, f"the body is over {max_body} bytes, the most the server takes (--max-body)")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    return data


# ---------------------------------------------------------------- text out of tokens
class Text:
    """A choice's text as its tokens come: decoded incrementally (a character split across tokens is
    held back until complete), cut at the first stop string (and the sequence then cancelled);
    streamed text holds back only what could still become a stop string."""

    def __init__(self, decode, stops):
        self.stream, self.stops = TextStream(decode), stops  # decodes only the ids since the last complete character
        self.ids, self.text, self.sent, self.stopped = [], "", 0, False

    def add(self, token):
        """The new text to send after `token` (may be ""); self.stopped once a stop string showed."""
        self.ids.append(token)
        self.text += self.stream.new_text(self.ids)
        for stop in self.stops:
            hit = self.text.find(stop, max(0, self.sent - len(stop) + 1))
            if hit >= 0:
                self.text, self.stopped = self.text[:hit], True
        end = len(self.text) if self.stopped else len(self.text) - self._held(self.text)
        return self._send(end)

    def finish(self):
        """The rest of the text, once the sequence has ended (a character left incomplete included)."""
        if not self.stopped:
            self.text += self.stream.new_text(self.ids, final=True)
        return self._send(len(self.text))

    def _held(self, text):
        """How many characters at text's end could still begin a stop string."""
        return max((k for stop in self.stops for k in range(min(len(stop) - 1, len(text)), 0, -1)
                    if text.endswith(stop[:k])), default=0)

    def _send(self, end):
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out


# ---------------------------------------------------------------- the request log
def stderr_line(line):
    print(line, file=sys.stderr, flush=True)


class AccessLog:
    """ASGI middleware: one line per HTTP request once its response has ended (a stream's last
    event sent, or its client gone), `POST /v1/chat/completions 200 31 tokens 840 ms`: the method,
    path, status, the tokens generated for it (its sequences, left in the scope under SEQUENCES by
    the completions routes) and the milliseconds from its arrival. uvicorn's own access log is off
    (serve/command.py), so each request has this one line."""

    def __init__(self, app, log):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]  # 500: the app raised before it answered

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, send_status)
        finally:
            tokens = sum(len(seq.tokens) for seq in scope.get(SEQUENCES, ()))
            ms = (time.perf_counter() - start) * 1000
            self.log(f"{scope['method']} {scope['path']} {status[0]} {tokens} tokens {ms:.0f} ms")


# ---------------------------------------------------------------- the server
class Server:
    """The model, its tokenizer and chat format, the engine and the limits, behind the routes;
    sampling: the model's own settings (interop/load.py's model_sampling), under a request's fields."""

    def __init__(self, engine, tokenizer, chat_format, name, limits, sampling=None):
        self.engine, self.tokenizer, self.fmt, self.name, self.limits = engine, tokenizer, chat_format, name, limits
        self.sampling = sampling
        self.created = int(time.time())

    def app(self, log=None):
        """The ASGI app; with log (a function of one line, e.g. stderr_line), wrapped in AccessLog."""
        routes = [Route("/", self.page), Route("/health", self.health), Route("/v1/models", self.models),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"])]

        async def http_error(request, exc):
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return _error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                            kind=kind))

        async def api_error(request, exc):
            return _error_response(exc)
        app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, ApiError: api_error})
        return AccessLog(app, log) if log is not None else app

    async def page(self, request):
        return HTMLResponse(PAGE.read_text(encoding="utf-8").replace("{{MODEL}}", self.name))

    async def health(self, request):
        active, waiting, free = self.engine.load()
        return JSONResponse({"status": "ok", "model": self.name, "active": active, "waiting": waiting,
                             "free_slots": free, "slots": self.engine.slots, "context": self.engine.length})

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model",
                                                         "created": self.created, "owned_by": "handgrad"}]})

    async def chat(self, request):
        data = await read_json(request, self.limits.max_body)
        fields = sampling_fields(data, self.limits)
        if self.fmt is None:
            raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
        try:
            ids = self.fmt.prompt_ids(_messages(data))
        except DataError as e:
            raise ApiError(400, f"the chat template refused these messages: {e}", "messages") from None
        return await self._complete(request, [ids], fields, "messages", chat=True)

    async def completions(self, request):
        data = await read_json(request, self.limits.max_body)
        fields = sampling_fields(data, self.limits)
        prompts = [self.tokenizer.encode(p) for p in _prompts(data)]
        return await self._complete(request, prompts, fields, "prompt", chat=False)

    def _sequences(self, prompts, f, field, stop_ids, emit):
        sampling = resolve_sampling(self.sampling, **{k: f[k] for k in FIELDS}).kwargs()
        seqs = []
        for prompt in prompts:
            room = self.engine.length - len(prompt)
            if len(prompt) > self.limits.max_prompt_tokens or room < 1:
                raise ApiError(400, f"the prompt is {len(prompt)} tokens; the server takes at most "
                                    f"{min(self.limits.max_prompt_tokens, self.engine.length - 1)}", field,
                               code="context_length_exceeded")
            max_tokens = f["max_tokens"] if f["max_tokens"] is not None else min(room, self.limits.max_tokens)
            if max_tokens > room:
                raise ApiError(400, f"the prompt's {len(prompt)} tokens and {f['max_tokens_field']} {max_tokens} "
                                    f"exceed the context of {self.engine.length} tokens; ask for at most {room}",
                               f["max_tokens_field"], code="context_length_exceeded")
            for j in range(f["n"]):
                seed = None if f["seed"] is None else (f["seed"] + j) % 2 ** 64
                index = len(seqs)
                seqs.append(Sequence(prompt, max_tokens, seed=seed, stop_ids=stop_ids,
                                     emit=lambda token, i=index: emit(i, token), **sampling))
        if len(seqs) > self.limits.max_streams:
            raise ApiError(400, f"{len(seqs)} choices in one request; the server decodes at most "
                                f"{self.limits.max_streams} at once", "n")
        return seqs

    async def _complete(self, request, prompts, f, field, chat):
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def emit(i, token):  # on the engine's thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, (i, token))
            except RuntimeError:  # the event loop is gone (shutting down)
                pass
        stop_ids = {self.fmt.end_of_turn_id} if chat else set()
        if self.tokenizer.eot_id is not None:
            stop_ids.add(int(self.tokenizer.eot_id))
        seqs = self._sequences(prompts, f, field, stop_ids, emit)
        request.scope.setdefault(SEQUENCES, []).extend(seqs)  # AccessLog counts their tokens
        try:
            self.engine.submit(seqs)
        except Busy as e:
            raise ApiError(429, str(e), kind="server_busy", code="too_many_requests") from None
        call = _Call(self, seqs, f, chat, events)
        if f["stream"]:
            return StreamingResponse(call.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await call.whole(request)


class _Gone(Exception):
    """The client of a non-streaming request went away."""


class _Call:
    """One request's sequences, turned into OpenAI's response (whole) or its stream of chunks."""

    def __init__(self, server, seqs, f, chat, events):
        self.server, self.seqs, self.f, self.chat, self.events = server, seqs, f, chat, events
        self.texts = [Text(server.tokenizer.decode, f["stop"]) for _ in seqs]
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())

    def _reason(self, i):
        return "length" if self.seqs[i].finish == "length" and not self.texts[i].stopped else "stop"

    def _usage(self):
        prompt = sum(len(s.prompt) for s in self.seqs[::self.f["n"]])
        done = sum(len(s.tokens) for s in self.seqs)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    async def _next(self, request):
        """The engine's next (choice, token or None); with a request, _Gone once its client left."""
        while True:
            if request is None:
                return await self.events.get()
            try:
                return await asyncio.wait_for(self.events.get(), CHUNK_WAIT_S)  # a cancelled get loses nothing
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise _Gone from None

    async def _events(self, request=None):
        """(choice, new text, ended?) as the engine's tokens arrive, until every choice ended."""
        left = len(self.seqs)
        while left:
            i, token = await self._next(request)
            text = self.texts[i]
            if token is None:  # the sequence ended
                left -= 1
                if self.seqs[i].finish == "error":
                    raise ApiError(500, "the engine failed while decoding (see the server's log)", kind="server_error")
                yield i, text.finish(), True
            elif not text.stopped:
                delta = text.add(token)
                if text.stopped:
                    self.server.engine.cancel(self.seqs[i])  # its end arrives as a "cancelled"
                if delta:
                    yield i, delta, False

    def _chunk(self, i, delta, reason, first=False):
        body = {"id": self.id, "object": self.object + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.server.name}
        if self.chat:
            d = {"role": "assistant", "content": delta} if first else ({"content": delta} if delta else {})
            body["choices"] = [{"index": i, "delta": d, "logprobs": None, "finish_reason": reason}]
        else:
            body["choices"] = [{"index": i, "text": delta, "logprobs": None, "finish_reason": reason}]
        return body

    async def stream(self):
        def sse(obj):
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
        try:
            if self.chat:
                for i in range(len(self.seqs)):
                    yield sse(self._chunk(i, "", None, first=True))
            try:
                async for i, delta, ended in self._events():
                    if delta:
                        yield sse(self._chunk(i, delta, None))
                    if ended:
                        yield sse(self._chunk(i, "", self._reason(i)))
            except ApiError as e:
                yield sse(e.body)
                return
            if self.f["include_usage"]:
                yield sse({"id": self.id, "object": self.object + (".chunk" if self.chat else ""),
                           "created": self.created, "model": self.server.name, "choices": [],
                           "usage": self._usage()})
            yield "data: [DONE]\n\n"
        finally:  # done, or the client went away (the generator is cancelled): free the rows now
            for seq in self.seqs:
                self.server.engine.cancel(seq)

    async def whole(self, request):
        parts = [[] for _ in self.seqs]
        try:
            async for i, delta, ended in self._events(request):
                parts[i].append(delta)
        except _Gone:
            return JSONResponse({}, status_code=499)  # nobody reads it
        finally:
            for seq in self.seqs:
                self.server.engine.cancel(seq)
        reasons = [self._reason(i) for i in range(len(self.seqs))]
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": "".join(p)}, "logprobs": None,
                        "finish_reason": r} for i, (p, r) in enumerate(zip(parts, reasons))]
        else:
            choices = [{"index": i, "text": "".join(p), "logprobs": None, "finish_reason": r}
                       for i, (p, r) in enumerate(zip(parts, reasons))]
        return JSONResponse({"id": self.id, "object": self.object, "created": self.created, "model": self.server.name,
                             "choices": choices, "usage": self._usage()})
