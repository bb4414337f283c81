"""`handgrad eval`: zero-shot accuracy of a model on tasks in llm-foundry's JSONL layout
(eval/tasks.py) or standard tasks by name (eval/hub.py), scored as lm-evaluation-harness scores
them (eval/score.py).

Per task: rows, acc (multiple choice: the choice of highest summed log-probability; schema: the
context under which the continuation is most likely; language modelling: greedy decoding gives every
target token), acc_norm for multiple choice (the highest log-probability per UTF-8 byte of the choice,
the harness's acc_norm with bytes for characters), each with its standard error (the sample standard
deviation over rows / sqrt(rows), the harness's mean_stderr), and for language modelling the target's
perplexity, exp(-mean over rows of its summed log-probability) as the harness's lambada reports it;
then the mean of each metric over the tasks that have it. `--json` prints the same as one object;
`--out DIR` also writes DIR/TASK.jsonl, one line per row (its scores and predictions), and
DIR/results.json.
"""
import json
import sys
import time
from pathlib import Path

import numpy as np

from ..data.sources import DataError
from ..files import write_atomic
from ..sample import add_quant_argument, load_run
from .score import Scorer, bos_policy, encode_task, task_results
from .hub import NAMED
from .tasks import read_tasks

KIND_SHORT = {"multiple_choice": "mc", "schema": "schema", "language_modelling": "lm"}


def add_arguments(parser):
    parser.add_argument("--run", required=True, metavar="MODEL",
                        help="what `sample --run` takes: a run directory or checkpoint, a Hugging Face GPT-2, "
                             "Llama, Qwen2 or Qwen3 directory, a GGUF file, a PEFT adapter, an llm.c or llama2.c "
                             "model file, or a published model's name (smollm2-135m-instruct)")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="the tokenizer, where --run has none beside it (as for sample)")
    add_quant_argument(parser)
    parser.add_argument("--tasks", required=True, metavar="TASK[,TASK...]",
                        help=f"standard tasks by name ({', '.join(NAMED)}: fetched once from the Hugging Face "
                             "datasets lm-evaluation-harness reads; needs pyarrow), or JSONL files in llm-foundry's "
                             "in-context-learning layout (query/choices/gold, context_options/continuation/gold or "
                             "context/continuation), or directories of them")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="score only the first N rows of each task")
    parser.add_argument("--batch-size", type=int, default=64, metavar="N",
                        help="continuations scored in one forward (default 64): the choices of rows whose "
                             "queries have one length, the queries run once in one forward before them")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="also write DIR/TASK.jsonl (every row's scores and predictions) and DIR/results.json")


def _average(results):
    avg = {}
    for key in ("acc", "acc_norm", "perplexity"):
        vals = [r[key] for r in results.values() if key in r]
        if vals:
            avg[key] = float(np.mean(vals))
    return avg


def _fmt(v, width, digits=4):
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.{digits}f}"


def print_report(report, file):
    print(f"model    {report['model']}", file=file)
    print(f"bos      {report['bos']}", file=file)
    print(f"scoring  0-shot; continuation = \" \" + choice, tokenized apart from its context; "
          f"acc_norm per UTF-8 byte of the choice", file=file)
    head = (f"{'task':<18} {'kind':<6} {'rows':>6} {'acc':>7} {'±':>7} {'acc_norm':>8} {'±':>7} "
            f"{'ppl':>9} {'trunc':>5} {'rows/s':>7}")
    print(head, file=file)
    print("-" * len(head), file=file)
    for name, r in report["tasks"].items():
        print(f"{name:<18} {KIND_SHORT[r['kind']]:<6} {r['rows']:>6} {_fmt(r['acc'], 7)} {_fmt(r['acc_stderr'], 7)} "
              f"{_fmt(r.get('acc_norm'), 8)} {_fmt(r.get('acc_norm_stderr'), 7)} {_fmt(r.get('perplexity'), 9, 2)} "
              f"{r['truncated']:>5} {r['rows_per_s']:>7.1f}", file=file)
    a = report["average"]
    print(f"{'average':<18} {'':<6} {'':>6} {_fmt(a.get('acc'), 7)} {'':>7} {_fmt(a.get('acc_norm'), 8)} {'':>7} "
          f"{_fmt(a.get('perplexity'), 9, 2)}", file=file)
    w = report["work"]
    print(f"positions run {w['positions']:,} (one forward per choice: {w['naive_positions']:,}, "
          f"{w['naive_positions'] / max(w['positions'], 1):.2f}x); lm_head on {w['lm_head_positions']:,}", file=file)


def _progress(total, name):
    from tqdm import tqdm
    return tqdm(total=total, desc=name, unit=" rows", file=sys.stderr, leave=False, dynamic_ncols=True,
                disable=None)


def main(args, file=None):
    """`handgrad eval`: read every task first (so a bad row fails before the model loads), score
    them, print the report. Returns the exit code; user errors raise DataError or SampleError."""
    file = file if file is not None else sys.stdout
    if args.limit is not None and args.limit < 1:
        raise DataError(f"--limit must be >= 1, got {args.limit}")
    if args.batch_size < 1:
        raise DataError(f"--batch-size must be >= 1, got {args.batch_size}")
    tasks = read_tasks(args.tasks, args.limit)
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not out.is_dir():
        raise DataError(f"--out {out}: exists and is not a directory")
    model, tokenizer, _ = load_run(args.run, args.tokenizer, args.quant)
    bos, bos_text = bos_policy(tokenizer)
    scorer = Scorer(model, args.batch_size)
    cfg = model.config
    report = {"model": f"{args.run} ({type(model).__name__}, {cfg.n_layer} layers, block_size {cfg.block_size})",
              "bos": bos_text, "batch_size": args.batch_size, "tasks": {}}
    records = {}
    for task in tasks:
        encoded = encode_task(task, tokenizer, cfg.block_size, bos)
        t0 = time.perf_counter()
        with _progress(len(encoded), task.name) as bar:
            scores = scorer.score(encoded, progress=bar.update)
        dt = time.perf_counter() - t0
        result, records[task.name] = task_results(task, scores)
        result.update(truncated=sum(e.truncated for e in encoded), seconds=round(dt, 3),
                      rows_per_s=len(encoded) / max(dt, 1e-9), path=str(task.path))
        report["tasks"][task.name] = result
    report["average"] = _average(report["tasks"])
    report["work"] = {"positions": scorer.positions, "naive_positions": scorer.naive_positions,
                      "lm_head_positions": scorer.lm_head_positions}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for name, recs in records.items():
            write_atomic(out / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in recs))
        write_atomic(out / "results.json", json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report, indent=1), file=file)
    else:
        print_report(report, file)
    return 0
