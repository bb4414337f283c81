"""`handgrad serve` (serve/): the engine's batched decoding gives every stream the tokens it gets
alone (KVCache.step_rows against generate, GPT-2 and Llama, streams joining mid-way); the HTTP
API through the openai client (chat and completions, streamed and not, n, seed, stop) with
greedy replies equal to `sample --chat`'s; bad requests are 400/404/413/429 with OpenAI's error
object naming the field; a client that leaves mid-stream frees its stream at once; the chat page
in headless Chromium sends a message and shows the streamed reply; bad flags are one line."""
import json
import os
import re
import shutil
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from handgrad import GPT, GPTConfig
from handgrad.cli import build_parser, main as cli
from handgrad.config import Gemma3Config, LlamaConfig
from handgrad.data.chat import load_chat_format
from handgrad.models.decode import generate
from handgrad.models.gemma3 import Gemma3
from handgrad.models.llama import Llama
from handgrad.sample import SEPARATOR, load_run
from handgrad.serve.command import build
from handgrad.serve.engine import Busy, Engine, Sequence, _groups
from helpers import tiny_run

uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")


def random_model(model, seed=0, scale=0.3):
    model.params[:] = np.random.default_rng(seed).standard_normal(model.num_params, dtype=np.float32) * np.float32(scale)
    return model


MODELS = {
    "gpt2": lambda: random_model(GPT(GPTConfig(block_size=48, vocab_size=67, n_layer=2, n_head=3, n_embd=48), seed=0)),
    "llama": lambda: random_model(Llama(LlamaConfig(block_size=48, vocab_size=67, n_layer=2, n_head=6, n_kv_head=2,
                                                    n_embd=48, ffn_hidden=80), seed=0)),
    "gemma3": lambda: random_model(Gemma3(Gemma3Config(block_size=48, vocab_size=67, n_layer=3, n_head=6, n_kv_head=2,
                                                       n_embd=48, head_dim=8, ffn_hidden=80, sliding_window=5,
                                                       sliding_window_pattern=2), seed=0)),
}


# ---------------------------------------------------------------- the engine
def run_engine(engine, batches):
    """Submit each batch of sequences once the engine has taken `after` steps; wait for all to end."""
    ended = threading.Semaphore(0)
    every = []
    for after, seqs in batches:
        for s in seqs:
            s.emit = lambda token: token is None and ended.release()
        while engine.steps < after:
            time.sleep(0.001)
        engine.submit(seqs)
        every += seqs
    for _ in every:
        assert ended.acquire(timeout=60)
    return every


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_batched_streams_get_the_tokens_they_get_alone(arch, dtype):
    model = MODELS[arch]()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 67, n).tolist() for n in (1, 5, 11, 3, 8)]
    news = [12, 20, 7, 15, 9]
    alone = [generate(model, [p], n, temperature=0, dtype=dtype)[0, len(p):].tolist() for p, n in zip(prompts, news)]
    engine = Engine(model, slots=3, length=40, max_waiting=8, dtype=dtype).start()  # 5 sequences, 3 rows: some wait
    try:
        seqs = run_engine(engine, [(0, [Sequence(p, n, temperature=0) for p, n in zip(prompts[:2], news[:2])]),
                                   (4, [Sequence(p, n, temperature=0) for p, n in zip(prompts[2:], news[2:])])])
    finally:
        engine.stop()
    assert [s.tokens for s in seqs] == alone
    assert all(s.finish == "length" for s in seqs)
    assert engine.steps < sum(news)  # steps were shared


