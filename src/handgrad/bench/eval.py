"""`handgrad bench eval`: `handgrad eval`'s scorer beside a straightforward transformers scorer, in
one run, on the same model, rows and threads; rows/s of each and whether they agree row by row.

The transformers side is what a user writes first (_tf_score): transformers' own model class (the
Hugging Face directory, or the GGUF file through transformers' GGUF loader), float32, batch 1, one
forward per choice over context + continuation, log_softmax summed in float64, tokenized as
lm-evaluation-harness does and with handgrad's bos policy, so both score the same token sequences.
handgrad's side is eval/score.Scorer exactly as `handgrad eval` runs it, in this process.

The non-obvious idea: the transformers side runs in a worker process that imports torch before
anything of handgrad's (tf_worker), as a user's script would. The two take turns task by task, each
with this machine's threads. Reported per task and in all: rows/s of each side, their ratio, the rows
whose prediction differs, and the largest log-probability difference.
"""
import json
import time
from types import SimpleNamespace

import numpy as np

from ..backends.cpu import set_threads
from ..eval.score import Scorer, bos_policy, encode_task, predictions
from ..eval.tasks import read_tasks
from ..interop.published import resolve_model
from ..machine import cores_available, environment
from ..sample import load_run
from .common import TorchProcess, commands, ready, reply


def _transformers_model(run, torch):
    """transformers' own model and tokenizer for what --run names: a GGUF file or an HF directory."""
    from pathlib import Path

    import transformers

    from ..torch_ref import quiet_transformers
    path = Path(resolve_model(run))
    if path.is_file() and path.suffix == ".gguf":
        kw = dict(gguf_file=path.name)
        path = path.parent
    elif path.is_dir() and (path / "config.json").is_file():
        kw = {}
    else:
        raise SystemExit(f"bench eval --run {run}: the transformers side reads a Hugging Face directory or a GGUF "
                         f"file (export a handgrad run with handgrad convert first)")
    with quiet_transformers():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw).eval()
        tok = transformers.AutoTokenizer.from_pretrained(str(path), **kw)
    return model, tok


def _tf_score(model, tok, torch, task, encoded, bos, otherwise=None):
    """Each row's continuation log-probabilities and greedy matches, one forward per pair, batch 1.
    A pair that transformers' tokenizer splits otherwise than handgrad's (a GGUF file's tokenizer as
    transformers' GGUF loader rebuilds it need not be the model's own: SmolLM2's digits) is scored on
    handgrad's tokens, so the models are still compared, and its row's line goes into `otherwise`.
    Context and " " + choice are tokenized apart, as lm-evaluation-harness does, with no bos before the
    context unless handgrad's bos policy puts one (eval/score.bos_policy). A row's prediction is acc's
    argmax (acc_norm's for multiple choice; the greedy match for language modelling)."""
    out = []
    for row, e in zip(task.rows, encoded):
        lps, greedy = [], []
        for k, (ctx_text, cont_text) in enumerate(zip(row.contexts, row.continuations)):
            ctx = ([bos] if bos is not None else []) + tok.encode(ctx_text, add_special_tokens=False)
            ctx = ctx or [tok.eos_token_id]  # an empty context starts from the end-of-text token, as the harness's
            cont = tok.encode(cont_text, add_special_tokens=False)
            seq = (ctx + cont)[-len(e.seqs[k]):]
            if seq != e.seqs[k].tolist():
                if otherwise is None:
                    raise SystemExit(f"bench eval: {task.path}:{row.line}: transformers' tokenizer gives other "
                                     f"tokens than handgrad's for pair {k}")
                if not otherwise or otherwise[-1] != row.line:
                    otherwise.append(row.line)
                seq, cont = e.seqs[k].tolist(), e.seqs[k][e.n_ctx[k]:].tolist()
            with torch.no_grad():
                logits = model(torch.tensor([seq[:-1]])).logits[0, -len(cont):].double()
            target = torch.tensor(cont)
            lps.append(torch.log_softmax(logits, -1).gather(1, target[:, None]).sum().item())
            greedy.append(bool((logits.argmax(-1) == target).all()))
        out.append((np.array(lps), np.array(greedy)))
    return out


