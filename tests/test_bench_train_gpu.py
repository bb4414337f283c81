"""`handgrad bench train --device gpu`: handgrad's bf16 gpu step beside PyTorch eager (autocast bf16)
and torch.compile, the losses checked before anything is timed. Without CUDA this runs under
Triton's interpreter at tiny shapes (times meaningless, the report says so); on a GPU, at B 8, T 1024."""
import json

import pytest

from gpu_helpers import REAL_GPU

import handgrad.bench.train_gpu as train_gpu
from handgrad.bench.gpu_profile import GROUPS
from handgrad.cli import main as cli
from handgrad.models import get_family


PRESETS = ["gpt2-124m", "smollm2-135m"]


def _bench(*args):
    return cli(["bench", "train", "--device", "gpu", *args])


@pytest.fixture
def no_inductor(monkeypatch):
    """The compile side runs its model uncompiled: torch.compile's compiles of the two models take
    ~2 minutes on the CPU here and a minute or more on a GPU, too long for the suite. The plumbing of
    that side is tested; the compiler is exercised by the bench itself (tools/gpu_check.py runs it)."""
    import torch
    monkeypatch.setattr(torch, "compile", lambda model, **mode: model)


def test_bench_train_gpu_json(no_inductor, capsys):
    assert _bench("--preset", ",".join(PRESETS), "--json", "--steps", "2", "--max-autotune", "--profile") == 0
    result = json.loads(capsys.readouterr().out)
    env = result["environment"]
    assert set(env) >= {"device", "torch", "triton", "cuda", "interpreter"} and env["interpreter"] == (not REAL_GPU)
    peak = result["peak"]
    assert peak["what"].startswith("torch.matmul") and peak["median_tflops"] > 0 and peak["repeat"] == 10
    assert [r["name"] for r in result["rows"]] == PRESETS
    for r in result["rows"]:
        assert r["arch"] == ("gpt2" if r["name"] == "gpt2-124m" else "llama")
        if REAL_GPU:  # GPT-2 at llm.c's B 64, or the largest that fits with every side held at once
            assert r["T"] == 1024 and r["batch_size"] == (
                train_gpu.LLMC_BATCHES[r["name"]][len(r["batches_out_of_memory"])] if r["name"] == "gpt2-124m" else 8)
        else:
            assert (r["batch_size"], r["T"]) == (1, 16)
        # train's default: GPT-2's lm_head padded to a multiple of 64 on the gpu (the interpreter's V is 50)
        assert r["vocab_pad"] == (64 if r["name"] == "gpt2-124m" else 1)
        V, pad = r["model"]["vocab_size"], r["vocab_pad"]
        family = get_family(r["arch"])
        N = family.num_params(family.config(**r["model"])) + (-(-V // pad) * pad - V) * r["model"]["n_embd"]
        assert r["llmc_flops_per_token"] == 6 * N + 6 * r["model"]["n_layer"] * r["model"]["n_embd"] * r["T"]
        assert r["steps"] == 2 and r["tokens_per_step"] == r["batch_size"] * r["T"] and r["flops_per_token"] > 0
        check = r["loss_check"]  # the check ran: every side's warm-up losses, within the bf16 tolerance
        assert check["steps"] == train_gpu.WARMUP_STEPS and check["rtol"] == train_gpu.LOSS_RTOL
        # graph (train.cuda_graph) only on CUDA: the interpreter cannot capture
        sides = ["handgrad", "graph", "eager", "compile", "autotune"] if REAL_GPU else \
            ["handgrad", "eager", "compile", "autotune"]
        assert list(check["losses"]) == sides
        assert all(len(v) == train_gpu.WARMUP_STEPS for v in check["losses"].values())
        assert list(r["sides"]) == sides
        for name, s in r["sides"].items():
            assert s["step_ms"] > 0 and s["tflops"] > 0 and 0 < s["mfu"]
            assert s["tok_s"] == pytest.approx(r["tokens_per_step"] / (s["step_ms"] / 1e3))
            assert s["loss_max_rel_diff"] <= train_gpu.LOSS_RTOL
            assert len(s["warmup_s"]) == train_gpu.WARMUP_STEPS and s["first_step_s"] > 0
            assert (s["peak_mem_mib"] is not None) == REAL_GPU
            assert ("compile_s" in s) == (name in ("compile", "autotune"))
            assert (s["mfu_llmc"] is None) == (r["dense_bf16_peak"] is None)
        # --profile: llm.c's groups, every side's kernels on CUDA, handgrad's ops under the interpreter
        prof = r["profile"]
        assert list(prof) == (sides if REAL_GPU else ["handgrad"])
        for p in prof.values():
            assert set(p["groups"]) <= {g for g, _ in GROUPS} | {"other"} and sum(p["groups"].values()) > 0
        if not REAL_GPU:
            assert {"classifier", "attention", "layernorm", "matmul", "gelu", "residual", "encoder", "adamw"} \
                <= set(prof["handgrad"]["groups"])
        for peer in ("eager", "compile", "autotune"):
            assert r[f"ratio_vs_{peer}"] == pytest.approx(r["sides"]["handgrad"]["tok_s"] / r["sides"][peer]["tok_s"])
            assert ("graph_ratio_vs_" + peer in r) == REAL_GPU
        assert "ratio_vs_graph" not in r and "ratio_vs_handgrad" not in r
    text = "\n".join([train_gpu.format_header(result), *map(train_gpu.format_row, result["rows"]),
                      train_gpu.format_footer(result)])
    assert "bf16 peak: torch.matmul" in text and "handgrad/compile" in text and "first 3 losses agree" in text
    assert "handgrad/autotune" in text and "llm.c MFU" in text and "profile (" in text
    assert ("graph/compile" in text) == REAL_GPU
    if not REAL_GPU:  # the graph side's line, from a row with one (a copy of handgrad's side)
        row = dict(result["rows"][0], graph_ratio_vs_eager=1.5, graph_ratio_vs_compile=0.75)
        row["sides"] = dict(row["sides"], graph=row["sides"]["handgrad"])
        line = train_gpu.format_row(row)
        assert "graph/eager 1.50x, graph/compile 0.75x" in line and "\n  graph " in line
    assert ("WARNING: TRITON_INTERPRET=1" in text) == (not REAL_GPU)


def test_a_side_that_computes_something_else_stops_the_bench(monkeypatch):
    """A benchmark of a wrong model measures nothing: eager's weights changed, one line, no timing."""
    from handgrad.torch_ref import TorchGPT
    load = TorchGPT.load_numpy

    def wrong(self, state):
        return load(self, dict(state, **{"ln_f.weight": 100 * state["ln_f.weight"]}))
    monkeypatch.setattr(TorchGPT, "load_numpy", wrong)
    timed = []
    monkeypatch.setattr(train_gpu, "_time", lambda *a: timed.append(a))
    with pytest.raises(SystemExit) as e:
        _bench("--preset", "gpt2-124m", "--no-compile", "--steps", "1")
    message = str(e.value.code)
    assert message.startswith("bench train --device gpu: CHECK FAILED for gpt2-124m: step 1 loss handgrad ")
    assert " vs eager " in message and "relative tolerance 0.01" in message and "\n" not in message
    assert not timed


@pytest.mark.parametrize("flags, words", [(["--lora", "8"], "--lora is not supported"),
                                          (["--dtype", "float32"], "times bf16 training only"),
                                          (["--max-autotune", "--no-compile"], "--max-autotune is a torch.compile side")])
def test_what_the_gpu_bench_does_not_do_is_one_line(flags, words):
    with pytest.raises(SystemExit, match=f"^bench train --device gpu: {words}[^\n]*$"):
        _bench(*flags)

