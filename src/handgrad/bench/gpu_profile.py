"""`handgrad bench train --device gpu --profile`: a training step's time by llm.c's groups of kernels
(encoder, layernorm, matmul, attention, GELU, residual, classifier, AdamW), for handgrad's step and
the torch sides', so a gap between two sides shows which part of the step it lies in.

On CUDA the kernels are the device's own: a few steps of a side under torch.profiler (CUDA activity
only), each kernel's self device time summed into the group its name falls in (GROUPS: handgrad's
Triton kernels, cuBLAS's, torch.compile's fused Triton kernels and eager torch's are all named so).
Under TRITON_INTERPRET=1 there are no kernels: handgrad's step is timed op by op on the host
(bench/profile.py's Profiler over the model's ops), each op in the group its name falls in, the
interpreter's stand-in, whose times measure the interpreter; the torch sides are not profiled there.
"""
from collections import defaultdict

from .profile import Profiler

# llm.c's groups, tried in this order against a kernel's (or op's) lower-cased name: the first group
# one of whose words it contains. Order matters: a fused "add + layer_norm" kernel is a layernorm's,
# a log_softmax the classifier's, and the norms' words come before the optimizer's "norm" (the global
# gradient norm's kernels).
GROUPS = (
    ("classifier", ("crossentropy", "cross_entropy", "softcap", "nll_loss", "log_softmax", "mean_loss",
                    "count_valid")),
    ("attention", ("attention", "attn", "flash", "fmha", "gqa", "sdpa", "rope")),
    ("layernorm", ("layernorm", "layer_norm", "rmsnorm", "rms_norm")),
    ("gelu", ("gelu", "swiglu", "geglu", "silu")),
    ("adamw", ("adamw", "adam", "sumsq", "sqrt_sum", "global_norm", "prepare_update", "multi_tensor", "foreach",
               "clip_grad", "norm")),
    ("matmul", ("gemm", "cutlass", "xmma", "cublas", "nvjet", "matmul", "addmm", "linear", "partials", "splitk")),
    ("encoder", ("encoder", "embedding", "embed", "index_select")),
    ("residual", ("residual", "add")),
)
STEPS = 3  # profiled steps per side, after the timed ones


def group_of(name):
    """The llm.c group of a kernel or op name ("other" where none of GROUPS' words is in it)."""
    low = name.lower()
    return next((group for group, words in GROUPS if any(w in low for w in words)), "other")


def profile_cuda(side, batches, torch, steps=STEPS):
    """{group: ms per step} of `side` (bench/train_gpu.py's, with step(batch) and losses()) over `steps`
    steps under torch.profiler, and {kernel name: ms per step} of the ten costliest kernels."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            side.step(batches[i % len(batches)])
        torch.cuda.synchronize()
    side.losses()
    kernels = defaultdict(float)
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = getattr(e, "self_cuda_time_total", 0.0) if us is None else us
        if us > 0:
            kernels[e.key] += us / 1e3 / steps
    return _grouped("kernels (torch.profiler)", kernels)


def profile_ops(side, batches, clock, steps=STEPS):
    """{group: ms per step} of handgrad's `side` timed op by op on the host (the interpreter's stand-in
    for kernels), the model's and its device loop's ops wrapped in a Profiler for `steps` steps."""
    model, loop = side.model, side.loop
    ops = model.ops
    prof = Profiler(ops)
    model.ops = loop.ops = prof
    try:
        for i in range(steps):
            clock.wall(lambda: side.step(batches[i % len(batches)]))
        side.losses()
    finally:
        model.ops = loop.ops = ops
    return _grouped("ops timed on the host (the interpreter)", {op: s * 1e3 / steps for op, s in prof.seconds.items()})


def _grouped(how, ms):
    """The profile of {kernel or op name: ms per step}: its groups' sums and the ten costliest names."""
    groups = defaultdict(float)
    for name, t in ms.items():
        groups[group_of(name)] += t
    return {"how": how, "groups": dict(groups), "top": dict(sorted(ms.items(), key=lambda kv: -kv[1])[:10])}


def format_profiles(profiles):
    """The groups side by side, ms per step, in llm.c's order."""
    if not profiles:
        return ""
    names = list(profiles)
    order = [g for g, _ in GROUPS] + ["other"]
    lines = [f"  profile ({'; '.join(sorted({p['how'] for p in profiles.values()}))}), ms per step:",
             "    " + f"{'group':<11}" + "".join(f"{n:>10}" for n in names)]
    for g in order:
        if any(g in p["groups"] for p in profiles.values()):
            lines.append("    " + f"{g:<11}" + "".join(f"{profiles[n]['groups'].get(g, 0.0):>10.2f}" for n in names))
    lines.append("    " + f"{'all':<11}" + "".join(f"{sum(profiles[n]['groups'].values()):>10.2f}" for n in names))
    return "\n".join(lines)
