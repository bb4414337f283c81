"""Packed rows with document masks on the gpu backend, through whole models: a packed batch gives the
loss and every gradient of its documents one per row (GPT-2, Llama, Gemma 3), the gpu and cpu
backends agree on packed rows, and `handgrad train --device gpu` on packed chat data trains with the
cpu's losses and resumes exactly. Without CUDA everything runs in Triton's interpreter."""
import numpy as np
import pytest
from gpu_helpers import assert_trains_like_the_cpu_and_resumes_exactly

from test_chat_pack import BLOCK, dirs  # noqa: F401 (dirs: the packed chat data fixture)
from test_packing import MODELS, T, _documents, one_per_row, packed

from handgrad.config import LlamaConfig
from handgrad.models.llama import Llama

# the gpu's attention takes head sizes of 16 and more: test_packing's Llama with 4 heads of 16
GPU_MODELS = dict(MODELS, llama=(Llama, LlamaConfig(block_size=T, vocab_size=67, n_layer=2, n_head=4, n_kv_head=2,
                                                    n_embd=64, ffn_hidden=80, qkv_bias=True)))


def _run(model, *batch):
    model.zero_grad()
    loss = model.forward(*batch)
    model.backward()
    return loss, model.grads()


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gemma3"])
def test_packed_rows_on_the_gpu_equal_one_document_per_row_and_the_cpu(arch):
    cls, config = GPU_MODELS[arch]
    docs = _documents(config.vocab_size)
    loss_p, grads_p = _run(cls(config, backend="gpu", seed=1), *packed(docs))
    loss_r, grads_r = _run(cls(config, backend="gpu", seed=1), *one_per_row(docs))
    loss_c, grads_c = _run(cls(config, backend="cpu", seed=1), *packed(docs))
    assert abs(loss_p - loss_r) <= 1e-6 * abs(loss_r) and abs(loss_p - loss_c) <= 1e-5 * abs(loss_c)
    for name, g in grads_r.items():
        scale = float(np.abs(g).max())
        assert float(np.abs(grads_p[name] - g).max()) <= 2e-6 * scale, (arch, name, "packed vs one per row")
        assert float(np.abs(grads_p[name] - grads_c[name]).max()) <= 1e-4 * scale, (arch, name, "gpu vs cpu")


def test_train_device_gpu_on_packed_chat_data_matches_cpu_and_resumes_exactly(dirs, tmp_path, capsys):  # noqa: F811
    flags = ["--preset", "llama-char", "--model.n_layer", "2", "--model.n_embd", "32", "--model.n_head", "2",
             "--model.n_kv_head", "1", "--model.ffn_hidden", "48", "--model.block_size", str(BLOCK),
             "--train.batch_size", "2", "--train.max_steps", "3", "--train.eval_interval", "3",
             "--train.eval_steps", "1", "--train.sample_interval", "3", "--train.sample_tokens", "3",
             "--train.checkpoint_interval", "2", "--device", "gpu"]
    assert_trains_like_the_cpu_and_resumes_exactly(dirs["packed"], tmp_path, flags, capsys)
