"""The standard zero-shot tasks by name (`--tasks arc_easy,piqa`): the Hugging Face datasets that
lm-evaluation-harness's task YAMLs name, each row turned into a row of llm-foundry's JSONL layout
(eval/tasks.py) by the harness's own prompt for that task (Named), so a named task scores as the
harness scores it, and exactly as a JSONL file holding the same rows would.

The non-obvious idea: a task's file is the Hub's parquet conversion of its split,
`{config}/{split}/0000.parquet` on the dataset's `refs/convert/parquet` branch, which the Hub keeps
for every dataset, whatever form its own repository holds. It is fetched once with urllib into
$HANDGRAD_CACHE/eval (default ~/.cache/handgrad/eval) and read with pyarrow (the `eval` extra).
HF_ENDPOINT replaces https://huggingface.co, as it does for huggingface_hub. Offline, a task file
placed where the cache keeps it is read as if fetched; or pass a JSONL file instead of the name.
"""
import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.client import HTTPException
from typing import Callable

from ..data.sources import DataError, cache_dir

HUB = "https://huggingface.co"
BRANCH = "refs%2Fconvert%2Fparquet"  # the Hub's parquet conversion, as a URL path segment
TIMEOUT_S = 60
# handgrad is installed from its clone, so the extra is named by the clone's path form (as serve's)
NEEDS_PYARROW = ("reading the Hub's parquet files needs pyarrow (pip install -e '.[eval]' in handgrad's clone, "
                 "or pip install pyarrow)")


def _instead(name):
    return f"pass a local JSONL file of {name} in llm-foundry's layout instead"


def _arc(r):
    return {"query": f"Question: {r['question']}\nAnswer:", "choices": r["choices"]["text"],
            "gold": r["choices"]["label"].index(r["answerKey"])}


def _boolq(r):
    return {"query": f"{r['passage']}\nQuestion: {r['question']}?\nAnswer:", "choices": ["no", "yes"],
            "gold": r["label"]}


def _copa(r):
    connector = {"cause": "because", "effect": "therefore"}[r["question"]]
    return {"query": r["premise"].strip()[:-1] + f" {connector}",
            "choices": [" " + c[0].lower() + c[1:] for c in (r["choice1"], r["choice2"])], "gold": r["label"]}


def _hellaswag_clean(text):
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(r):
    ctx = r["ctx_a"] + " " + r["ctx_b"].capitalize()
    return {"query": _hellaswag_clean(r["activity_label"] + ": " + ctx),
            "choices": [_hellaswag_clean(e) for e in r["endings"]], "gold": int(r["label"])}


def _lambada(r):
    words = r["text"].split(" ")
    return {"context": " ".join(words[:-1]), "continuation": words[-1]}


def _piqa(r):
    return {"query": f"Question: {r['goal']}\nAnswer:", "choices": [r["sol1"], r["sol2"]], "gold": r["label"]}


def _siqa(r):
    return {"query": f"Q: {r['context']} {r['question']}\nA:", "choices": [r["answerA"], r["answerB"], r["answerC"]],
            "gold": int(r["label"]) - 1}


def _winogrande(r):
    s = r["sentence"]
    i = s.index("_")
    return {"context_options": [s[:i] + r["option1"], s[:i] + r["option2"]], "continuation": s[i + 1:].strip(),
            "gold": int(r["answer"]) - 1}


@dataclass(frozen=True)
class Named:
    """A standard task: one split of one dataset, and how a row of it becomes a row, 0-shot, in the
    split's order (the harness's doc_to_text -> query or contexts, doc_to_choice -> choices,
    doc_to_target -> gold; the harness's " " delimiter goes before each choice, as in eval/tasks.py):

      arc_easy, arc_challenge  "Question: {question}\\nAnswer:"; choices.text; choices.label.index(answerKey)
      boolq           "{passage}\\nQuestion: {question}?\\nAnswer:"; "no", "yes"; label
      copa            the premise without its last character (its period) + " because" (cause) or
                      " therefore" (effect); " " + each choice with its first letter lower-cased (the
                      harness's choices carry a space of their own, so it scores them after two); label
      hellaswag       "{activity_label}: {ctx_a} {ctx_b capitalized}"; endings; label; each text cleaned
                      of WikiHow's bracketed artifacts as the harness's preprocess cleans it
      lambada_openai  language modelling: the text up to its last " ", then its last word
      piqa            "Question: {goal}\\nAnswer:"; sol1, sol2; label
      siqa            "Q: {context} {question}\\nA:"; answerA, answerB, answerC; label - 1 (the
                      harness's social_iqa)
      winogrande      schema: the sentence up to its "_" followed by each option; the rest after the
                      "_", stripped; answer - 1
    """
    repo: str  # the dataset the harness's YAML names (dataset_path)
    config: str  # its dataset_name ("default" where it names none)
    split: str  # the split the harness scores
    rows: int  # how many rows that split has
    to_row: Callable  # a row of the dataset -> a row in llm-foundry's layout


