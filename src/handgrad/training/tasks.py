"""`train.eval_tasks`: zero-shot benchmarks scored during training, as `handgrad eval` scores them
(eval/score.py), so a fine-tune shows beside its val loss whether it forgets what the model knew.

The tasks are read and tokenized once, when the run starts (a bad file, row or character fails
before the first step, in one line naming it), with the run's own tokenizer and its bos policy
(eval/score.bos_policy). At each evaluation the model as it stands is scored (a LoRA model with its
adapters folded in, the base untouched) on the first `train.eval_limit` rows of each task, and the
metrics join that step's record: `eval/TASK/acc` for every task, `eval/TASK/acc_norm` for multiple
choice, `eval/TASK/perplexity` for language modelling. Rank 0 scores; the other ranks go on.
"""
from ..config import ConfigError
from ..data.sources import DataError
from ..data.tokenizer import load_tokenizer
from ..eval.score import Scorer, bos_policy, encode_task, task_results
from ..eval.tasks import read_tasks

METRICS = ("acc", "acc_norm", "perplexity")


class TaskEval:
    """The tasks of train.eval_tasks, tokenized for the run; `score(model)` -> {metric key: value}."""

    def __init__(self, spec, limit, data_dir, block_size, backend):
        if backend != "cpu":
            raise ConfigError("train.eval_tasks: scored on the cpu backend only (the scorer's KV cache reads the "
                              "logits on the host); score a gpu run's checkpoints with handgrad eval --run")
        try:
            self.tasks = read_tasks(spec, limit or None, "train.eval_tasks")
            tokenizer = load_tokenizer(data_dir)
            self.bos, self.bos_text = bos_policy(tokenizer)
            self.encoded = [encode_task(task, tokenizer, block_size, self.bos) for task in self.tasks]
        except DataError as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith("train.eval_tasks") else f"train.eval_tasks: {msg}") from None
        self.rows = sum(len(e) for e in self.encoded)

    def describe(self):
        names = ", ".join(f"{t.name} ({len(t.rows)} rows)" for t in self.tasks)
        return f"eval tasks: {names}; bos {self.bos_text}"

    def score(self, model):
        """Every task's metrics for the model's current weights, as flat record keys."""
        scorer = Scorer(model)
        out = {}
        for task, encoded in zip(self.tasks, self.encoded):
            result, _ = task_results(task, scorer.score(encoded))
            out.update({f"eval/{task.name}/{m}": result[m] for m in METRICS if m in result})
        return out