def test_an_engine_drained_on_the_callers_thread_decodes_as_its_own_thread_does():
    """drain() (bench decode's rows: the engine's kernels on the caller's thread, no second OpenMP
    pool) runs the same loop: each sequence gets the tokens it gets alone, waiting ones included;
    and the constructor's bf16 copies were made on a thread that is gone."""
    import threading
    model = MODELS["llama"]()
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 67, n).tolist() for n in (3, 9, 5)]
    alone = [generate(model, [p], 8, temperature=0, dtype="bfloat16")[0, len(p):].tolist() for p in prompts]
    engine = Engine(model, slots=2, length=40, dtype="bfloat16")  # 3 sequences, 2 rows: one waits
    assert not [t for t in threading.enumerate() if t.name.startswith("handgrad-engine")]
    seqs = [Sequence(p, 8, temperature=0) for p in prompts]
    engine.submit(seqs)
    engine.drain()
    assert [s.tokens for s in seqs] == alone and all(s.finish == "length" for s in seqs)
    engine.drain()  # nothing left: returns at once


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_prompts_prefilled_together_get_the_tokens_they_get_alone(arch):
    """Four prompts taken at once: three of similar length prefilled together, right-padded; the
    longest alone (padding it with the others would run more than PAD_WASTE times their positions)."""
    model = MODELS[arch]()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 67, n).tolist() for n in (6, 4, 13, 5)]
    alone = [generate(model, [p], 10, temperature=0)[0, len(p):].tolist() for p in prompts]
    seqs = [Sequence(p, 10, temperature=0) for p in prompts]
    assert [[len(s.prompt) for _, s in g] for g in _groups(list(enumerate(seqs)), 40)] == [[4, 5, 6], [13]]
    assert [[len(s.prompt) for _, s in g] for g in _groups(list(enumerate(seqs)), 10)] == [[4, 5], [6], [13]]
    engine = Engine(model, slots=4, length=40).start()
    try:
        run_engine(engine, [(0, seqs)])
    finally:
        engine.stop()
    assert [s.tokens for s in seqs] == alone


def test_seeded_sampling_and_stop_ids_match_generate():
    model = MODELS["llama"]()
    prompt = [5, 9, 2]
    ref = generate(model, [prompt], 25, temperature=0.9, top_k=20, top_p=0.9, rng=np.random.default_rng(42))[0, 3:]
    stop = int(ref[6])
    engine = Engine(model, slots=2, length=40).start()
    try:
        a, b = run_engine(engine, [(0, [Sequence(prompt, 25, 0.9, 20, 0.9, seed=42),
                                        Sequence(prompt, 25, 0.9, 20, 0.9, seed=42, stop_ids=[stop])])])
    finally:
        engine.stop()
    assert a.tokens == ref.tolist()
    first = ref.tolist().index(stop)
    assert b.tokens == ref[:first].tolist() and b.finish == "stop"  # the end id is not a token of the reply


def test_engine_refuses_what_does_not_fit_and_too_many_waiting():
    model = MODELS["gpt2"]()
    engine = Engine(model, slots=1, length=16, max_waiting=1)  # not started: nothing leaves the queue
    with pytest.raises(ValueError, match="do not fit"):
        engine.submit([Sequence([1] * 10, 7)])
    engine.submit([Sequence([1], 3), Sequence([2], 3)])  # one for the free row, one waiting
    with pytest.raises(Busy, match="at most 1 waiting"):
        engine.submit([Sequence([3], 3)])


def test_text_is_decoded_incrementally_and_cut_at_a_stop_string():
    """serve's Text on a byte-level decoder (one UTF-8 byte a token): characters split across
    tokens are held back until complete, a stop string split across tokens is never sent, and the
    pieces join to the text up to the stop."""
    from handgrad.serve.app import Text
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    whole = "héllo wörld ✓ STOP and after"
    for stops, want in (([], whole), (["STOP"], "héllo wörld ✓ "), (["ST", "wör"], "héllo ")):
        text = Text(decode, stops)
        pieces = []
        for b in whole.encode():
            pieces.append(text.add(b))
            if text.stopped:
                break
        pieces.append(text.finish())
        assert "".join(pieces) == want and text.stopped == bool(stops)
        assert not any("\ufffd" in p for p in pieces)
        assert not any(stop in p for p in pieces for stop in stops)
    text = Text(decode, [])
    assert text.add("é".encode()[0]) == "" and text.finish() == "\ufffd"  # an incomplete character, sent at the end


