"""DPO (train.objective dpo) on the gpu backend: one step's loss, rewards and every gradient equal the
cpu's (a Llama, full and LoRA with its adapters off, the whole head and the chunked one: the
objective is the head's, the same for every family), and `handgrad train
--device gpu` on preference pairs trains with the cpu's losses and resumes exactly. Without CUDA
everything runs in Triton's interpreter."""
import numpy as np
import pytest
from gpu_helpers import assert_trains_like_the_cpu_and_resumes_exactly

from test_dpo import MODEL, pair_rows, tok_dir, write_rows  # noqa: F401 (tok_dir: a tokenizer fixture)

from handgrad.config import LlamaConfig, LoRAConfig
from handgrad.data.chat_data import PreferenceDataset
from handgrad.data.prepare import prepare
from handgrad.models.llama import Llama
from handgrad.training.dpo import DPO, METRICS, precompute_reference

T = 64


@pytest.fixture(scope="module")
def pairs_dir(tok_dir, tmp_path_factory):  # noqa: F811
    """10 pairs (8 train, 2 val): the interpreter runs every forward of the reference's pass."""
    root = tmp_path_factory.mktemp("gpu_dpo")
    src = write_rows(root / "pairs.jsonl", pair_rows(10, "conversational", seed=1))
    prepare([str(src)], root / "data", tokenizer=str(tok_dir), format="preference", block_size=T, val_fraction=0.2)
    return root / "data"
CASES = {  # (model class, config, lora, reference, loss_chunk)
    "llama_full": (Llama, LlamaConfig(block_size=T, vocab_size=300, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                                      ffn_hidden=48, tie_embeddings=False), None, "precompute", 0),
    "llama_lora_chunked": (Llama, LlamaConfig(block_size=T, vocab_size=300, n_layer=2, n_head=2, n_kv_head=1,
                                              n_embd=32, ffn_hidden=48), LoRAConfig(rank=2, alpha=4.0, targets=("q", "v")),
                           "adapters_off", 100),
}


def _step(cls, config, lora, reference, loss_chunk, backend, ds, pairs):
    model = cls(config, backend=backend, seed=3, lora=lora, loss_chunk=loss_chunk)
    rng = np.random.default_rng(4)
    params = {n: model.ops.to_numpy(v) for n, v in model.p.items()}
    precomputed = precompute_reference(model, {"train": ds}, len(pairs), T, log=lambda *a: None) \
        if reference == "precompute" else None
    for name in model.layout:  # the policy away from the reference (and a LoRA model's lora_B off zero)
        params[name] = params[name] + rng.standard_normal(params[name].shape).astype(np.float32) * np.float32(0.05)
    model.load_state_dict({n: params[n] for n in model.layout}, names=list(model.layout))
    dpo = DPO(0.1, reference, precomputed)
    model.zero_grad()
    x, y = ds.pairs_of(pairs, T)
    loss = dpo.step(model, (x, y, pairs))
    return loss, dpo.take_metrics(), model.grads()


@pytest.mark.parametrize("case", CASES)
def test_a_dpo_step_on_the_gpu_equals_the_cpu(case, pairs_dir):
    ds = PreferenceDataset(pairs_dir, "train")
    pairs = np.array([0, 3, 5])
    loss_g, metrics_g, grads_g = _step(*CASES[case], "gpu", ds, pairs)
    loss_c, metrics_c, grads_c = _step(*CASES[case], "cpu", ds, pairs)
    assert abs(loss_g - loss_c) <= 1e-5 * abs(loss_c) and abs(metrics_c["rewards/margins"]) > 1e-3
    for key in METRICS:
        assert abs(metrics_g[key] - metrics_c[key]) <= 1e-4 * max(1.0, abs(metrics_c[key])), key
    for name, g in grads_c.items():
        scale = float(np.abs(g).max())
        assert scale > 0 and float(np.abs(grads_g[name] - g).max()) <= 1e-4 * scale, (case, name)


def test_train_device_gpu_dpo_matches_cpu_and_resumes_exactly(pairs_dir, tmp_path, capsys):
    flags = [*MODEL, "--model.n_embd", "32", "--model.n_head", "2", "--model.n_kv_head", "1", "--train.max_steps", "3",
             "--train.eval_interval", "3", "--train.eval_steps", "1", "--train.sample_interval", "3",
             "--train.sample_tokens", "3", "--device", "gpu"]
    assert_trains_like_the_cpu_and_resumes_exactly(pairs_dir, tmp_path, flags, capsys)
