"""A bounded load test of `handgrad serve` on loopback (issue 40's proof).

    python tools/serve_load.py --run smollm2-135m-instruct --clients 32 --seconds 60
    python tools/serve_load.py --url http://127.0.0.1:8000 --pid PID --clients 32 --seconds 60

With --run it starts `handgrad serve` itself on a free port (and stops it after); with --url it
loads a server already running (--pid names its process, for its memory). Each client loops until
the time is up, drawing what to send next:
- a valid streaming chat request (70%): read to `data: [DONE]`; it counts as failed unless it
  ends with a finish_reason and [DONE] (a 429 also counts as failed: the default limits queue 32);
- a client that leaves mid-stream (15%): reads a few events, then closes the connection;
- a bad request (15%): bad JSON, a bad field, an oversized body or an unknown route; it must get
  its 4xx with OpenAI's error object.
Meanwhile the server's resident memory is sampled each second. After the clients stop, /health
must show no active or waiting sequence within 5 s (no leaked stream). Prints one JSON object
(--out also writes it); exits 1 when a valid request failed, a bad request got the wrong answer, a
stream leaked, or memory grew by more than --rss-growth-mib after the warm-up (the first quarter).
"""
import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

QUESTIONS = ["What is the capital of France?", "Tell me a short story about a fox.", "Name three colours.",
             "How do plants grow?", "Write a haiku about the sea.", "What is 12 times 7?"]
BAD = [  # (body, expected status)
    (b"{not json", 400),
    (json.dumps({"messages": "hi"}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode(), 413),
]


def rss_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def client(http, url, deadline, rng, stats, max_tokens):
    while time.monotonic() < deadline:
        r = rng.random()
        if r < 0.15:  # a bad request
            body, want = rng.choice(BAD + [(None, 404)])
            if body is None:
                resp = await http.get(url + "/v1/no-such-route")
            else:
                resp = await http.post(url + "/v1/chat/completions", content=body,
                                       headers={"Content-Type": "application/json"})
            ok = resp.status_code == want and "error" in resp.json()
            stats["bad_ok" if ok else "bad_wrong"] += 1
            continue
        leave = r < 0.30
        body = {"messages": [{"role": "user", "content": rng.choice(QUESTIONS)}], "stream": True,
                "max_tokens": rng.randint(8, max_tokens), "temperature": 0.7, "seed": rng.randint(0, 1 << 30),
                "stream_options": {"include_usage": True}}
        t0, events, finished, done = time.monotonic(), 0, False, False
        try:
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    stats["valid_failed"] += 1
                    stats.setdefault("statuses", {}).setdefault(str(resp.status_code), 0)
                    stats["statuses"][str(resp.status_code)] += 1
                    continue
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    event = json.loads(line[6:])
                    events += 1
                    if event.get("usage"):
                        stats["tokens"] += event["usage"]["completion_tokens"]
                    if event["choices"] and event["choices"][0]["finish_reason"]:
                        finished = True
                    if leave and events >= 3:
                        break
        except httpx.HTTPError as e:
            stats["valid_failed"] += 1
            stats.setdefault("errors", []).append(repr(e)[:200])
            continue
        if leave:
            stats["left_mid_stream"] += 1
        elif finished and done:
            stats["valid_ok"] += 1
            stats["stream_s"].append(time.monotonic() - t0)
        else:
            stats["valid_failed"] += 1
            stats.setdefault("errors", []).append(f"stream ended after {events} events, finish_reason "
                                                  f"{'seen' if finished else 'missing'}, [DONE] {'seen' if done else 'missing'}")


async def load(url, clients, seconds, pid=None, seed=0, max_tokens=64):
    stats = {"valid_ok": 0, "valid_failed": 0, "left_mid_stream": 0, "bad_ok": 0, "bad_wrong": 0, "tokens": 0, "stream_s": []}
    rss, deadline = [], time.monotonic() + seconds

    async def sample_rss():
        while time.monotonic() < deadline:
            if pid is not None:
                rss.append(rss_mib(pid))
            await asyncio.sleep(1.0)
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as http:
        rng = random.Random(seed)
        await asyncio.gather(sample_rss(), *[client(http, url, deadline, random.Random(rng.random()), stats,
                                                    max_tokens)
                                             for _ in range(clients)])
        t0, health = time.monotonic(), None
        while time.monotonic() - t0 < 5:
            health = (await http.get(url + "/health")).json()
            if health["active"] == 0 and health["waiting"] == 0:
                break
            await asyncio.sleep(0.05)
    times = sorted(stats.pop("stream_s"))
    stats["stream_s_median"] = times[len(times) // 2] if times else None
    stats["stream_s_p95"] = times[int(len(times) * 0.95)] if times else None
    stats["tokens_per_s"] = round(stats["tokens"] / seconds, 1)  # of the streams read to the end
    stats["health_after"] = health
    stats["leaked"] = not (health and health["active"] == 0 and health["waiting"] == 0)
    if rss:
        warm = rss[len(rss) // 4:]
        stats["rss_mib"] = {"first": round(rss[0]), "after_warmup": round(warm[0]), "max": round(max(rss)),
                            "last": round(rss[-1]), "growth_after_warmup": round(max(warm) - warm[0], 1)}
    return stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", help="start `handgrad serve --run RUN` on a free port")
    ap.add_argument("--url", help="load a server already running, e.g. http://127.0.0.1:8000")
    ap.add_argument("--pid", type=int, help="with --url: the server's process id, for its memory")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=64, help="valid requests ask for 8 to this many tokens")
    ap.add_argument("--rss-growth-mib", type=float, default=64, help="fail when memory grows more after warm-up")
    ap.add_argument("--out", help="also write the JSON here")
    args, serve_flags = ap.parse_known_args(argv)
    if bool(args.run) == bool(args.url):
        ap.error("give --run (start a server) or --url (load a running one)")
    proc = None
    if args.run:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "handgrad", "serve", "--run", args.run, "--port", str(port),
                                 *serve_flags], stderr=subprocess.PIPE, text=True)
        url, pid = f"http://127.0.0.1:{port}", proc.pid
        t0 = time.monotonic()
        while True:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() - t0 > 300:
                    sys.exit(f"error: the server did not start: {proc.stderr.read()[-2000:]}")
                time.sleep(0.5)
    else:
        url, pid = args.url.rstrip("/"), args.pid
    try:
        stats = asyncio.run(load(url, args.clients, args.seconds, pid, max_tokens=args.max_tokens))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    stats.update(clients=args.clients, seconds=args.seconds)
    text = json.dumps(stats, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    grew = stats.get("rss_mib", {}).get("growth_after_warmup", 0) > args.rss_growth_mib
    return 1 if stats["valid_failed"] or stats["bad_wrong"] or stats["leaked"] or grew else 0


if __name__ == "__main__":
    sys.exit(main())