def tf_worker():
    """The transformers side, in a TorchProcess: setup {run, threads, bos}; then per command a task
    {source, limit, seqs} (source: the task's JSONL file or standard name, read again here from its
    file or the cache; seqs: handgrad's token sequences, checked against transformers' tokenizer),
    answered with {seconds, logprobs, greedy}.

    A process of its own, torch imported first: in one process with handgrad's kernels, torch's many
    small parallel regions ran 4.6x slower (COPA's first 100 rows, 2 threads, AMD EPYC: 168.6 s
    against 36.7 s). torch's threads, and handgrad's BLAS and Numba pools, are set to one count."""
    import torch
    lines = commands()
    setup = next(lines)  # the first line
    torch.set_num_threads(setup["threads"])
    model, tok = _transformers_model(setup["run"], torch)
    ready()
    for cmd in lines:
        task, = read_tasks(cmd["source"], cmd["limit"])
        encoded = [SimpleNamespace(seqs=[np.asarray(q) for q in seqs], n_ctx=n)
                   for seqs, n in zip(cmd["seqs"], cmd["n_ctx"])]
        otherwise = []
        t0 = time.perf_counter()
        out = _tf_score(model, tok, torch, task, encoded, setup["bos"], otherwise)
        reply({"seconds": time.perf_counter() - t0, "logprobs": [lp.tolist() for lp, _ in out],
               "greedy": [g.tolist() for _, g in out], "tokenized_otherwise": otherwise})
    return 0


def _tf_side_score(side, task, limit, encoded):
    """The transformers side's ([(logprobs, greedy) per row], seconds, the lines of rows its tokenizer
    split otherwise) for one task."""
    r = side.ask(source=task.source, limit=limit, seqs=[[q.tolist() for q in e.seqs] for e in encoded],
                 n_ctx=[list(e.n_ctx) for e in encoded])
    return ([(np.array(lp), np.array(g)) for lp, g in zip(r["logprobs"], r["greedy"])], r["seconds"],
            r["tokenized_otherwise"])


def bench_eval(run, tasks_spec, limit, as_json, threads=None):
    from ..torch_ref import require_torch
    torch = require_torch()
    threads = threads or cores_available()
    set_threads(threads)
    tasks = read_tasks(tasks_spec, limit)
    model, tokenizer, _ = load_run(run)
    bos, bos_text = bos_policy(tokenizer)
    tf_side = TorchProcess(__name__, "tf_worker", {"run": str(run), "threads": threads, "bos": bos}, "bench eval")
    rows, totals = [], {"rows": 0, "handgrad_s": 0.0, "transformers_s": 0.0, "differ": 0, "tokenized_otherwise": 0}
    for task in tasks:
        encoded = encode_task(task, tokenizer, model.config.block_size, bos)
        scorer = Scorer(model)
        t0 = time.perf_counter()
        hg = scorer.score(encoded)
        t_hg = time.perf_counter() - t0
        tf, t_tf, otherwise = _tf_side_score(tf_side, task, limit, encoded)
        differ = [row.line for row, h, (lp, gr) in zip(task.rows, hg, tf)
                  if predictions(task, row, h.logprobs, h.greedy) != predictions(task, row, lp, gr)]
        dmax = max(float(np.max(np.abs(h.logprobs - lp))) for h, (lp, _) in zip(hg, tf))
        n = len(task.rows)
        rows.append({"task": task.name, "kind": task.kind, "rows": n, "handgrad_rows_s": n / t_hg,
                     "transformers_rows_s": n / t_tf, "speedup": t_tf / t_hg, "rows_differ": differ,
                     "rows_tokenized_otherwise": otherwise,
                     "max_abs_logprob_diff": dmax, "positions": scorer.positions,
                     "naive_positions": scorer.naive_positions})
        totals["rows"] += n
        totals["handgrad_s"] += t_hg
        totals["transformers_s"] += t_tf
        totals["differ"] += len(differ)
        totals["tokenized_otherwise"] += len(otherwise)
        if not as_json:
            r = rows[-1]
            print(f"{task.name:<16} {n:>6} rows  handgrad {r['handgrad_rows_s']:7.2f} rows/s  transformers "
                  f"{r['transformers_rows_s']:6.2f} rows/s  {r['speedup']:5.2f}x  predictions differ on {len(differ)}"
                  f"  max |d logprob| {dmax:.1e}"
                  + (f"  transformers' tokenizer splits {len(otherwise)} otherwise" if otherwise else ""), flush=True)
    tf_side.close()
    totals["speedup"] = totals["transformers_s"] / max(totals["handgrad_s"], 1e-9)
    result = {"run": str(run), "bos": bos_text, "threads": threads, "limit": limit, "tasks": rows,
              "total": totals, "environment": environment(torch)}
    if as_json:
        print(json.dumps(result, indent=1, default=float))
    else:
        print(f"{'all':<16} {totals['rows']:>6} rows  handgrad {totals['rows'] / totals['handgrad_s']:7.2f} rows/s  "
              f"transformers {totals['rows'] / totals['transformers_s']:6.2f} rows/s  {totals['speedup']:5.2f}x  "
              f"predictions differ on {totals['differ']} ({threads} threads each; bos {bos_text})"
              + (f"; {totals['tokenized_otherwise']} rows split otherwise by transformers' tokenizer, scored on "
                 f"handgrad's tokens" if totals["tokenized_otherwise"] else ""))
    return 0
