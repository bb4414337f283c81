"""bf16 decoding weights (`--dtype bfloat16`: models/decode.py's KVCache(dtype=), blas's few-row and
widened bf16 products): the logits of a prefill and of decode steps stay within twice PyTorch's own
autocast-bf16 error of the float64 forward, on GPT-2, Llama and Qwen2; greedy tokens of serve's
engine in bf16 are generate's; and the flag reaches sample, chat and serve. Runs on any CPU: the
few-row products widen bf16 exactly, a long prefill without hardware bf16 widens to float32."""
import numpy as np
import pytest
from helpers import bf16_models

from handgrad import GPT
from handgrad.cli import main as cli
from handgrad.models.decode import SampleError, generate

torch = pytest.importorskip("torch")

BOUND = 2.0  # handgrad's error <= BOUND x PyTorch autocast's, as tests/test_bf16_cpu.py bounds training
MODELS = bf16_models(block_size=32)  # a 20-token prefill and 4 steps fit


def torch_logits(cls, config, state, idx, dtype, autocast):
    from handgrad.torch_ref import TorchGPT, TorchLlama
    model = (TorchGPT if cls is GPT else TorchLlama)(config, dtype).load_numpy(state)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits, _ = model(torch.from_numpy(idx).long())
    return logits.double().numpy()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("B, T0", [(1, 20), (3, 5)])  # a 20-token prefill is more rows than the few-row kernel
def test_bf16_decoding_logits_within_twice_pytorchs_bf16_error(name, B, T0):
    cls, config = MODELS[name]
    model = cls(config, seed=3)
    rng = np.random.default_rng(0)
    model.params[:] = rng.standard_normal(model.num_params, dtype=np.float32) * np.float32(0.2)
    idx = rng.integers(0, config.vocab_size, (B, T0 + 4))
    cache = model.KV_CACHE(model, B, config.block_size, dtype="bfloat16")
    got = [cache.prefill(idx[:, :T0]).astype(np.float64)]
    for t in range(T0, T0 + 3):
        got.append(cache.step(idx[:, t]).astype(np.float64))
    got = np.stack(got, axis=1)  # (B, 4, V): the logits after positions T0-1 .. T0+2
    state = model.state_dict()
    ref = torch_logits(cls, config, state, idx, torch.float64, False)[:, T0 - 1:T0 + 3]
    pt = torch_logits(cls, config, state, idx, torch.float32, True)[:, T0 - 1:T0 + 3]
    ours, theirs = np.abs(got - ref).max(), np.abs(pt - ref).max()
    assert 0 < ours <= BOUND * theirs, f"{name}: bf16 decoding error {ours:.3g}, PyTorch autocast's {theirs:.3g}"
    f32 = model.KV_CACHE(model, B, config.block_size).prefill(idx[:, :T0]).astype(np.float64)
    assert np.abs(f32 - ref[:, 0]).max() < ours  # the float32 weights are closer: bf16 is in use


def test_bad_dtype_is_named():
    cls, config = MODELS["gpt2"]
    with pytest.raises(SampleError, match="dtype must be one of float32, bfloat16"):
        generate(cls(config, seed=0), [1, 2], 3, dtype="float16")


def test_the_flag_reaches_sample_and_chat(tmp_path, capsys):
    from helpers import tiny_run
    run = tiny_run(tmp_path / "run")
    for dtype in ("float32", "bfloat16"):
        assert cli(["sample", "--run", str(run), "--prompt", "hello", "--temperature", "0", "--max-new-tokens", "8",
                    "--dtype", dtype]) == 0
    out = capsys.readouterr().out.split("\n---------------\n")
    assert out[0] and out[1]
    for verb in ("sample", "chat", "serve"):
        with pytest.raises(SystemExit) as e:
            cli([verb, "--run", str(run), "--dtype", "float16"])
        assert e.value.code == 2 and "--dtype: invalid choice: 'float16'" in capsys.readouterr().err
