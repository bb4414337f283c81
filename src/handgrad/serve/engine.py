"""The serving engine: many sequences decoded together, one batched step at a time.

One thread owns the model and a KV cache of `slots` rows (models/decode.py), one per sequence being
decoded. Each turn it admits waiting sequences into free rows (their prompts prefilled together,
right-padded, in a one-row prefill cache, then copied into their rows), frees the rows of sequences
that ended or were cancelled, and runs one KVCache.step_rows over every active sequence; new
sequences join between steps, and nothing waits for a batch to drain.

Row i of a step computes what a decoding step of that sequence alone computes (the attention and
RoPE are its own; the linears are the same sums over a batch of rows), so a greedy sequence gets the
tokens `sample` gives it, whatever decodes beside it (tests/test_serve.py checks it). All kernels
run on one thread, the engine's or drain's caller's: see _passing."""
import collections
import sys
import threading
import traceback

import numpy as np

from ..models.sampling import sample_logits

PAD_WASTE = 1.5  # a group of prompts prefilled together runs at most this many times their positions


class Busy(RuntimeError):
    """More sequences than the engine lets wait for a free row."""


class Sequence:
    """One completion to decode: its prompt ids, how long it may grow, its sampling settings (as
    models/sampling.py's sample_logits takes them, the server's resolved ones; seed None: fresh
    entropy) and the ids that end it.

    It reports through `emit`, called on the engine's thread: emit(token_id) for each new token,
    then emit(None) once when it ends, with `finish` set to "stop" (an end id was sampled: it is not
    emitted), "length" (max_tokens), "cancelled" or "error". The server turns those into text and
    HTTP (serve/app.py)."""

    def __init__(self, prompt, max_tokens, temperature=1.0, top_k=None, top_p=None, seed=None, stop_ids=(),
                 emit=None, min_p=None, repetition_penalty=None):
        self.prompt = [int(i) for i in prompt]
        self.max_tokens = int(max_tokens)
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             repetition_penalty=repetition_penalty)
        self.rng = np.random.default_rng(seed)
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.emit = emit if emit is not None else (lambda token: None)
        self.tokens = []  # sampled so far (an end id excluded)
        self.finish = None  # set once, when it ends
        self.cancelled = False
        self.pos = 0  # where its newest token is fed next: len(prompt) + len(tokens) - 1


