"""A run directory: its config (fresh, or the saved one on resume), its files written whole, and
the checks that the data fits the run before anything is written."""
import json

from ..config import ConfigError, RunConfig, apply_sources, load_run_config, read_config_file
from ..data.sources import DataError
from ..data.tokenizer import TOKENIZER_FILE, GPT2Tokenizer, copy_tokenizer, load_tokenizer
from ..files import OutputLock, write_atomic
from ..interop.checkpoint import list_checkpoints


LOCK_FILE = ".lock"  # in RUN_DIR: held (flock) by the process training into it


class TrainError(ValueError):
    """A problem with the run's inputs or outputs; the message names the path or key."""


def resolve_config(run_dir, preset=None, config_file=None, overrides=None, resume=False):
    """A fresh run's config (preset, file, overrides), or with resume the saved config with any
    preset, file and overrides applied on top; the architecture cannot change on resume."""
    saved = run_dir / "config.json"
    if not resume:  # a mistake in the preset, file or flags is the first error, before the run directory's
        config = load_run_config(preset, config_file, overrides)
        if list_checkpoints(run_dir):
            raise TrainError(f"{run_dir}: already holds checkpoints; pass --resume to continue, "
                             f"or choose another --out")
        return config
    apply_sources(RunConfig(), preset, config_file, overrides)  # keys and types; the ranges once on the saved config
    if not saved.is_file():
        raise TrainError(f"{saved}: missing; nothing to resume in {run_dir} (drop --resume to start a run)")
    try:
        doc = json.loads(saved.read_text(encoding="utf-8"))
        base = {"model": dict(doc["model"]), "train": dict(doc["train"])}
    except (ValueError, KeyError, TypeError) as e:  # bad JSON or UTF-8, or not a run's config
        raise TrainError(f"{saved}: not a readable run config ({type(e).__name__}: {e}); "
                         f"nothing can be resumed from {run_dir}, start a new run with another --out") from None
    config = load_run_config(preset, config_file, overrides, base=base)
    for key, old in base["model"].items():
        new = getattr(config.model, key)
        if new != old:
            raise ConfigError(f"model.{key}: cannot change on resume (saved {old}, asked {new}); "
                              f"drop {_asked_by(f'model.{key}', preset, config_file, overrides)}, or start a new "
                              f"run with another --out")
    return config


def _asked_by(key, preset, config_file, overrides):
    """The flag that set `key` (the last source wins: --section.key, then --config, then --preset)."""
    if key in (overrides or {}):
        return f"--{key}"
    section, _, name = key.partition(".")
    if config_file is not None and name in (read_config_file(config_file).get(section) or {}):
        return f"--config {config_file} (or its {key})"
    return f"--preset {preset}"


def read_json(path):
    """A JSON file's contents, or None where it is not valid JSON."""
    try:
        return json.loads(path.read_bytes())
    except ValueError:
        return None



def check_data(config, data_dir, train_data, val_data):
    """Before anything is written: every token id < vocab_size, windows of block_size + 1 tokens
    fit (text data; chat data pads its rows to block_size), packed chat rows are no longer than
    block_size (a row cut at T would never train the conversations past it), and tokenizer.json
    has meta.json's vocab_size (samples are decoded with it)."""
    T = config.model.block_size
    for ds in (train_data, val_data):
        ds.check_tokens()
        longest = max(ds.lengths, default=0)
        chat = hasattr(ds, "num_conversations")  # chat data: rows of whole conversations, padded to T
        if ds.num_tokens and longest < T + 1 and not chat:
            raise TrainError(f"model.block_size {T} is too large for the {ds.split} split of {data_dir}: "
                             f"its longest shard has {longest} tokens; use at most {longest - 1}")
        packed_to = ds.meta["chat"]["block_size"] if chat and ds.packed else 0
        if packed_to > T:
            raise TrainError(f"model.block_size {T} is shorter than the {packed_to}-position rows {data_dir} was "
                             f"packed into: the conversations past position {T} would never train; use "
                             f"--model.block_size {packed_to}, or prepare the data again with --pack --block-size {T}")
    if not train_data.num_tokens:
        raise TrainError(f"{data_dir}: the train split is empty; prepare more text")
    tok_file = data_dir / TOKENIZER_FILE
    doc = read_json(tok_file) if tok_file.is_file() else None
    gpt2 = isinstance(doc, dict) and doc.get("type") == "gpt2"
    if gpt2 and not config.train.sample_interval:
        n = GPT2Tokenizer.VOCAB_SIZE  # training on GPT-2 tokens (llm.c shards) needs no tiktoken
    else:
        try:
            n = load_tokenizer(data_dir).vocab_size
        except DataError as e:
            if not gpt2:
                raise
            raise TrainError(f"{e}; or train without samples: --train.sample_interval 0") from None
    if n != train_data.vocab_size:
        raise TrainError(f"{data_dir}: meta.json says vocab_size {train_data.vocab_size} but "
                         f"tokenizer.json has {n} tokens; re-run handgrad prepare")


