"""Evaluation tasks: JSONL files in the in-context-learning layout of MosaicML's llm-foundry, read
and checked into one form (`Row`), whatever their kind.

Three kinds of row, told apart by their keys:

  multiple choice   {"query": str, "choices": [str, ...], "gold": int}
                    each choice is scored as the continuation " " + choice of the query;
  schema            {"context_options": [str, ...], "continuation": str, "gold": int}
                    the shared continuation " " + continuation is scored after each context;
  language model    {"context": str, "continuation": str}
                    correct when greedy decoding after the context gives every token of
                    " " + continuation.

`--tasks` also takes the standard tasks' names (arc_easy, piqa, ...: eval/hub.py), read from the
Hugging Face datasets lm-evaluation-harness reads, in this same layout and through the same parse_row."""
import json
from dataclasses import dataclass
from pathlib import Path

from ..data.sources import DataError
from .hub import NAMED, hub_rows

MC, SCHEMA, LM = "multiple_choice", "schema", "language_modelling"
LAYOUTS = {MC: ("query", "choices", "gold"), SCHEMA: ("context_options", "continuation", "gold"),
           LM: ("context", "continuation")}
DELIMITER = " "  # between a context and its continuation, as lm-evaluation-harness's target_delimiter


@dataclass(frozen=True)
class Row:
    line: int  # in its file, from 1
    contexts: tuple  # one per scored pair
    continuations: tuple  # the text scored after each context (the delimiter included)
    gold: int
    choice_bytes: tuple  # UTF-8 length of each choice without the delimiter (acc_norm's divisor)


@dataclass
class Task:
    name: str  # the file's stem, or the standard task's name
    path: Path  # the file its rows were read from (a standard task's: the cached parquet file)
    kind: str
    rows: list
    source: str  # what --tasks named it by: the JSONL file's path or the standard task's name


def task_sources(spec, flag="--tasks"):
    """What --tasks names, in its order: comma-separated JSONL files, directories (their *.jsonl,
    sorted) and standard tasks' names (eval/hub.NAMED; an existing path of the same name wins), as
    Paths and name strings. Task names (files' stems, standard names) must be distinct. flag: what the
    errors name (the command's flag or the config key)."""
    sources = []
    for part in (s.strip() for s in str(spec).split(",")):
        if not part:
            continue
        p = Path(part)
        if p.is_dir():
            found = sorted(p.glob("*.jsonl"))
            if not found:
                raise DataError(f"{flag} {p}: a directory with no *.jsonl files")
            sources += found
        elif p.is_file():
            sources.append(p)
        elif part in NAMED:
            sources.append(part)
        else:
            raise DataError(f"{flag} {p}: no such file or directory, nor a standard task's name "
                            f"({', '.join(NAMED)})")
    if not sources:
        raise DataError(f"{flag}: name at least one JSONL file, directory or standard task")
    seen = {}
    for s in sources:
        name = s.stem if isinstance(s, Path) else s
        if name in seen:
            raise DataError(f"{flag}: two tasks named {name!r} ({seen[name]} and {s}); rename one")
        seen[name] = s
    return sources


def read_tasks(spec, limit=None, flag="--tasks"):
    """Every Task --tasks names (task_sources), each cut to its first `limit` rows (all when None)."""
    return [read_task(s, limit) if isinstance(s, Path) else read_named(s, limit, flag)
            for s in task_sources(spec, flag)]


def _kind(obj):
    for kind, keys in LAYOUTS.items():
        if all(k in obj for k in keys) and (kind != LM or "gold" not in obj):
            return kind
    layouts = "; ".join("/".join(keys) for keys in LAYOUTS.values())
    raise ValueError(f"unknown layout (keys {sorted(obj)}); expected one of: {layouts}")


def _text(obj, key):
    if not isinstance(obj[key], str):
        raise ValueError(f"{key} must be a string, got {type(obj[key]).__name__}")
    return obj[key]


def _texts(obj, key):
    v = obj[key]
    if not isinstance(v, list) or len(v) < 2 or not all(isinstance(x, str) for x in v):
        raise ValueError(f"{key} must be a list of at least 2 strings")
    return v


def _gold(obj, n, key):
    g = obj["gold"]
    if type(g) is not int:
        raise ValueError(f"gold must be an integer, got {g!r}")
    if not 0 <= g < n:
        raise ValueError(f"gold {g} is out of range for {n} {key} (0 to {n - 1})")
    return g


def parse_row(obj, line):
    """A Row from one decoded JSON line, or ValueError saying what is wrong with it (read_task
    names the file and the line). Every row becomes `len(contexts)` (context, continuation) pairs;
    `gold` is the index of the right one (0 for a language-modelling row, which has one pair). Keys
    beyond the layout's are ignored."""
    if not isinstance(obj, dict):
        raise ValueError(f"a row must be a JSON object, got {type(obj).__name__}")
    kind = _kind(obj)
    if kind == MC:
        query, choices = _text(obj, "query"), _texts(obj, "choices")
        return kind, Row(line, (query,) * len(choices), tuple(DELIMITER + c for c in choices),
                         _gold(obj, len(choices), "choices"), tuple(len(c.encode("utf-8")) for c in choices))
    cont = DELIMITER + _text(obj, "continuation")
    if kind == SCHEMA:
        options = _texts(obj, "context_options")
        return kind, Row(line, tuple(options), (cont,) * len(options), _gold(obj, len(options), "context_options"),
                         (len(cont.encode("utf-8")) - 1,) * len(options))
    return kind, Row(line, (_text(obj, "context"),), (cont,), 0, (len(cont.encode("utf-8")) - 1,))


def read_task(path, limit=None):
    """The Task in a JSONL file: its first `limit` rows (all when None), blank lines skipped. A file
    holds rows of one kind; a mistake raises DataError naming the file and the line."""
    path = Path(path)
    rows, kind = [], None
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None
    with f:
        try:
            for i, line in enumerate(f, 1):
                if limit is not None and len(rows) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{i}: not JSON ({e.msg} at column {e.colno})") from None
                try:
                    row_kind, row = parse_row(obj, i)
                except ValueError as e:
                    raise DataError(f"{path}:{i}: {e}") from None
                if kind is not None and row_kind != kind:
                    raise DataError(f"{path}:{i}: a {row_kind.replace('_', ' ')} row in a file of "
                                    f"{kind.replace('_', ' ')} rows (line {rows[0].line}); one kind per file")
                kind = row_kind
                rows.append(row)
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not rows:
        raise DataError(f"{path}: no rows (an empty file)" if limit != 0 else f"{path}: --limit 0 leaves no rows")
    return Task(path.stem, path, kind, rows, str(path))


def read_named(name, limit=None, flag="--tasks"):
    """The Task of standard task `name` (eval/hub.py): its first `limit` rows (all when None), each
    checked by parse_row as a JSONL line is; Row.line is the row's number in the split, from 1."""
    path, objs = hub_rows(name, flag)
    rows, kind = [], None
    for i, obj in enumerate(objs if limit is None else objs[:limit], 1):
        try:
            kind, row = parse_row(obj, i)
        except ValueError as e:
            raise DataError(f"{path}: row {i}: {e}") from None
        rows.append(row)
    if not rows:
        raise DataError(f"{flag} {name}: --limit 0 leaves no rows")
    return Task(name, path, kind, rows, name)
