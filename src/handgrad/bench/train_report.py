"""`handgrad bench train`'s table: a row per shape (bench_shape's result) and the footer."""
from ..machine import float32_products, products_label
from .profile import format_profile


def format_row(r):
    c = r["config"]
    m = c["model"]
    lines = [f"\n{r['name']}: n_layer {m['n_layer']}, n_head {m['n_head']}, n_embd {m['n_embd']}, "
             f"vocab {m['vocab_size']}, B {c['batch_size']}, T {c['T']}; {r['flops_per_token'] / 1e6:.1f} "
             f"MFLOP/token (the model's: causal attention as half); {r['steps']} timed steps per side",
             f"  {'':<15} {'tok/s':>9} {'ms/step':>9} {'GFLOP/s':>8} {'MFU':>6} {'peak RSS':>10} {'(imports)':>10}"]
    for name, s in r["sides"].items():
        mfu = f"{100 * s['mfu']:.1f}%" if "mfu" in s else "?"
        lines.append(f"  {name:<15} {s['tok_s']:>9.1f} {s['step_ms']:>9.1f} {s['gflops']:>8.1f} {mfu:>6} "
                     f"{_mib(s['peak_rss_mib']):>10} {_mib(s['baseline_rss_mib']):>10}")
    cold = [f"{name} ({s['numba_compiles']})" for name, s in r["sides"].items() if s.get("numba_compiles")]
    if cold:  # compilations during the steps, as the worker counted them (compiles.compile_watch)
        lines.append(f"  Numba compiled kernels during the steps of {', '.join(cold)}: a cold cache, whose compiler's "
                     f"memory is in that peak RSS; run again for the steady state")
    mem = f"{r['ratio_peak_rss']:.2f}x" if "ratio_peak_rss" in r else "?"
    if "lora" in r:
        lo = r["lora"]
        full = (f"; handgrad LoRA / handgrad full: tok/s {lo['speedup_vs_full']:.2f}x, peak RSS "
                f"{lo.get('peak_rss_vs_full', float('nan')):.2f}x" if "speedup_vs_full" in lo else "")
        lines.append(f"  LoRA r {lo['rank']} on {','.join(lo['targets'])} ({lo['trained']:,} trained parameters); "
                     f"pytorch = transformers + PEFT{full}")
    if "bf16" in r:
        b = r["bf16"]
        off = b["loss_rel_diff_vs_fp32"]
        lines.append(f"  bf16: pytorch = torch.autocast('cpu', bfloat16); handgrad bf16 / handgrad float32: tok/s "
                     f"{b['speedup_vs_fp32']:.2f}x, peak RSS {b.get('peak_rss_vs_fp32', float('nan')):.2f}x; first {r['loss_check_steps']} losses off handgrad float32's by "
                     f"{off['handgrad']:.1e} (handgrad bf16), {off['pytorch']:.1e} (pytorch autocast)")
    torch_side = "base_quant" not in r  # --base-quant's sides are handgrad's two
    how = [f"handgrad train.recompute {c['recompute']}" + (", pytorch gradient checkpointing" if torch_side else "")
           if c.get("recompute", "none") != "none" else "",
           f"handgrad train.loss_chunk {c['loss_chunk']}" + (" (pytorch: whole logits)" if torch_side else "")
           if c.get("loss_chunk") else "",
           "sides run one after another (--sequential)" if r.get("sequential") else ""]
    if any(how):
        lines.append("  memory: " + "; ".join(h for h in how if h))
    if "ratio_tok_s_compile" in r:
        c = r["sides"]["pytorch-compile"]
        lines.append(f"  pytorch-compile = the pytorch side under torch.compile (its losses checked against eager's); "
                     f"compiled in {c['compile_s']:.1f} s, not in its steps; handgrad/pytorch-compile: tok/s "
                     f"{r['ratio_tok_s_compile']:.2f}x")
    bg = "?" if r["background_cores"] is None else f"{r['background_cores']:.2f}"
    if "base_quant" in r:
        q = r["base_quant"]
        lines.append(f"  handgrad-quant = handgrad's LoRA over the base held {q['type']} (train.base_quant) / handgrad's "
                     f"over the base as held: tok/s {q['speed_vs_base']:.2f}x, peak RSS "
                     f"{q.get('peak_rss_vs_base', float('nan')):.2f}x; losses agree to {r['loss_max_rel_diff']:.1e} over "
                     f"{r['loss_check_steps']} steps; background load {bg} cores")
        return "\n".join(lines)
    lines.append(f"  handgrad/pytorch: tok/s {r['ratio_tok_s']:.2f}x, peak RSS {mem}; losses agree to "
                 f"{r['loss_max_rel_diff']:.1e} over {r['loss_check_steps']} steps (first {r['first_loss'][0]:.5f} vs {r['first_loss'][1]:.5f}); "
                 f"background load {bg} cores")
    if "profile" in r:
        lines += format_profile(r["profile"])
        mm = r["profile"].get("matmuls")
        if mm:
            limit = r["sides"]["pytorch"]["step_ms"] / (1e3 * mm["s"])
            lines.append(f"  pytorch's step / that floor = {limit:.2f}x: the most any engine making these "
                         "matmul calls on this BLAS could be ahead of pytorch here")
    return "\n".join(lines)


def _bf16_how(peak):
    return "widened to float32: no bf16 multiply" if peak.get("path") == "widened" else "oneDNN"


def format_footer(result):
    e, p0, p1 = result["environment"], result["sgemm_peak"], result["sgemm_peak_end"]
    return "\n".join([
        "",
        f"machine {e['cpu']}, {e['cpus']} CPUs; handgrad matmuls on {products_label(e)}"
        f"{' (' + e['mkl_threading'] + ' OpenMP)' if e.get('mkl_threading') else ''}; numba kernels on "
        f"{e['numba_threading_layer']}"
        f"{', ' + str(e['numba_vector_bits']) + '-bit vectors' if e.get('numba_vector_bits') else ''}; numpy {e['numpy']} "
        f"({e['numpy_blas']}), numba {e['numba']}, "
        f"torch {e['torch']} ({e['torch_threads']} threads)",
        f"sgemm peak ({float32_products(e)} float32 {p0['n']}^3): {p0['median_gflops']:.1f} GFLOP/s at start, "
        f"{p1['median_gflops']:.1f} at end"
        + (f"; bf16 matmul peak ({_bf16_how(result['bf16_peak'])} {result['bf16_peak']['n']}^3): "
           f"{result['bf16_peak']['median_gflops']:.1f} at start, {result['bf16_peak_end']['median_gflops']:.1f} at end"
           if "bf16_peak" in result else "")
        + "; MFU = GFLOP/s / the largest peak measured, at start or after a row"
        + (" (bf16 sides: the bf16 peak)" if "bf16_peak" in result else ""),
        "GFLOP/s and MFU count the FLOPs the model needs, as `handgrad train` does (flops_per_token: "
        "6 x the matrix parameters + 6·L·C·(T+1) for attention's causal half)",
        "tok/s from the median step; peak RSS = the worker process's high-water mark (VmHWM) over its steps "
        "(reset once its model is built, where Linux allows), (imports) = its resident set after imports, before "
        "the model",
        f"total {result['seconds']:.0f} s",
    ])


def _mib(x):
    return "?" if x is None else f"{x:.0f} MiB"
