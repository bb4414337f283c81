"""`handgrad bench train`: runs both sides, checks them against each other, reports what it says."""
import json
import subprocess
import sys

import numpy as np
import pytest

import handgrad.bench.profile as bench_profile
import handgrad.bench.train as bench_train


def _bench(*args):
    return subprocess.run([sys.executable, "-m", "handgrad", "bench", "train", *args],
                          capture_output=True, text=True, timeout=300)


def test_each_benchmark_takes_its_own_flags(capsys):
    """`--device gpu` picks the gpu for `bench ops` and `bench train` alike (`bench ops --backend gpu`,
    verify's spelling, is the same flag); a flag a benchmark does not take is refused in one line
    that names that benchmark's --help."""
    from handgrad.cli import build_parser, main
    parse = build_parser().parse_args
    assert parse(["bench", "ops", "--backend", "gpu"]).device == parse(["bench", "ops", "--device", "gpu"]).device
    assert parse(["bench", "ops", "--device", "gpu"]).device == parse(["bench", "train", "--device", "gpu"]).device
    for argv, says in [(["products", "--steps", "3"], "unrecognized arguments: --steps 3; see `handgrad bench "
                                                       "products --help`"),
                       (["decode", "--new-token", "3"], "unrecognized arguments: --new-token 3 (did you mean "
                                                        "--new-tokens?); see `handgrad bench decode --help`"),
                       (["train", "--backend", "gpu"], "unrecognized arguments: --backend gpu; see `handgrad bench "
                                                       "train --help`")]:
        with pytest.raises(SystemExit) as e:
            main(["bench", *argv])
        assert e.value.code == 2 and capsys.readouterr().err == f"error: {says}\n"