# ---------------------------------------------------------------- the HTTP server
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """handgrad serve on a free loopback port, in this process (uvicorn on a thread)."""

    def __init__(self, run, *flags):
        port = free_port()
        args = build_parser().parse_args(["serve", "--run", str(run), "--port", str(port), *flags])
        self.server, self.engine = build(args)
        self.engine.start()
        self.uv = uvicorn.Server(uvicorn.Config(self.server.app(), host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        while not self.uv.started:
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def close(self):
        self.uv.should_exit = True
        self.thread.join(10)
        self.engine.stop()

    def post(self, path, body, timeout=30):
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.url + path, content=content, headers={"Content-Type": "application/json"},
                          timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("serve") / "run")


@pytest.fixture(scope="module")
def served(run):
    s = Served(run, "--max-streams", "4", "--max-waiting", "4", "--max-tokens", "40", "--max-body", "4096",
               "--name", "tiny")
    yield s
    s.close()


def sample_chat(run, prompt, n, capsys):
    """`handgrad sample --chat` greedy: the reply it prints."""
    capsys.readouterr()
    assert cli(["sample", "--run", str(run), "--chat", "--prompt", prompt, "--temperature", "0",
                "--max-new-tokens", str(n)]) == 0
    out = capsys.readouterr().out
    assert out.endswith(f"\n{SEPARATOR}\n")
    return out[:-len(SEPARATOR) - 2]


@pytest.mark.parametrize("prompt, n", [("hello there how are you", 30), ("tell me a story", 12)])
def test_chat_greedy_equals_sample_chat_streamed_or_not(served, run, prompt, n, capsys):
    ref = sample_chat(run, prompt, n, capsys)
    messages = [{"role": "user", "content": prompt}]
    r = served.client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=n)
    assert r.choices[0].message.content == ref and r.model == "tiny" and r.object == "chat.completion"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= n and r.usage.prompt_tokens > 0
    chunks = list(served.client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                                        max_tokens=n, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_completions_n_seed_and_stop(served, run):
    model, tok, _ = load_run(str(run))
    ids = tok.encode("the quick brown")
    ref = generate(model, [ids], 20, 0.8, 40, 0.95, np.random.default_rng(7), min_p=0.05,  # top_k, top_p, min_p:
                   vocab=tok.vocab_size)[0, len(ids):]                                      # llama.cpp's defaults
    eot = tok.eot_id
    ref = ref[:list(ref).index(eot)] if eot is not None and eot in ref else ref
    r = served.client.completions.create(model="tiny", prompt="the quick brown", max_tokens=20, temperature=0.8,
                                         seed=7, n=2)
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == tok.decode([int(i) for i in ref])  # choice 0 draws as `sample --seed 7`
    again = served.client.completions.create(model="tiny", prompt="the quick brown", max_tokens=20, temperature=0.8,
                                             seed=7, n=2)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: repeatable
    whole = r.choices[0].text
    stop = whole.strip().split(" ")[1] if len(whole.split()) > 2 else whole[3:6]
    cut = served.client.completions.create(model="tiny", prompt="the quick brown", max_tokens=20, temperature=0.8,
                                           seed=7, stop=[stop])
    assert cut.choices[0].text == whole[:whole.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = served.client.completions.create(model="tiny", prompt="the quick brown", max_tokens=20,
                                                temperature=0.8, seed=7, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_a_request_samples_with_its_fields_else_the_models_settings(run, tmp_path):
    """A model whose generation_config.json says greedy: a request that sets no sampling field is
    greedy; one that sets temperature draws with it and llama.cpp's other defaults; a
    repetition_penalty field penalizes as generate does."""
    from starlette.testclient import TestClient
    from handgrad.interop.load import write_generation_config
    own = tmp_path / "own"
    shutil.copytree(run, own)
    write_generation_config(own, ({"temperature": 0}, "the model's generation_config.json"))
    server, engine = build(build_parser().parse_args(["serve", "--run", str(own)]))
    model, tok, _ = load_run(str(own))
    ids = tok.encode("the quick brown")

    def text(ref):
        ref = ref[0, len(ids):].tolist()
        return tok.decode(ref[:ref.index(tok.eot_id)] if tok.eot_id in ref else ref)
    engine.start()
    try:
        with TestClient(server.app()) as client:
            def complete(**fields):
                r = client.post("/v1/completions", json={"prompt": "the quick brown", "max_tokens": 12, **fields})
                return r.json()["choices"][0]["text"]
            greedy = text(generate(model, [ids], 12, temperature=0, vocab=tok.vocab_size))
            assert complete() == greedy
            hot = text(generate(model, [ids], 12, 1.5, 40, 0.95, np.random.default_rng(3), min_p=0.05,
                                vocab=tok.vocab_size))
            assert complete(temperature=1.5, seed=3) == hot != greedy
            penalized = text(generate(model, [ids], 12, temperature=0, repetition_penalty=3.0, vocab=tok.vocab_size))
            assert complete(repetition_penalty=3.0) == penalized != greedy
    finally:
        engine.stop()


def test_models_health_and_page(served):
    assert [m.id for m in served.client.models.list().data] == ["tiny"]
    health = httpx.get(served.url + "/health").json()
    assert health["status"] == "ok" and health["slots"] == 4 and health["context"] == 96
    page = httpx.get(served.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"] and "tiny" in page.text
    # its icon rides in the page (so no /favicon.ico request), and each turn is labelled by CSS
    import urllib.parse
    import xml.etree.ElementTree as ET
    icon = re.search(r'<link rel="icon" href="data:image/svg\+xml,([^"]+)">', page.text)
    assert icon and ET.fromstring(urllib.parse.unquote(icon.group(1))).tag == "{http://www.w3.org/2000/svg}svg"
    assert '.user::before { content: "You"; }' in page.text and '.assistant::before { content: "Assistant"; }' \
        in page.text


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ([1, 2], 400, None),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 41}, 400, "max_tokens"),  # over --max-tokens
    ({"messages": [{"role": "user", "content": "hi"}], "n": 5}, 400, "n"),  # over --max-streams
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_k": -1}, 400, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}], "min_p": 1.5}, 400, "min_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": [1]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    ({"messages": [{"role": "user", "content": "hi " * 200}]}, 400, "messages"),  # longer than the context
    ({"messages": [{"role": "user", "content": "hi " * 25}], "max_tokens": 40}, 400, "max_tokens"),  # no room
    ({"messages": [{"role": "user", "content": "x" * 5000}]}, 413, None),  # over --max-body
])
def test_bad_requests_name_the_field(served, body, status, param):
    r = served.post("/v1/chat/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_bad_completions_and_routes(served):
    r = served.post("/v1/completions", {"prompt": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.get(served.url + "/v1/nothing")
    assert r.status_code == 404 and "/v1/nothing" in r.json()["error"]["message"]
    r = httpx.get(served.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        served.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              temperature=-1)


def slow(engine, monkeypatch, seconds=0.02):
    """Make each engine step take at least `seconds`, so a reply lasts long enough to interrupt."""
    step = engine._step

    def slowed():
        time.sleep(seconds)
        step()
    monkeypatch.setattr(engine, "_step", slowed)


def wait_idle(url, within=2.0):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < within:
        h = httpx.get(url + "/health").json()
        if h["active"] == 0 and h["waiting"] == 0:
            return time.perf_counter() - t0
        time.sleep(0.02)
    raise AssertionError(f"streams still busy after {within} s: {h}")


def wait_active(url, within=5.0):
    """Wait until the server decodes one sequence (its prefill done)."""
    t0 = time.perf_counter()
    while httpx.get(url + "/health").json()["active"] != 1:
        assert time.perf_counter() - t0 < within, "the request never started decoding"
        time.sleep(0.01)


def test_a_client_that_leaves_frees_its_stream_at_once(served, monkeypatch):
    body = {"prompt": "hello", "max_tokens": 40, "temperature": 0, "stream": True}  # greedy: 40 tokens, no end
    # the first steps in a process load the kernels (seconds with a cold Numba cache): not what is timed
    assert httpx.post(served.url + "/v1/completions", json=dict(body, stream=False), timeout=120).status_code == 200
    slow(served.engine, monkeypatch)
    for _ in range(3):
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            wait_active(served.url)
        assert wait_idle(served.url) < 0.5  # 40 tokens would take >= 0.8 s
    # and a non-streaming client that gives up
    with pytest.raises(httpx.ReadTimeout):
        served.post("/v1/completions", dict(body, stream=False), timeout=0.2)
    wait_idle(served.url)


def test_too_many_waiting_is_429(run, monkeypatch):
    s = Served(run, "--max-streams", "1", "--max-waiting", "0")
    try:
        slow(s.engine, monkeypatch, 0.05)
        with httpx.stream("POST", s.url + "/v1/completions", timeout=30,
                          json={"prompt": "hi", "max_tokens": 30, "stream": True, "temperature": 0}) as r:
            assert r.status_code == 200
            wait_active(s.url)  # greedy: 30 tokens, no end on the way
            busy = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert busy.status_code == 429 and busy.json()["error"]["code"] == "too_many_requests"
        wait_idle(s.url)
        assert s.post("/v1/completions", {"prompt": "hi", "max_tokens": 3}).status_code == 200
    finally:
        s.close()


def test_bad_flags_are_one_line(run, capsys):
    for flags, says in [(["--run", str(run) + "-missing"], "run-missing"), (["--run", str(run), "--context", "1"], "--context"),
                        (["--run", str(run), "--max-streams", "0"], "--max-streams"),
                        (["--run", str(run), "--max-prompt-tokens", "96"], "--max-prompt-tokens")]:
        assert cli(["serve", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err


def test_each_request_is_one_log_line_unless_quiet(run, monkeypatch, capsys):
    """`handgrad serve` logs every request once on stderr, when its response has ended (method, path,
    status, tokens generated, milliseconds), with uvicorn's own access log off; --quiet logs none.
    uvicorn.run is replaced by Starlette's test client over the app serve hands it."""
    from starlette.testclient import TestClient
    handed = {}

    def requests(app, **kwargs):
        handed.update(kwargs)
        with TestClient(app) as client:
            assert client.get("/health").status_code == 200
            r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5, "temperature": 0})
            handed["tokens"] = r.json()["usage"]["completion_tokens"]
            assert client.get("/v1/nothing").status_code == 404
    monkeypatch.setattr(uvicorn, "run", requests)
    logged = {}
    for quiet in (False, True):
        capsys.readouterr()
        assert cli(["serve", "--run", str(run), *(["--quiet"] if quiet else [])]) == 0
        err = capsys.readouterr().err.splitlines()
        assert err[1].startswith("serving on http://127.0.0.1:8000/")  # the two lines at the start
        logged[quiet] = err[2:]
    assert handed["access_log"] is False and 1 <= handed["tokens"] <= 5
    assert [re.sub(r" \d+ ms$", " N ms", line) for line in logged[False]] == [
        "GET /health 200 0 tokens N ms", f"POST /v1/completions 200 {handed['tokens']} tokens N ms",
        "GET /v1/nothing 404 0 tokens N ms"]
    assert logged[True] == []


# ---------------------------------------------------------------- the chat page, in a real browser
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER) and not os.environ.get("CI"),
                    reason="Debian's chromium and chromium-driver are not installed (.ci/run installs them)")
def test_chat_page_in_headless_chromium(served, run, tmp_path, capsys):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    ref = sample_chat(run, "hello there how are you", 30, capsys)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    try:
        driver.get(served.url + "/?temperature=0&max_tokens=30")
        assert "tiny" in driver.title
        driver.find_element(By.ID, "input").send_keys("hello there how are you")
        driver.find_element(By.ID, "send").click()
        reply = WebDriverWait(driver, 30).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, ".assistant[data-done='1']"))[0]
        assert reply.get_attribute("textContent") == ref  # the streamed reply, as sample --chat gives it
        assert driver.execute_script("return messages.length") == 2
        labels = driver.execute_script("return [...document.querySelectorAll('.msg')].map("
                                       "m => getComputedStyle(m, '::before').content)")
        assert labels == ['"You"', '"Assistant"']  # shown beside each turn, not part of its text
        driver.find_element(By.ID, "reset").click()
        assert driver.find_elements(By.CSS_SELECTOR, ".msg") == []
        assert driver.execute_script("return messages.length") == 0
    finally:
        driver.quit()


def test_load_tool_short_run(served):
    """tools/serve_load.py's load for a few seconds: every valid request ends, every bad one gets its
    4xx, and no stream is left busy (the 60 s, 32-client run is recorded in docs/PERFORMANCE.md)."""
    import asyncio
    import importlib.util
    from pathlib import Path
    path = Path(__file__).parent.parent / "tools" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("serve_load", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    stats = asyncio.run(tool.load(served.url, clients=4, seconds=4, pid=os.getpid(), max_tokens=30))
    assert stats["valid_ok"] > 0 and stats["valid_failed"] == 0, stats
    assert stats["bad_ok"] > 0 and stats["bad_wrong"] == 0, stats
    assert stats["left_mid_stream"] > 0 and not stats["leaked"], stats
