"""`bench decode`'s serving rows: `handgrad serve`'s engine (serve/engine.py) decoding 1 and then
BATCH concurrent sequences, the aggregate tokens/s over all of them, timed as the engine runs them
for a server (a batched step over every active sequence, each at its own position), without the
HTTP around it (tools/serve_load.py loads that; its cost is a few ms per token of Python). The
engine's loop runs on the bench's own thread (Engine.drain), as a server runs it on its one.

Each sequence is greedy, with its own prompt and max_tokens = new tokens, no end id, so every one
decodes the same count. The time runs from the submit to the last sequence's end: prefills
included (the prompts admitted together prefilled together, as in serve)."""
import time

import numpy as np

from ..serve.engine import Engine, Sequence


class EngineRows:
    """One engine (rows = the most streams timed), reused by every timed turn, driven on the
    caller's thread (Engine.drain): the bench's other rows run their kernels there too, and a
    second thread's OpenMP pool would slow both (serve/engine.py's _passing)."""

    def __init__(self, model, streams, length, dtype="float32"):
        self.engine = Engine(model, slots=streams, length=length, max_waiting=streams, dtype=dtype)

    def seconds(self, prompts, new_tokens):
        """Decode one greedy sequence per prompt row, all submitted at once; the wall time."""
        seqs = [Sequence(p.tolist(), new_tokens, temperature=0) for p in np.atleast_2d(prompts)]
        t0 = time.perf_counter()
        self.engine.submit(seqs)
        self.engine.drain()
        seconds = time.perf_counter() - t0
        if any(s.finish != "length" or len(s.tokens) != new_tokens for s in seqs):
            raise RuntimeError(f"bench decode: an engine sequence ended early: {[s.finish for s in seqs]}")
        self.tokens = [s.tokens for s in seqs]
        return seconds