NAMED = {
    "arc_challenge": Named("allenai/ai2_arc", "ARC-Challenge", "test", 1172, _arc),
    "arc_easy": Named("allenai/ai2_arc", "ARC-Easy", "test", 2376, _arc),
    "boolq": Named("aps/super_glue", "boolq", "validation", 3270, _boolq),
    "copa": Named("aps/super_glue", "copa", "validation", 100, _copa),
    "hellaswag": Named("Rowan/hellaswag", "default", "validation", 10042, _hellaswag),
    "lambada_openai": Named("EleutherAI/lambada_openai", "default", "test", 5153, _lambada),
    "piqa": Named("baber/piqa", "default", "validation", 1838, _piqa),
    "siqa": Named("lighteval/siqa", "default", "validation", 1954, _siqa),
    "winogrande": Named("allenai/winogrande", "winogrande_xl", "validation", 1267, _winogrande),
}


def task_url(name):
    """Where standard task `name`'s parquet file is on the Hub (or on HF_ENDPOINT)."""
    t = NAMED[name]
    base = os.environ.get("HF_ENDPOINT") or HUB
    return f"{base.rstrip('/')}/datasets/{t.repo}/resolve/{BRANCH}/{t.config}/{t.split}/0000.parquet"


def cached_path(name):
    """Where the cache keeps standard task `name`'s parquet file."""
    t = NAMED[name]
    return cache_dir() / "eval" / t.repo.replace("/", "--") / t.config / f"{t.split}.parquet"


def _reason(e):
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    return str(e) or type(e).__name__


def fetch(name, flag="--tasks"):
    """The local parquet file of standard task `name`: the cached one, else fetched into the cache
    whole or not at all."""
    path = cached_path(name)
    if path.is_file():
        return path
    url = task_url(name)
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            data = response.read()
    except (OSError, HTTPException, ValueError) as e:  # URLError, HTTPError and timeouts are OSErrors
        raise DataError(f"{flag} {name}: could not fetch {url} ({_reason(e)}); {_instead(name)}, "
                        f"or put that file at {path}") from None
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DataError(f"{flag} {name}: cannot write {path} ({e.strerror or e}); set HANDGRAD_CACHE to a "
                        f"writable directory") from None
    return path


def _parquet():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        return None
    return pyarrow


def hub_rows(name, flag="--tasks"):
    """(the local parquet file, [row of standard task `name` in llm-foundry's layout, in the split's
    order]); a DataError naming the task, the URL or the file, and the fix, where it cannot be had."""
    t = NAMED[name]
    pa = _parquet()
    if pa is None:
        raise DataError(f"{flag} {name}: {NEEDS_PYARROW}; or {_instead(name)}")
    path = fetch(name, flag)
    try:
        records = pa.parquet.read_table(path).to_pylist()
    except (OSError, ValueError, pa.ArrowException) as e:
        raise DataError(f"{path}: not a parquet file pyarrow reads ({e}); delete it so that handgrad fetches "
                        f"{task_url(name)} again") from None
    if len(records) != t.rows:
        raise DataError(f"{path}: {len(records)} rows, where {t.repo} {t.config} {t.split} has {t.rows}; delete it "
                        f"so that handgrad fetches {task_url(name)} again")
    rows = []
    for i, record in enumerate(records, 1):
        try:
            rows.append(t.to_row(record))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise DataError(f"{path}: row {i} is not a row of {t.repo} {t.config} ({type(e).__name__}: {e}); "
                            f"delete it so that handgrad fetches {task_url(name)} again") from None
    return path, rows