def test_bench_train_tiny_json_with_profile():
    out = _bench("--preset", "tiny", "--steps", "2", "--profile", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    (row,) = result["rows"]
    assert row["name"] == "tiny" and row["steps"] == 2
    assert row["loss_max_rel_diff"] <= bench_train.LOSS_RTOL
    assert row["tokens_per_step"] == 8 * 64
    for side in ("handgrad", "pytorch"):
        s = row["sides"][side]
        assert s["tok_s"] > 0 and s["gflops"] > 0 and 0 < s["mfu"] < 2
        assert s["peak_rss_mib"] >= s["baseline_rss_mib"] > 0
        # tok/s and GFLOP/s are the same measurement in two units
        assert s["gflops"] == pytest.approx(s["tok_s"] * row["flops_per_token"] / 1e9, rel=1e-9)
    assert row["ratio_tok_s"] == pytest.approx(row["sides"]["handgrad"]["tok_s"] / row["sides"]["pytorch"]["tok_s"])
    ops = row["profile"]["ops"]
    assert {"attention_forward", "attention_backward", "adamw_update", "global_norm"} <= set(ops)
    assert ops["attention_forward"]["calls"] == 2  # once per layer per step
    assert sum(v["s"] for v in ops.values()) <= row["profile"]["step_s"] * 1.01
    # the time inside blas.gemm, attributed to the op that called it; on MKL, attention's
    # products run inside its per-head kernels instead, which do not call blas.gemm
    per_head = result["environment"]["handgrad_blas"] == "mkl"
    gemm_ops = ("linear", "layernorm_linear") + (() if per_head else ("attention",))
    for op, v in ops.items():
        assert 0 <= v["blas_s"] <= v["s"], op
        assert (v["blas_s"] > 0) == op.startswith(gemm_ops), op
    # the matmul floor replays every product of a step: per layer, blas.gemm 4 times in the
    # forward (qkv, proj, fc, mlp proj) and 8 in the backward, plus the lm_head's 1 + 2; attention's
    # q k^T and P v (2 more gemms forward, 4 backward), or on MKL its two per-head kernels. The
    # flop counts the products as computed: at T = 64 the per-head kernels' one 64-row block is the
    # full T x T too, so the count is the same either way (test_matmul_floor_counts_... below).
    mm = row["profile"]["matmuls"]
    m = row["config"]["model"]
    L, C, V, B, T = m["n_layer"], m["n_embd"], m["vocab_size"], 8, 64
    assert mm["calls"] == 12 * L + 3 + (2 * L if per_head else 6 * L)
    assert mm["attention_calls"] == (2 * L if per_head else 0)
    assert mm["flop"] == 3 * (L * (2 * B * T * 12 * C * C + 4 * B * T * T * C) + 2 * B * T * C * V)
    # the floor (the step's products alone) and the profiled step are two timings of tiny shapes on
    # a shared machine: noise can put the floor above the step (seen in CI: 12.8 against 11.3 ms),
    # so this bounds the floor by a few steps rather than by one
    assert 0 < mm["s"] < 3 * row["profile"]["step_s"]
    table = bench_train.format_row(row) + bench_train.format_footer(result)  # what the table prints
    assert "handgrad/pytorch: tok/s" in table and "outside the ops" in table and "sgemm peak" in table
    assert "in BLAS" in table and "outside BLAS" in table
    # the model's FLOPs, the count `handgrad train` uses for MFU (causal attention as half), and
    # the floor's own throughput, of the products as computed, labelled apart
    from handgrad.config import GPTConfig
    from handgrad.models.gpt2 import flops_per_token
    assert row["flops_per_token"] == flops_per_token(GPTConfig(**m), T)
    assert "MFLOP/token (the model's: causal attention as half)" in table
    assert "6·L·C·(T+1) for attention's causal half" in table and "GFLOP/s of the products as computed" in table
    assert f"matmul floor: the step's {mm['calls']} BLAS calls" in table and "pytorch's step / that floor" in table


def test_matmul_floor_counts_the_per_head_kernels_products_as_they_run():
    """The floor's flop (its own GFLOP/s) counts attention's per-head products causal in blocks, as
    the kernels run them: at T <= the block, the full T x T; at mid's T = 256 in 64-row blocks,
    10/16 of it (the attention module's docstring); never less than the causal part."""
    from handgrad.backends.cpu.attention import CAUSAL_BLOCK
    B, C = 8, 512
    full_fwd, full_bwd = 4 * B * 64 * 64 * C, 8 * B * 64 * 64 * C
    assert bench_profile.head_kernel_flop(True, B, 64, C, 64) == full_fwd
    assert bench_profile.head_kernel_flop(False, B, 64, C, 64) == full_bwd
    assert bench_profile.head_kernel_flop(True, B, 256, C, 64) * 16 == 10 * 4 * B * 256 * 256 * C
    assert bench_profile.head_kernel_flop(False, B, 256, C, 64) * 16 == 10 * 8 * B * 256 * 256 * C
    for T in (1, 37, 64, 100, 256, 1000):
        causal = T * (T + 1) // 2  # (query, key) pairs the mask keeps
        fwd = bench_profile.head_kernel_flop(True, B, T, C, CAUSAL_BLOCK)
        assert 4 * B * causal * C <= fwd <= 4 * B * T * T * C
        assert bench_profile.head_kernel_flop(False, B, T, C, CAUSAL_BLOCK) == 2 * fwd  # dP, dq like S, y; dv, dk mirror them


def test_bench_train_unknown_preset():
    bad = _bench("--preset", "huge")
    assert bad.returncode != 0 and "unknown preset 'huge'" in bad.stderr
    # recompute on a GPT-2 shape: refused in one line before any worker starts (no side to checkpoint)
    bad = _bench("--preset", "tiny", "--recompute", "block", "--steps", "2")
    assert bad.returncode != 0 and bad.stderr.strip().splitlines() == [
        "bench train --recompute block: tiny is a GPT-2 shape; the PyTorch side's gradient checkpointing is "
        "transformers' (llama-char, llama-mid, smollm2-135m, gemma3-270m, ...)"]


def test_check_losses_refuses_a_mismatch():
    n = bench_train.LOSS_CHECK_STEPS
    assert bench_train._check_losses("x", [2.0, 1.5], [2.0, 1.5 * (1 + 1e-5)]) < 1e-4
    with pytest.raises(SystemExit, match="step 2 loss"):
        bench_train._check_losses("x", [2.0, 1.6], [2.0, 1.5])
    with pytest.raises(SystemExit, match="CHECK FAILED.*step 2 handgrad loss is nan"):
        bench_train._check_losses("x", [2.0, np.nan], [2.0, 1.5])
    # past the checked steps the two float32 trajectories may drift apart, but must stay finite
    assert bench_train._check_losses("x", [2.0] * n + [1.0], [2.0] * n + [1.5]) == 0.0
    with pytest.raises(SystemExit, match=f"step {n + 2} handgrad loss is inf"):
        bench_train._check_losses("x", [2.0] * n + [1.0, np.inf], [2.0] * (n + 2))


def test_profiler_times_ops_and_passes_the_rest_through():
    from handgrad.backends import cpu
    prof = bench_profile.Profiler(cpu)
    x = prof.zeros((4, 8))
    assert isinstance(x, np.ndarray) and not prof.calls  # storage helpers are not timed
    out = prof.empty((4, 8))
    prof.residual_forward(out, x, x)
    assert prof.calls == {"residual_forward": 1} and prof.seconds["residual_forward"] > 0
    assert bench_profile._family("adamw_update") == ("optimizer", "step")
    assert bench_profile._family("layernorm_linear_backward") == ("layernorm_linear", "backward")


def test_bench_train_bf16_runs_three_sides():
    """--dtype bfloat16: handgrad bf16, PyTorch autocast bf16, handgrad float32; the bf16 losses
    start within rounding of float32's, and the row says so (on a CPU without bf16 multiply too:
    the products widened). With --lora, the three sides each carry the adapters."""
    out = _bench("--preset", "tiny", "--steps", "2", "--dtype", "bfloat16", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    (row,) = result["rows"]
    assert set(row["sides"]) == {"handgrad", "pytorch", "handgrad-fp32"}
    assert result["bf16_peak"]["dtype"] == "bfloat16" and result["bf16_peak"]["median_gflops"] > 0
    assert result["bf16_peak_end"]["dtype"] == "bfloat16"
    peaks = {s: row["mfu_peak_gflops"]["bfloat16" if s != "handgrad-fp32" else "float32"] for s in row["sides"]}
    assert row["mfu_peak_gflops"]["bfloat16"] == max(result[k]["median_gflops"] for k in ("bf16_peak", "bf16_peak_end"))
    assert all(row["sides"][s]["mfu"] == pytest.approx(row["sides"][s]["gflops"] / peaks[s]) for s in peaks)
    assert row["config"]["dtype"] == "bfloat16" and row["loss_max_rel_diff"] <= bench_train.LOSS_RTOL_BF16
    b = row["bf16"]
    assert b["speedup_vs_fp32"] > 0 and set(b["loss_rel_diff_vs_fp32"]) == {"handgrad", "pytorch"}
    assert all(0 < d < 1e-2 for d in b["loss_rel_diff_vs_fp32"].values())  # rounded, not float32, not wrong
    assert "bf16: pytorch = torch.autocast" in bench_train.format_row(row)
    out = _bench("--preset", "llama-char", "--lora", "4", "--dtype", "bfloat16", "--steps", "2", "--json")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["rows"]
    assert set(row["sides"]) == {"handgrad", "pytorch", "handgrad-fp32"} and row["lora"]["rank"] == 4
    assert row["bf16"]["peak_rss_vs_fp32"] > 0 and row["loss_max_rel_diff"] <= bench_train.LOSS_RTOL_BF16
    assert "pytorch = transformers + PEFT" in bench_train.format_row(row)


def test_bench_train_compile_side_times_torch_compile_apart():
    """--compile: a fourth worker, PyTorch under torch.compile, its compile time apart from its
    steps, its losses those of eager PyTorch (checked before anything is reported)."""
    out = _bench("--preset", "tiny", "--steps", "2", "--compile", "--json")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["rows"]
    c = row["sides"]["pytorch-compile"]
    assert set(row["sides"]) == {"handgrad", "pytorch", "pytorch-compile"} and c["compile_s"] > 0
    assert row["ratio_tok_s_compile"] == pytest.approx(row["sides"]["handgrad"]["tok_s"] / c["tok_s"])
    assert "handgrad/pytorch-compile: tok/s" in bench_train.format_row(row)


def test_bench_ops_blocks_zero_only_what_their_backward_accumulates(monkeypatch):
    """bench ops times each block as the model runs it: zero_grads leaves the written-first weight
    gradients alone (the model's zero_grad does too), and check() starts every gradient at NaN,
    so a gradient the backward accumulates into but zero_grads skipped cannot pass."""
    torch = pytest.importorskip("torch")
    import handgrad.bench.ops as bench_ops
    from handgrad.backends import get_backend
    ops = get_backend("cpu")
    blocks = (bench_ops.AttentionBlock, bench_ops.MLPBlock, bench_ops.RMSNormLinearBlock,
              bench_ops.LlamaAttentionBlock, bench_ops.SwiGLUBlock)
    for cls in blocks:
        block = cls(ops, torch, 5, np.random.default_rng(0))
        assert block.check(cls.__name__) < 1e-5
        assert set(cls.WRITTEN_FIRST) <= {name for name, _, _ in block.params}  # no misspelt name
    monkeypatch.setattr(bench_ops.MLPBlock, "WRITTEN_FIRST", ("w_fc", "w_proj", "b_fc"))  # b_fc accumulates
    with pytest.raises(SystemExit, match="db_fc differs from torch by nan"):
        bench_ops.MLPBlock(ops, torch, 5, np.random.default_rng(0)).check("mlp")


def test_bench_train_memory_settings_one_side_at_a_time():
    """--recompute block, --loss-chunk N and --sequential: handgrad's model built with
    train.recompute and train.loss_chunk, the PyTorch side (transformers + PEFT) with gradient
    checkpointing, the sides run one after another; the losses still agree (the same computation),
    and the row says how it ran."""
    out = _bench("--preset", "llama-char", "--lora", "4", "--steps", "2", "--recompute", "block",
                 "--loss-chunk", "100", "--sequential", "--json")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["rows"]
    assert row["config"]["recompute"] == "block" and row["config"]["loss_chunk"] == 100 and row["sequential"]
    assert set(row["sides"]) == {"handgrad", "pytorch", "handgrad-full"}
    # each worker's peak is its steps' own: the high-water mark restarted once its model was built
    assert all(s["peak_rss_mib"] > 0 and s["build_peak_rss_mib"] > 0 for s in row["sides"].values())
    assert all(s["peak_over_steps_only"] for s in row["sides"].values()) == sys.platform.startswith("linux")
    assert row["sides"]["pytorch"]["numba_compiles"] is None
    assert all(isinstance(row["sides"][s]["numba_compiles"], int) for s in ("handgrad", "handgrad-full"))
    # a side that compiled during its steps (compile_watch() read around them) is named under the row
    row["sides"]["handgrad"]["numba_compiles"], row["sides"]["handgrad-full"]["numba_compiles"] = 3, 0
    assert ("Numba compiled kernels during the steps of handgrad (3): a cold cache, whose compiler's memory is in "
            "that peak RSS; run again for the steady state") in bench_train.format_row(row)
    row["sides"]["handgrad"]["numba_compiles"] = 0
    assert "Numba compiled" not in bench_train.format_row(row)
    assert row["loss_max_rel_diff"] <= bench_train.LOSS_RTOL
    assert ("memory: handgrad train.recompute block, pytorch gradient checkpointing; handgrad train.loss_chunk 100 "
            "(pytorch: whole logits); sides run one after another (--sequential)") in bench_train.format_row(row)


def test_numba_compilations_are_counted():
    """The process's compile watch, whose count a worker reads before and after its steps, grows with
    each Numba compilation (a kernel the cache holds is loaded, not compiled); the memory-settings test
    above checks what the row then says."""
    import numba
    from handgrad.backends.cpu.compiles import compile_watch
    before = compile_watch().count
    numba.njit(cache=False)(lambda x: x + 1)(2)
    assert compile_watch().count - before == 1


def test_bench_train_base_quant_sets_handgrad_beside_handgrad():
    """--base-quant: handgrad's LoRA over the base as held and over it quantized, no PyTorch side; the
    losses agree within the quantization's difference, and the row gives speed and memory against
    the first."""
    out = _bench("--preset", "llama-char", "--lora", "4", "--base-quant", "q8_0", "--steps", "2", "--json")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["rows"]
    assert set(row["sides"]) == {"handgrad", "handgrad-quant"} and "ratio_tok_s" not in row
    q, s = row["base_quant"], row["sides"]
    assert q["type"] == "q8_0" and q["speed_vs_base"] == pytest.approx(s["handgrad-quant"]["tok_s"] / s["handgrad"]["tok_s"])
    assert 0 < row["loss_max_rel_diff"] <= bench_train.LOSS_RTOL_BF16
    assert "handgrad-quant = handgrad's LoRA over the base held q8_0" in bench_train.format_row(row)
    refused = _bench("--preset", "llama-char", "--base-quant", "q8_0", "--steps", "2")
    assert refused.returncode != 0 and "add --lora R" in refused.stderr