class Engine:
    """Decodes the sequences submitted to it on its own thread (start() it, stop() it), or on the
    caller's (drain(), never started).

    model: a handgrad model (LoRA adapters are folded in); slots: sequences decoded at once;
    length: positions per row (prompt plus new tokens); max_waiting: sequences queued beyond the
    rows before submit refuses; vocab: only ids below it are sampled (the tokenizer's size); dtype:
    the decoding weights' (models/decode.py's DTYPES)."""

    def __init__(self, model, slots=8, length=None, max_waiting=32, vocab=None, dtype="float32"):
        if getattr(model, "lora", None) is not None:
            model = _passing(model.plain)  # the adapters folded in: a server decodes at the plain model's speed
        self.model, self.vocab, self.max_waiting = model, vocab, max_waiting
        self.length = length = min(length or model.config.block_size, model.config.block_size)
        self.cache = _passing(lambda: model.KV_CACHE(model, slots, length, dtype=dtype))
        # prompts are prefilled here, several at once while their padded positions fit one row's
        self.pre = model.KV_CACHE(model, 1, length, dtype=dtype, share=self.cache)
        self.slots = slots
        self.free = list(range(slots - 1, -1, -1))  # pop() gives row 0 first
        self.active = {}  # row -> Sequence
        self.waiting = collections.deque()
        self.cv = threading.Condition()
        self.stopping = False
        self.steps = self.tokens = 0  # batched steps run, tokens sampled (stats for /health and bench)
        self.thread = threading.Thread(target=self._loop, name="handgrad-engine", daemon=True)

    # ------------------------------------------------------------ the caller's side (any thread)
    def start(self):
        self.thread.start()
        return self

    def stop(self):
        with self.cv:
            self.stopping = True
            self.cv.notify()
        self.thread.join()

    def submit(self, seqs):
        """Queue sequences to decode, all or none: Busy when more than max_waiting would wait;
        ValueError when a prompt plus its max_tokens does not fit a row."""
        for s in seqs:
            if not s.prompt or s.max_tokens < 1 or len(s.prompt) + s.max_tokens > self.length:
                raise ValueError(f"a prompt of {len(s.prompt)} tokens and max_tokens {s.max_tokens} do not fit "
                                 f"the {self.length} positions of a row")
        with self.cv:
            if len(self.waiting) + len(seqs) - len(self.free) > self.max_waiting:
                raise Busy(f"{len(self.active)} sequences decoding and {len(self.waiting)} waiting: "
                           f"the server takes at most {self.max_waiting} waiting; try again shortly")
            self.waiting.extend(seqs)
            self.cv.notify()

    def cancel(self, seq):
        """Stop a sequence (its row is freed before the next step); no-op once it has ended."""
        with self.cv:
            if seq.finish is None:
                seq.cancelled = True
                self.cv.notify()

    def load(self):
        """(active, waiting, free rows), for /health."""
        with self.cv:
            return len(self.active), len(self.waiting), len(self.free)

    def drain(self):
        """Decode on the calling thread until nothing waits or decodes: an engine never start()ed,
        driven by its caller (bench decode's rows, whose kernels so share the caller's OpenMP pool)."""
        while self._turn(wait=False):
            pass

    # ------------------------------------------------------------ the engine's thread
    def _loop(self):
        while self._turn(wait=True):
            pass

    def _turn(self, wait):
        """Admit and prefill what waits, then one step over every active sequence. False when
        stopping, or (wait False) when there was nothing to do; wait True: sleep until there is."""
        with self.cv:
            while wait and not self.stopping and not self.waiting and not self.active:
                self.cv.wait()
            if self.stopping:
                for seq in list(self.active.values()) + list(self.waiting):
                    self._end(seq, "cancelled")
                return False
            if not self.waiting and not self.active:
                return False
            admit = []
            while self.free and self.waiting:
                seq = self.waiting.popleft()
                if seq.cancelled:
                    self._end(seq, "cancelled")
                else:
                    admit.append((self.free.pop(), seq))
        try:
            for group in _groups(admit, self.length):
                for row, seq in group:
                    self.active[row] = seq
                self._prefill(group)
            self._release()
            if self.active:
                self._step()
                self._release()
        except Exception:  # a bug, not a user's mistake: end what was decoding and go on serving
            traceback.print_exc(file=sys.stderr)
            with self.cv:
                for row, seq in list(self.active.items()):
                    self._end(seq, "error")
                    del self.active[row]
                    self.free.append(row)
        return True

    def _end(self, seq, why):
        if seq.finish is None:
            seq.finish = why
            seq.emit(None)

    def _release(self):
        """Free the rows of sequences that ended or were cancelled."""
        with self.cv:
            for row, seq in list(self.active.items()):
                if seq.cancelled:
                    self._end(seq, "cancelled")
                if seq.finish is not None:
                    del self.active[row]
                    self.free.append(row)

    def _prefill(self, group):
        """Prefill the prompts of group [(row, seq)] together, right-padded, into self.pre; copy
        each into its row and sample its first token."""
        lengths = [len(seq.prompt) for _, seq in group]
        T = max(lengths)
        ids = np.zeros((len(group), T), np.int64)
        last = np.zeros((len(group), T), bool)  # each prompt's last position: the logits wanted
        for i, (_, seq) in enumerate(group):
            ids[i, :lengths[i]] = seq.prompt
            last[i, lengths[i] - 1] = True
        self.pre.resize(len(group), T)
        logits = self.pre.extend(ids, select=last)  # (len(group), V), row-major: prompt i's at i
        for i, (row, seq) in enumerate(group):
            self.cache.load_row(row, self.pre, row=i)
            seq.pos = lengths[i]
            self._take(seq, logits[i:i + 1])

    def _step(self):
        rows = [row for row, seq in self.active.items() if seq.finish is None and not seq.cancelled]
        if not rows:
            return
        seqs = [self.active[row] for row in rows]
        logits = self.cache.step_rows([s.tokens[-1] for s in seqs], rows, [s.pos for s in seqs])
        self.steps += 1
        for i, seq in enumerate(seqs):
            seq.pos += 1
            self._take(seq, logits[i:i + 1])

    def _take(self, seq, logits):
        """Sample the sequence's next token from its logits (1, V) and report it, or its end."""
        seen = [seq.prompt + seq.tokens] if seq.sampling["repetition_penalty"] not in (None, 1) else None
        token = int(sample_logits(logits[:, :self.vocab], rng=seq.rng, seen=seen, **seq.sampling)[0])
        self.tokens += 1
        if token in seq.stop_ids:
            self._end(seq, "stop")
            return
        seq.tokens.append(token)
        seq.emit(token)
        if len(seq.tokens) >= seq.max_tokens:
            self._end(seq, "length")


def _groups(admit, capacity):
    """admit [(row, seq)] in groups prefilled together: by prompt length, a sequence joining the
    group before it while the group's padded positions (its size times the longest prompt) stay
    within PAD_WASTE times its prompts' positions and within capacity (the prefill cache's). Padding
    goes after each prompt, which causal attention never lets the prompt's positions see."""
    groups, total = [], 0
    for row, seq in sorted(admit, key=lambda rs: len(rs[1].prompt)):
        n = len(seq.prompt)
        padded = (len(groups[-1]) + 1) * n if groups else 0
        if groups and padded <= PAD_WASTE * (total + n) and padded <= capacity:
            groups[-1].append((row, seq))
            total += n
        else:
            groups.append([(row, seq)])
            total = n
    return groups


def _passing(fn):
    """fn()'s result, computed on a thread that ends with it, so that any OpenMP pool its kernels
    make ends too.

    Numba's OpenMP layer (and MKL's, oneDNN's: one GNU OpenMP) gives every thread that launches a
    parallel kernel its own pool of workers for as long as that thread lives; with more workers than
    cores they sleep between kernels instead of spinning, and a decode step launches ~120. On the
    2-core AMD EPYC Zen 5, SmolLM2-135M decoded one stream at 79-84 tok/s with one launching thread
    and 51-57 with two (docs/PERFORMANCE.md, Serving several streams). So the engine's kernels run on
    one thread, and what its constructor computes (a bf16 copy of the weights, a LoRA model's merged
    weights) runs here."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()), name="handgrad-engine-setup")
    thread.start()
    thread.join()
    if not out:
        raise RuntimeError("the engine's setup failed (its traceback is above)")
    return out[0]
