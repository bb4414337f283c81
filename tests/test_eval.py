"""`handgrad eval` (eval/): every row's scores against an independent scorer written on transformers
alone (one forward per choice, batch 1, float32), on a tiny random Llama (its tokenizer adds a bos)
and a tiny random GPT-2 (none), for the three kinds of row, a row longer than the context (truncated
from the left) and an empty context; the KV cache's extend and load_rows against prefills of whole
sequences; the standard tasks by name, from parquet files laid out as the Hub serves them, against
JSONL files of the rows lm-evaluation-harness builds; and every bad input's one line."""
import importlib.util
import json
import re

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from handgrad.cli import main as cli  # noqa: E402
from handgrad.config import Gemma3Config, GPTConfig, LlamaConfig  # noqa: E402
from handgrad.models import get_family  # noqa: E402

BLOCK = 48
WORDS = ("the a cat dog bird sat ran flew on under over mat box tree red big small old new quickly slowly "
         "and then because so it was is saw found ate took water food home garden park house").split()
SPECIALS = ["<|endoftext|>", "<s>"]


def _sentence(rng, lo=3, hi=9):
    return " ".join(rng.choice(WORDS, rng.integers(lo, hi)))


def _tokenizer(d, add_bos):
    """A byte-level BPE trained here, with a bos (<s>) and an end-of-text token; its config sets
    add_bos_token as asked."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = np.random.default_rng(1)
    tok.train_from_iterator([_sentence(rng) for _ in range(400)], trainer=trainer)
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|endoftext|>",
              "add_bos_token": add_bos}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def _model(kind, vocab):
    if kind == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=BLOCK,
                                       rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=0)
        cls, scale = transformers.LlamaForCausalLM, 0.2
    else:
        cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=BLOCK, n_embd=48, n_layer=2, n_head=3,
                                      bos_token_id=0, eos_token_id=0)
        cls, scale = transformers.GPT2LMHeadModel, 0.05
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # weights far from their init: peaked logits, clear winners
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


class Reference:
    """The scorer of lm-evaluation-harness, on transformers alone: one forward per (context,
    continuation), the bos put before the context where the tokenizer's config says so, an empty
    context started from the end-of-text token, the sequence cut to its last block + 1 tokens."""

    def __init__(self, d, add_bos):
        self.model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        self.tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
        self.bos = [self.tok.convert_tokens_to_ids("<s>")] if add_bos else []
        self.eot = self.tok.convert_tokens_to_ids("<|endoftext|>")

    def pair(self, ctx, cont):
        """(summed log-probability of " " + cont, greedy?, truncated?)"""
        c = self.bos + self.tok.encode(ctx, add_special_tokens=False) or [self.eot]
        t = self.tok.encode(" " + cont, add_special_tokens=False)
        seq = c + t
        with torch.no_grad():
            logits = self.model(torch.tensor([seq[-(BLOCK + 1):][:-1]])).logits[0, -len(t):].double()
        target = torch.tensor(t)
        lp = torch.log_softmax(logits, -1).gather(1, target[:, None]).sum().item()
        return lp, bool((logits.argmax(-1) == target).all()), len(seq) > BLOCK + 1

    def greedy_word(self, ctx):
        """A word w whose " w" is one token, the model's greedy choice after ctx (or None)."""
        ids = self.bos + self.tok.encode(ctx, add_special_tokens=False)
        with torch.no_grad():
            i = int(self.model(torch.tensor([ids])).logits[0, -1].argmax())
        text = self.tok.decode([i])
        ok = text.startswith(" ") and len(text) > 1 and self.tok.encode(text, add_special_tokens=False) == [i]
        return text[1:] if ok else None


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tasks(d, ref, seed):
    """Three task files: multiple choice (2 to 4 choices, queries of equal token lengths, one
    longer than the context, one empty), schema (options sharing their start and not), language
    modelling (some rows greedy-correct)."""
    rng = np.random.default_rng(seed)
    mc = [{"query": _sentence(rng, 4, 6), "choices": [_sentence(rng, 1, 5) for _ in range(k)],
           "gold": int(rng.integers(k))} for k in (2, 3, 4, 4, 2, 3, 4, 2)]
    mc += [{"query": "the cat sat", "choices": ["on the mat", "under a tree"], "gold": 0},
           {"query": "the dog ran", "choices": ["home", "to the park quickly"], "gold": 1},
           {"query": " ".join(rng.choice(WORDS, 70)), "choices": ["red", "the big old box"], "gold": 1},
           {"query": "", "choices": ["the cat", "a dog"], "gold": 0}]
    schema = [{"context_options": [f"{s} {w}" for w in rng.choice(WORDS, 2, replace=False)],
               "continuation": _sentence(rng, 2, 5), "gold": int(rng.integers(2))}
              for s in (_sentence(rng, 3, 6) for _ in range(4))]
    schema.append({"context_options": ["cat sat on the mat", "dog sat on the mat", "bird sat on the mat"],
                   "continuation": "and then ran home", "gold": 2})
    lm = [{"context": _sentence(rng, 4, 10), "continuation": _sentence(rng, 1, 3)} for _ in range(4)]
    for _ in range(100):
        ctx = _sentence(rng, 4, 10)
        if (w := ref.greedy_word(ctx)) is not None:
            lm.append({"context": ctx, "continuation": w})
        if len(lm) == 7:
            break
    d.mkdir()
    return {"mc": _write(d / "mc.jsonl", mc), "schema": _write(d / "schema.jsonl", schema),
            "lm": _write(d / "lm.jsonl", lm)}


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def setup(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(f"eval_{kind}")
    add_bos = kind == "llama"
    vocab = _tokenizer(root / "model", add_bos)
    _model(kind, vocab).save_pretrained(root / "model")
    ref = Reference(root / "model", add_bos)
    return kind, root, ref, _tasks(root / "tasks", ref, seed=len(kind))


def _expected(ref, path):
    """Per row: (logprobs, greedy, gold, acc's pick, acc_norm's pick), and the truncated count."""
    out, truncated = [], 0
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if "choices" in r:
            pairs = [(r["query"], c) for c in r["choices"]]
        elif "context_options" in r:
            pairs = [(c, r["continuation"]) for c in r["context_options"]]
        else:
            pairs = [(r["context"], r["continuation"])]
        lp, greedy, cut = zip(*(ref.pair(c, t) for c, t in pairs))
        truncated += any(cut)
        norm = [len(c.encode()) for c in r["choices"]] if "choices" in r else [1] * len(pairs)
        out.append((np.array(lp), list(greedy), r.get("gold"), int(np.argmax(lp)),
                    int(np.argmax(np.array(lp) / norm))))
    return out, truncated


@pytest.mark.parametrize("batch_size", [16, 1])
def test_eval_agrees_row_by_row_with_a_transformers_scorer(setup, batch_size, tmp_path, capsys):
    kind, root, ref, tasks = setup
    out = tmp_path / "out"
    argv = ["eval", "--run", str(root / "model"), "--tasks", ",".join(str(p) for p in tasks.values()),
            "--batch-size", str(batch_size), "--json", "--out", str(out)]
    assert cli(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bos"].startswith("<s> (id" if kind == "llama" else "none")
    for name, path in tasks.items():
        expected, truncated = _expected(ref, path)
        got = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        assert len(got) == len(expected) == report["tasks"][name]["rows"]
        assert report["tasks"][name]["truncated"] == truncated == (1 if name == "mc" else 0)
        for row, (lp, greedy, gold, pick, pick_norm) in zip(got, expected):
            np.testing.assert_allclose(row["logprobs"], lp, atol=1e-4, rtol=0, err_msg=f"{name} line {row['line']}")
            assert row["greedy"] == greedy, (name, row["line"])
            if name == "lm":
                assert row["correct"] == greedy[0]
            else:
                assert (row["pred"], row["correct"]) == (pick, pick == gold), (name, row["line"])
            if name == "mc":
                assert row["pred_norm"] == pick_norm, (name, row["line"])
        acc = np.mean([g[0] if name == "lm" else p == gold for _, g, gold, p, _ in expected])
        assert report["tasks"][name]["acc"] == pytest.approx(acc)
    lm = report["tasks"]["lm"]
    assert 0 < lm["acc"] < 1  # some rows greedy-correct, some not
    assert lm["perplexity"] == pytest.approx(np.exp(-np.mean([e[0][0] for e in _expected(ref, tasks["lm"])[0]])),
                                             rel=1e-4)
    assert report["work"]["positions"] < report["work"]["naive_positions"]


def test_report_table(setup, capsys):
    kind, root, ref, tasks = setup
    assert cli(["eval", "--run", str(root / "model"), "--tasks", str(tasks["mc"].parent), "--limit", "3"]) == 0
    text = capsys.readouterr().out
    assert "bos " in text and "average" in text and "positions run" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1] in (["lm"], ["mc"], ["schema"])}
    assert set(rows) == {"lm", "mc", "schema"} and all(r[2] == "3" for r in rows.values())


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gemma3"])
def test_extend_and_load_rows_equal_prefills_of_the_whole_sequence(arch):
    cfg = {"gpt2": lambda: GPTConfig(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=16),
           "llama": lambda: LlamaConfig(block_size=32, vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                                        ffn_hidden=40),
           "gemma3": lambda: Gemma3Config(block_size=32, vocab_size=50, n_layer=3, n_head=4, n_kv_head=2, n_embd=32,
                                          head_dim=8, ffn_hidden=40, sliding_window=6, sliding_window_pattern=3)}[arch]()
    m = get_family(arch).model(cfg, seed=1)
    seq = np.random.default_rng(0).integers(0, 50, (3, 20))
    ref = np.stack([m.KV_CACHE(m, 3).prefill(seq[:, :t + 1]) for t in range(20)], 1)  # (3, 20, V)
    c = m.KV_CACHE(m, 4, length=25)
    c.resize(3, 30)
    np.testing.assert_allclose(c.prefill(seq[:, :7]), ref[:, 6], atol=1e-5)
    np.testing.assert_allclose(c.extend(seq[:, 7:]), ref[:, 7:], atol=1e-5)
    query = m.KV_CACHE(m, 2, length=25)
    query.resize(1, 10)
    query.prefill(seq[1:2, :5])
    branch = m.KV_CACHE(m, 5, length=25)
    branch.load_rows(query, [0, 0, 0], 12)
    mask = np.zeros((3, 7), bool)
    mask[0, 2:], mask[2, :3] = True, True
    got = branch.extend(np.stack([seq[1, 5:12]] * 3), select=mask)
    np.testing.assert_allclose(got, np.concatenate([ref[1, 7:12], ref[1, 5:8]]), atol=1e-5)
    with pytest.raises(ValueError, match="B \\* length"):
        branch.resize(5, 30)


BAD = {
    "unknown-layout": ('{"query": "q", "choices": ["a", "b"], "gold": 0}\n{"question": "q", "answer": "a"}\n',
                       r"bad\.jsonl:2: unknown layout \(keys \['answer', 'question'\]\)"),
    "gold-out-of-range": ('{"query": "q", "choices": ["a", "b"], "gold": 2}\n',
                          r"bad\.jsonl:1: gold 2 is out of range for 2 choices \(0 to 1\)"),
    "gold-not-int": ('{"context_options": ["a", "b"], "continuation": "c", "gold": "1"}\n',
                     r"bad\.jsonl:1: gold must be an integer"),
    "empty-file": ("\n\n", r"bad\.jsonl: no rows \(an empty file\)"),
    "not-json": ('{"context": "a", "continuation": "b"}\n{"context": "a", \n', r"bad\.jsonl:2: not JSON"),
    "mixed-kinds": ('{"context": "a", "continuation": "b"}\n{"query": "q", "choices": ["a", "b"], "gold": 0}\n',
                    r"bad\.jsonl:2: a multiple choice row in a file of language modelling rows"),
    "one-choice": ('{"query": "q", "choices": ["a"], "gold": 0}\n', r"bad\.jsonl:1: choices must be a list of at least 2"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_naming_file_and_line(case, tmp_path, capsys):
    text, pattern = BAD[case]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    assert cli(["eval", "--run", str(tmp_path / "no-model"), "--tasks", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert re.search(pattern, err), err


@pytest.mark.parametrize("argv, match", [
    (["--tasks", "{tmp}/nothing.jsonl"], "nothing.jsonl: no such file or directory"),
    (["--tasks", "arc_eazy"], r"--tasks arc_eazy: no such file or directory, nor a standard task's name "
                              r"\(arc_challenge, arc_easy, boolq, copa, hellaswag, lambada_openai, piqa, siqa, winogrande\)"),
    (["--tasks", "{tmp}"], "a directory with no \\*.jsonl files"),
    (["--tasks", "{tmp}/ok.jsonl", "--limit", "0"], "--limit must be >= 1"),
    (["--tasks", "{tmp}/ok.jsonl", "--batch-size", "0"], "--batch-size must be >= 1"),
])
def test_bad_arguments(argv, match, tmp_path, capsys):
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "sub" / "ok.jsonl", [{"context": "a", "continuation": "b"}])
    argv = [a.format(tmp=tmp_path if "ok" not in a else tmp_path / "sub") for a in argv]
    assert cli(["eval", "--run", str(tmp_path / "no-model")] + argv) == 2
    assert re.search(match, capsys.readouterr().err)


def test_partition_pads_short_pairs_only_where_a_forward_more_costs_more():
    from handgrad.eval.score import _partition
    assert [list(r) for r in _partition([1, 1, 1, 30], 5)] == [[0, 1, 2], [3]]  # 5 + 3 + 5 + 30 < 4 * 30
    assert [list(r) for r in _partition([2, 3, 4], 50)] == [[0, 1, 2]]  # one forward: 50 + 12
    assert _partition([], 30) == []


def test_a_handgrad_run_scores_as_its_own_full_forward(tmp_path, capsys):
    """A run directory (GPT-2, byte tokenizer, block_size 16: most rows truncated) against
    model.forward on each whole pair, cut to its last 17 tokens."""
    from handgrad.data.tokenizer import ByteTokenizer
    from handgrad.interop.checkpoint import save_checkpoint
    from handgrad.models.gpt2 import GPT
    from handgrad.training.optim import AdamW
    config = GPTConfig(block_size=16, vocab_size=256, n_layer=2, n_head=2, n_embd=16)
    model = GPT(config, seed=0)
    model.params[:] = np.random.default_rng(0).standard_normal(model.num_params, dtype=np.float32) * 0.3
    run = tmp_path / "run"
    save_checkpoint(run, 3, model, AdamW(model), {"model_config": config.to_dict()})
    ByteTokenizer().save(run)
    rows = [{"query": "the cat sat on", "choices": ["the mat", "a box"], "gold": 0},
            {"query": "x", "choices": ["y", "a long choice"], "gold": 1}]
    task = _write(tmp_path / "bytes.jsonl", rows)
    assert cli(["eval", "--run", str(run), "--tasks", str(task), "--json", "--out", str(tmp_path / "out")]) == 0
    report = json.loads(capsys.readouterr().out)
    got = [json.loads(line) for line in (tmp_path / "out" / "bytes.jsonl").read_text().splitlines()]
    for r, g in zip(rows, got):
        for c, lp in zip(r["choices"], g["logprobs"]):
            ctx, cont = list(r["query"].encode()), list((" " + c).encode())
            seq = (ctx + cont)[-17:]
            logits = model.forward(np.array([seq[:-1]]))[0, -len(cont):].astype(np.float64)
            logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
                - logits.max(1, keepdims=True)
            assert lp == pytest.approx(logp[np.arange(len(cont)), cont].sum(), abs=1e-4)
    assert report["tasks"]["bytes"]["truncated"] == 1  # row 1: 22 and 20 tokens
    _write(task, rows + [{"query": "a", "choices": ["b", "a continuation of 17"], "gold": 0}])
    assert cli(["eval", "--run", str(run), "--tasks", str(task)]) == 2
    assert re.search(r"bytes\.jsonl:3: the continuation ' a continuation of 17' is 21 tokens; it must be 1 to 16",
                     capsys.readouterr().err)


def _train_tasks(d):
    d.mkdir()
    _write(d / "mc.jsonl", [{"query": "the cat sat on", "choices": ["the mat", "a box", "the cat"], "gold": 0},
                            {"query": "a dog", "choices": ["sat", "ran on the mat"], "gold": 1},
                            {"query": "the mat", "choices": ["is red", "sat"], "gold": 0},
                            {"query": "on the", "choices": ["mat", "cat"], "gold": 0}])
    _write(d / "lm.jsonl", [{"context": "the cat sat on the", "continuation": "mat"},
                            {"context": "the dog", "continuation": "sat"},
                            {"context": "a cat", "continuation": "ran"}])
    return d


def test_train_eval_tasks_score_each_evaluation_as_handgrad_eval_does(tmp_path, capsys):
    """train.eval_tasks: at steps 2 and 4 (eval_interval 2) metrics.jsonl and TensorBoard hold each
    task's metrics, the numbers `handgrad eval` gives for the checkpoint of that step."""
    from handgrad.data.prepare import prepare
    (tmp_path / "text.txt").write_text("the cat sat on the mat. a dog ran on the mat. " * 100)
    prepare([str(tmp_path / "text.txt")], tmp_path / "data", tokenizer="byte", val_fraction=0.1, seed=1)
    tasks, run = _train_tasks(tmp_path / "tasks"), tmp_path / "run"
    argv = ["train", "--data", str(tmp_path / "data"), "--out", str(run), "--preset", "tiny", "--model.n_embd", "32",
            "--model.block_size", "32", "--train.batch_size", "4", "--train.max_steps", "4",
            "--train.eval_interval", "2", "--train.eval_steps", "1", "--train.sample_interval", "0",
            "--train.checkpoint_interval", "2", "--train.eval_tasks", str(tasks), "--train.eval_limit", "3"]
    tb = importlib.util.find_spec("tensorboardX") is not None
    assert cli(argv + (["--train.log_to", "tensorboard"] if tb else [])) == 0
    out = capsys.readouterr().out
    assert "eval tasks: lm (3 rows), mc (3 rows); bos none" in out
    assert re.search(r"step +4 \|.*\| val \d\.\d{4} \| lm \d\.\d{3} \| mc \d\.\d{3}", out)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    keys = {"eval/mc/acc", "eval/mc/acc_norm", "eval/lm/acc", "eval/lm/perplexity"}
    for r in evals:
        assert keys == {k for k in r if k.startswith("eval/")}
        assert cli(["eval", "--run", str(run / "ckpt" / f"step_{r['step']:08d}"), "--tasks", str(tasks),
                    "--limit", "3", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)["tasks"]
        for key in keys:
            _, task, metric = key.split("/")
            assert r[key] == pytest.approx(report[task][metric], rel=1e-9), key
    if tb:
        ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
        acc = ea.EventAccumulator(str(run / "tb"))
        acc.Reload()
        assert [(e.step, pytest.approx(e.value)) for e in acc.Scalars("eval/lm/perplexity")] == \
            [(r["step"], r["eval/lm/perplexity"]) for r in evals]


@pytest.mark.parametrize("extra, match", [
    (["--train.eval_tasks", "nope.jsonl"], r"train\.eval_tasks nope\.jsonl: no such file or directory"),
    (["--train.eval_tasks", "TASKS", "--train.eval_interval", "0"], r"train\.eval_tasks: scored at each evaluation, "
                                                                     r"and train\.eval_interval is 0"),
    (["--train.eval_tasks", "BAD"], r"train\.eval_tasks: .*bad\.jsonl:1: "),
    (["--train.eval_limit", "-1"], r"train\.eval_limit: must be >= 0"),
])
def test_train_eval_tasks_errors_are_one_line_before_training(extra, match, tmp_path, capsys):
    from handgrad.data.prepare import prepare
    (tmp_path / "text.txt").write_text("the cat sat on the mat. " * 50)
    prepare([str(tmp_path / "text.txt")], tmp_path / "data", tokenizer="byte", val_fraction=0.1, seed=1)
    tasks = _train_tasks(tmp_path / "tasks")
    bad = _write(tmp_path / "bad.jsonl", [{"question": "?", "answer": "!"}])
    extra = [{"TASKS": str(tasks), "BAD": str(bad)}.get(a, a) for a in extra]
    assert cli(["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"), "--preset", "tiny",
                "--train.max_steps", "2", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(match, err[0]), err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_bench_eval_scores_with_transformers_beside_handgrad_and_counts_disagreements(setup, capsys):
    """bench eval: the same token sequences on both sides (checked inside), every prediction the
    same, log-probabilities within 1e-4, rows/s of both sides."""
    kind, root, ref, tasks = setup
    assert cli(["bench", "eval", "--run", str(root / "model"), "--tasks", ",".join(str(p) for p in tasks.values()),
                "--limit", "6", "--threads", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [t["task"] for t in doc["tasks"]] == list(tasks) and doc["threads"] == 1
    for t in doc["tasks"]:
        assert t["rows"] == min(6, len(tasks[t["task"]].read_text().splitlines())), t
        assert t["rows_differ"] == [] and t["max_abs_logprob_diff"] < 1e-4, t
        assert t["handgrad_rows_s"] > 0 and t["transformers_rows_s"] > 0
    assert doc["total"]["rows"] == sum(t["rows"] for t in doc["tasks"]) and doc["total"]["differ"] == 0
    with pytest.raises(SystemExit, match="bench eval: needs --run MODEL and --tasks"):
        cli(["bench", "eval", "--tasks", str(tasks["mc"])])


def test_bench_eval_scores_a_pair_transformers_tokenizes_otherwise_on_handgrads_tokens():
    """A pair whose transformers tokens differ from handgrad's (SmolLM2's digits under transformers'
    GGUF loader) is scored on handgrad's tokens and its row counted, not a stop of the whole run."""
    import torch
    from types import SimpleNamespace

    from handgrad.bench.eval import _tf_score
    V = 7

    class Tok:
        eos_token_id = 0

        def encode(self, text, add_special_tokens=False):
            return [1, 2] if text == "ctx" else [3]

    def model(ids):
        logits = torch.zeros(1, ids.shape[1], V)
        logits[0, :, 5] = 1.0  # token 5 is every position's argmax
        return SimpleNamespace(logits=logits)

    row = SimpleNamespace(line=4, contexts=["ctx", "ctx"], continuations=["a", "a"])
    task = SimpleNamespace(rows=[row], path="t.jsonl")
    same = np.array([1, 2, 3])
    other = np.array([1, 2, 5, 5])  # handgrad's split: a 2-token continuation, both the argmax
    e = SimpleNamespace(seqs=[same, other], n_ctx=[2, 2])
    otherwise = []
    (lp, greedy), = _tf_score(model, Tok(), torch, task, [e], None, otherwise)
    lse = np.log(6 + np.e)
    assert otherwise == [4]
    np.testing.assert_allclose(lp, [-lse, 2 * (1 - lse)], rtol=1e-12)
    assert greedy.tolist() == [False, True]
    with pytest.raises(SystemExit, match="t.jsonl:4: transformers' tokenizer gives other tokens"):
        _tf_score(model, Tok(), torch, task, [e], None)


# The standard tasks by name (eval/hub.py), from files this module writes where the Hub keeps its
# parquet conversions, served through a file:// HF_ENDPOINT: the real fetch, cache, parquet read
# and conversion run. Per task: rows in the dataset's own schema, each beside the llm-foundry row
# that lm-evaluation-harness's YAML for the task makes of it, written out here by hand.
HUB_ROWS = {
    "arc_challenge": [
        ({"id": "Mercury_1", "question": "Why do leaves fall?",
          "choices": {"text": ["cold", "wind"], "label": ["A", "B"]}, "answerKey": "A"},
         {"query": "Question: Why do leaves fall?\nAnswer:", "choices": ["cold", "wind"], "gold": 0}),
        ({"id": "Mercury_2", "question": "Which is a gas?", "choices": {"text": ["ice", "steam", "rock"],
                                                                        "label": ["A", "B", "C"]}, "answerKey": "B"},
         {"query": "Question: Which is a gas?\nAnswer:", "choices": ["ice", "steam", "rock"], "gold": 1}),
    ],
    "arc_easy": [
        ({"id": "Mercury_7", "question": "Which gas do plants take in?",
          "choices": {"text": ["oxygen", "carbon dioxide", "helium"], "label": ["A", "B", "C"]}, "answerKey": "B"},
         {"query": "Question: Which gas do plants take in?\nAnswer:", "choices": ["oxygen", "carbon dioxide", "helium"],
          "gold": 1}),
        ({"id": "NYSEDREGENTS_4", "question": "What melts ice?",
          "choices": {"text": ["heat", "cold", "dark", "wind"], "label": ["1", "2", "3", "4"]}, "answerKey": "4"},
         {"query": "Question: What melts ice?\nAnswer:", "choices": ["heat", "cold", "dark", "wind"], "gold": 3}),
    ],
    "boolq": [
        ({"question": "is the sky blue", "passage": "The sky is blue on a clear day.", "idx": 0, "label": 1},
         {"query": "The sky is blue on a clear day.\nQuestion: is the sky blue?\nAnswer:", "choices": ["no", "yes"],
          "gold": 1}),
        ({"question": "can a cat fly", "passage": "Cats walk.", "idx": 1, "label": 0},
         {"query": "Cats walk.\nQuestion: can a cat fly?\nAnswer:", "choices": ["no", "yes"], "gold": 0}),
    ],
    "copa": [
        ({"premise": "The man turned on the faucet.", "choice1": "The toilet filled with water.",
          "choice2": "Water flowed from the spout.", "question": "effect", "idx": 0, "label": 1},
         {"query": "The man turned on the faucet therefore",
          "choices": [" the toilet filled with water.", " water flowed from the spout."], "gold": 1}),
        ({"premise": "My body cast a shadow over the grass. ", "choice1": "The sun was rising.",
          "choice2": "The grass was cut.", "question": "cause", "idx": 1, "label": 0},
         {"query": "My body cast a shadow over the grass because",
          "choices": [" the sun was rising.", " the grass was cut."], "gold": 0}),
    ],
    "hellaswag": [
        ({"ind": 4, "activity_label": "Removing ice from car", "ctx_a": "Then, the man writes over the snow.",
          "ctx_b": "then", "ctx": "Then, the man writes over the snow. then",
          "endings": [", the man adds wax.", ", a woman smiles.", ", the car drives.", ", the snow melts."],
          "source_id": "activitynet~v_1", "split": "val", "split_type": "indomain", "label": "3"},
         {"query": "Removing ice from car: Then, the man writes over the snow. Then",
          "choices": [", the man adds wax.", ", a woman smiles.", ", the car drives.", ", the snow melts."],
          "gold": 3}),
        ({"ind": 9, "activity_label": "Home and Garden", "ctx_a": "[header] How to grow tomatoes [title] Pick a spot.",
          "ctx_b": "", "ctx": "", "endings": ["Water them daily. [substeps] Use a can.", "Dig  a hole.",
                                               "Plant [step] seeds.", "Wait."],
          "source_id": "wikihow~1", "split": "val", "split_type": "zeroshot", "label": "0"},
         {"query": "Home and Garden: How to grow tomatoes. Pick a spot.",
          "choices": ["Water them daily. Use a can.", "Dig a hole.", "Plant seeds.", "Wait."], "gold": 0}),
    ],
    "lambada_openai": [
        ({"text": "He lit the candle and\nwatched the flame"},
         {"context": "He lit the candle and\nwatched the", "continuation": "flame"}),
        ({"text": "She opened the door"}, {"context": "She opened the", "continuation": "door"}),
    ],
    "piqa": [
        ({"goal": "How to open a jar", "sol1": "Twist the lid.", "sol2": "Eat the lid.", "label": 0},
         {"query": "Question: How to open a jar\nAnswer:", "choices": ["Twist the lid.", "Eat the lid."], "gold": 0}),
        ({"goal": "dresser", "sol1": "replace drawer with pin", "sol2": "finish with pin", "label": 1},
         {"query": "Question: dresser\nAnswer:", "choices": ["replace drawer with pin", "finish with pin"], "gold": 1}),
    ],
    "siqa": [
        ({"context": "Tracy went home.", "question": "What does Tracy need to do before this?",
          "answerA": "make a plan", "answerB": "find a car", "answerC": "sleep", "label": "2"},
         {"query": "Q: Tracy went home. What does Tracy need to do before this?\nA:",
          "choices": ["make a plan", "find a car", "sleep"], "gold": 1}),
        ({"context": "Sydney ran.", "question": "How would you describe Sydney?", "answerA": "fast",
          "answerB": "slow", "answerC": "tired", "label": "3"},
         {"query": "Q: Sydney ran. How would you describe Sydney?\nA:", "choices": ["fast", "slow", "tired"],
          "gold": 2}),
    ],
    "winogrande": [
        ({"sentence": "Sarah was a better surgeon than Maria so _ always got the easier cases.", "option1": "Sarah",
          "option2": "Maria", "answer": "2"},
         {"context_options": ["Sarah was a better surgeon than Maria so Sarah",
                              "Sarah was a better surgeon than Maria so Maria"],
          "continuation": "always got the easier cases.", "gold": 1}),
        ({"sentence": "The cup fell off the table because _ was slippery.", "option1": "the cup",
          "option2": "the table", "answer": "1"},
         {"context_options": ["The cup fell off the table because the cup",
                              "The cup fell off the table because the table"],
          "continuation": "was slippery.", "gold": 0}),
    ],
}


def _hub_files(root):
    """Every standard task's split at root/datasets/REPO/resolve/refs/convert/parquet/CONFIG/SPLIT/
    0000.parquet (the Hub's URL path, %2F unquoted as a file:// URL's path is): its HUB_ROWS
    records, repeated up to the split's size."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from handgrad.eval.hub import NAMED
    for name, t in NAMED.items():
        records = [record for record, _ in HUB_ROWS[name]]
        records = (records * t.rows)[:t.rows]
        d = root / "datasets" / t.repo / "resolve" / "refs" / "convert" / "parquet" / t.config / t.split
        d.mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(records), d / "0000.parquet")
    return root


@pytest.fixture
def hub(tmp_path, monkeypatch):
    root = _hub_files(tmp_path / "hub")
    monkeypatch.setenv("HF_ENDPOINT", root.as_uri())
    monkeypatch.setenv("HANDGRAD_CACHE", str(tmp_path / "cache"))
    return root


def test_named_tasks_are_the_harness_rows_of_the_hubs_parquet_files(hub, tmp_path):
    """Every standard task read by name has, row for row, what read_task makes of a JSONL file of the
    rows the harness builds; the second read comes from the cache, with the Hub gone."""
    import shutil

    from handgrad.eval.hub import NAMED, cached_path
    from handgrad.eval.tasks import read_task, read_tasks
    tasks = read_tasks(",".join(NAMED))
    assert [t.name for t in tasks] == list(NAMED)
    for task in tasks:
        built = [obj for _, obj in HUB_ROWS[task.name]]
        jsonl = read_task(_write(tmp_path / f"{task.name}.jsonl", built))
        assert (task.kind, len(task.rows), task.path) == (jsonl.kind, NAMED[task.name].rows, cached_path(task.name))
        assert task.rows[:len(built)] == jsonl.rows, task.name
        assert task.rows[len(built)].contexts == jsonl.rows[0].contexts  # the rows repeat: the split's order kept
    assert {t.name: t.kind for t in tasks if t.kind != "multiple_choice"} == {"lambada_openai": "language_modelling",
                                                                             "winogrande": "schema"}
    shutil.rmtree(hub)
    copa, wino = read_tasks("copa,winogrande", limit=3)
    assert (copa.rows, wino.rows) == (tasks[3].rows[:3], tasks[-1].rows[:3])


def test_named_tasks_score_as_jsonl_files_of_the_same_rows(setup, hub, tmp_path, capsys):
    """`eval --tasks NAME` and `eval --tasks FILE.jsonl` of the rows the harness builds give the same
    report and the same per-row scores, for each kind of row."""
    kind, root, ref, _ = setup
    names = ["copa", "hellaswag", "lambada_openai", "winogrande"]
    (tmp_path / "jsonl").mkdir()
    files = [_write(tmp_path / "jsonl" / f"{n}.jsonl", [obj for _, obj in HUB_ROWS[n]]) for n in names]
    reports = []
    for spec, out in ((",".join(names), tmp_path / "named"), (",".join(map(str, files)), tmp_path / "files")):
        assert cli(["eval", "--run", str(root / "model"), "--tasks", spec, "--limit", "2", "--json",
                    "--out", str(out)]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    for name in names:
        named, file = ({k: v for k, v in r["tasks"][name].items() if k not in ("seconds", "rows_per_s", "path")}
                       for r in reports)
        assert named == file and named["rows"] == 2, name
        assert ((tmp_path / "named" / f"{name}.jsonl").read_text() ==
                (tmp_path / "files" / f"{name}.jsonl").read_text()), name
    assert reports[0]["tasks"]["copa"]["path"].endswith("validation.parquet")


@pytest.mark.parametrize("endpoint", ["file", "http"])
def test_a_task_name_that_cannot_be_fetched_is_one_line_naming_the_url_and_the_fix(endpoint, tmp_path, monkeypatch,
                                                                                    capsys):
    base = (tmp_path / "no-hub").as_uri() if endpoint == "file" else "http://127.0.0.1:1"
    monkeypatch.setenv("HF_ENDPOINT", base)
    monkeypatch.setenv("HANDGRAD_CACHE", str(tmp_path / "cache"))
    ok = _write(tmp_path / "ok.jsonl", [{"context": "a", "continuation": "b"}])
    assert cli(["eval", "--run", str(tmp_path / "no-model"), "--tasks", f"{ok},piqa", "--json"]) == 2
    out, err = capsys.readouterr()
    url = f"{base}/datasets/baber/piqa/resolve/refs%2Fconvert%2Fparquet/default/validation/0000.parquet"
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: --tasks piqa: could not fetch {url} ("), err
    assert "; pass a local JSONL file of piqa in llm-foundry's layout instead, or put that file at " in err, err
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def test_named_task_errors_are_one_line_with_the_fix(tmp_path, monkeypatch, capsys):
    """No pyarrow; a cached file that is not parquet, has too few rows, or has rows of another
    schema; a name twice (a standard task and a file of that stem)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from handgrad.eval import hub
    from handgrad.eval.hub import cached_path
    monkeypatch.setenv("HF_ENDPOINT", (tmp_path / "no-hub").as_uri())
    monkeypatch.setenv("HANDGRAD_CACHE", str(tmp_path / "cache"))
    path = cached_path("copa")
    path.parent.mkdir(parents=True)
    copa = [record for record, _ in HUB_ROWS["copa"]]

    def err(spec="copa"):
        assert cli(["eval", "--run", str(tmp_path / "no-model"), "--tasks", spec]) == 2
        out, e = capsys.readouterr()
        assert out == "" and len(e.strip().splitlines()) == 1, e
        return e.strip()

    with monkeypatch.context() as m:
        m.setattr(hub, "_parquet", lambda: None)
        assert err() == ("error: --tasks copa: reading the Hub's parquet files needs pyarrow (pip install -e '.[eval]' "
                         "in handgrad's clone, or pip install pyarrow); or pass a local JSONL file of copa in "
                         "llm-foundry's layout instead")
    path.write_bytes(b"<!DOCTYPE html>")
    assert re.fullmatch(rf"error: {re.escape(str(path))}: not a parquet file pyarrow reads \(.*\); delete it so "
                        r"that handgrad fetches file://.*/aps/super_glue/resolve/refs%2Fconvert%2Fparquet/copa/"
                        r"validation/0000\.parquet again", err())
    pq.write_table(pa.Table.from_pylist(copa * 49), path)
    assert err().endswith(f"{path}: 98 rows, where aps/super_glue copa validation has 100; delete it so that "
                          f"handgrad fetches {hub.task_url('copa')} again")
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items() if k != "premise"} for r in copa * 50]), path)
    assert f"{path}: row 1 is not a row of aps/super_glue copa (KeyError: 'premise')" in err()
    _write(tmp_path / "copa.jsonl", [{"context": "a", "continuation": "b"}])
    assert "two tasks named 'copa'" in err(f"copa,{tmp_path / 'copa.jsonl'}")