def data_identity(train_data):
    """What must stay the same for a run to resume on some data: the tokenizer kind and vocab_size."""
    return {"tokenizer": train_data.meta.get("tokenizer"), "vocab_size": train_data.vocab_size}


def check_same_data(run_dir, data_dir, train_data):
    """A run resumes only on data with its tokenizer and vocabulary (checked before building):
    the same kind and vocab_size, and the same tokenizer.json as the run's copy (two char
    vocabularies of one size can still map ids to different characters)."""
    saved = json.loads((run_dir / "config.json").read_text())
    ours = data_identity(train_data)
    theirs = {k: saved.get(k) for k in ours}
    if theirs != ours:
        raise TrainError(f"{data_dir}: tokenizer/vocab {ours} differs from the run's {theirs}; "
                         f"resume with the data the run was trained on")
    run_tok, data_tok = run_dir / TOKENIZER_FILE, data_dir / TOKENIZER_FILE
    if run_tok.is_file() and read_json(run_tok) != read_json(data_tok):
        raise TrainError(f"{data_tok} differs from the run's copy {run_tok} (same kind and vocab_size, other "
                         f"tokens); resume with the data the run was trained on")


def lock_run_dir(run_dir):
    """Create run_dir if needed and own it (RUN_DIR/.lock) for as long as this process lives: a
    second writer, training or resuming into it, stops with one line naming this process's pid."""
    new = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        return OutputLock(run_dir / LOCK_FILE, str(run_dir)).acquire()
    except OSError as e:
        if new:  # nothing left behind: the directory this call made is empty
            try:
                run_dir.rmdir()
            except OSError:
                pass
        raise TrainError(f"{run_dir}: cannot write there ({e.strerror}); free space or choose another --out") from None


def init_run_dir(run_dir, data_dir, config, train_data, world_size, resumed_step=None):
    """Make run_dir writable and write its config.json; a new run also gets the tokenizer and an
    empty metrics.jsonl, a resumed one (resumed_step) loses the metric lines past its checkpoint."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise TrainError(f"{run_dir}: cannot write there ({e.strerror}); choose another --out") from None
    if resumed_step is not None:
        truncate_metrics(run_dir, resumed_step)
    else:
        copy_tokenizer(data_dir, run_dir)
        (run_dir / "metrics.jsonl").write_text("")
    doc = dict(config.to_dict(), data=str(data_dir.resolve()), vocab_size=train_data.vocab_size,
               tokenizer=train_data.meta.get("tokenizer"), world_size=world_size)
    write_atomic(run_dir / "config.json", json.dumps(doc, indent=1) + "\n")


def truncate_metrics(run_dir, step):
    """Drop metric lines past the checkpoint we resume from: they will be produced again."""
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        keep = []
        for ln in path.read_text().splitlines():
            try:
                if json.loads(ln)["step"] <= step:
                    keep.append(ln)
            except (ValueError, KeyError, TypeError):
                pass  # a line torn by a kill mid-write
        write_atomic(path, "".join(ln + "\n" for ln in keep))


def last_good(run_dir):
    """Where a stopped run can be resumed from, in words."""
    good = list_checkpoints(run_dir)
    return f"the last good checkpoint is {good[-1][1]}" if good else "no checkpoint was completed"
