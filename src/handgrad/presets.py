"""The named run presets (`handgrad train --preset NAME`): model.* and train.* values as plain dicts,
applied by config.py's load_run_config on top of the defaults and checked as any other source."""


RUN_PRESETS = {
    "tiny": {"model": dict(n_layer=2, n_head=2, n_embd=64, block_size=64),
             "train": dict(batch_size=8, max_steps=200, lr=3e-3, min_lr=3e-4, warmup_steps=10,
                           eval_interval=50, sample_interval=100, checkpoint_interval=100)},
    # nanoGPT's config/train_shakespeare_char.py, sized for a CPU as nanoGPT's README suggests
    "shakespeare-char": {"model": dict(n_layer=4, n_head=4, n_embd=128, block_size=64),
                         "train": dict(batch_size=12, max_steps=2000, lr=1e-3, min_lr=1e-4, warmup_steps=100,
                                       weight_decay=0.1, beta2=0.99, grad_clip=1.0, eval_interval=250, eval_steps=20,
                                       sample_interval=500, checkpoint_interval=500)},
    # nanoGPT's config/train_shakespeare_char.py as it is (its GPU values: 6 x 384, block 256, batch 64,
    # dropout 0.2, 5000 iterations); eval_iters 200 there, 20 batches of 64 here
    "nanogpt-shakespeare-char": {"model": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2),
                                 "train": dict(batch_size=64, max_steps=5000, lr=1e-3, min_lr=1e-4, warmup_steps=100,
                                               weight_decay=0.1, beta1=0.9, beta2=0.99, grad_clip=1.0,
                                               eval_interval=250, eval_steps=20, log_interval=10,
                                               sample_interval=1000, checkpoint_interval=250)},
    "mid": {"model": dict(n_layer=6, n_head=8, n_embd=512, block_size=256),
            "train": dict(batch_size=8, max_steps=1000, lr=6e-4, min_lr=6e-5, warmup_steps=50,
                          eval_interval=100, sample_interval=500, checkpoint_interval=250)},
    "gpt2-124m": {"model": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
                  "train": dict(batch_size=4, grad_accum_steps=8, max_steps=5000, lr=6e-4, min_lr=6e-5, warmup_steps=200,
                                beta2=0.95, eval_interval=250, sample_interval=1000, checkpoint_interval=500)},
    # shakespeare-char's budget in a Llama: RMSNorm, RoPE, SwiGLU, 2 kv heads for 4 query heads
    "llama-char": {"model": dict(arch="llama", n_layer=4, n_head=4, n_kv_head=2, n_embd=128, ffn_hidden=384,
                                 block_size=64),
                   "train": dict(batch_size=12, max_steps=2000, lr=1e-3, min_lr=1e-4, warmup_steps=100,
                                 weight_decay=0.1, beta2=0.99, grad_clip=1.0, eval_interval=250, eval_steps=20,
                                 sample_interval=500, checkpoint_interval=500)},
    "llama-mid": {"model": dict(arch="llama", n_layer=6, n_embd=512, n_head=8, n_kv_head=2, ffn_hidden=1408,
                                block_size=256),
                  "train": dict(batch_size=8, max_steps=1000, lr=6e-4, min_lr=6e-5, warmup_steps=50,
                                eval_interval=100, sample_interval=500, checkpoint_interval=250)},
    # HuggingFaceTB/SmolLM2-135M's shape
    "smollm2-135m": {"model": dict(arch="llama", n_layer=30, n_embd=576, n_head=9, n_kv_head=3, ffn_hidden=1536,
                                   rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True, block_size=2048),
                     "train": dict(batch_size=1, grad_accum_steps=8, max_steps=1000, lr=3e-4, min_lr=3e-5,
                                   warmup_steps=50, beta2=0.95, eval_interval=100, sample_interval=500,
                                   checkpoint_interval=250)},
    # Qwen/Qwen2.5-0.5B's shape (q/k/v biases, tied, theta 1e6), trained at block 1024 (its context is 32768)
    "qwen2.5-0.5b": {"model": dict(arch="llama", n_layer=24, n_embd=896, n_head=14, n_kv_head=2, ffn_hidden=4864,
                                   qkv_bias=True, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True, block_size=1024),
                     "train": dict(batch_size=1, grad_accum_steps=8, max_steps=1000, lr=2e-4, min_lr=2e-5,
                                   warmup_steps=50, beta2=0.95, eval_interval=100, sample_interval=500,
                                   checkpoint_interval=250)},
}
# meta-llama/Llama-3.2-1B's shape (tied, theta 5e5, llama3 RoPE scaling, context 131072), trained as qwen2.5-0.5b
RUN_PRESETS["llama3.2-1b"] = {
    "model": dict(arch="llama", n_layer=16, n_embd=2048, n_head=32, n_kv_head=8, ffn_hidden=8192, rope_theta=500000.0,
                  norm_eps=1e-5, tie_embeddings=True, block_size=2048, rope_factor=32.0, rope_low_freq_factor=1.0,
                  rope_high_freq_factor=4.0, rope_original_max_position_embeddings=8192),
    "train": dict(RUN_PRESETS["qwen2.5-0.5b"]["train"])}
# meta-llama/Llama-3.2-3B's shape: the 1B's pattern, 28 layers 3072 wide, 24 heads on 8 kv heads
RUN_PRESETS["llama3.2-3b"] = {"model": dict(RUN_PRESETS["llama3.2-1b"]["model"], n_layer=28, n_embd=3072, n_head=24,
                                            n_kv_head=8),
                              "train": dict(RUN_PRESETS["qwen2.5-0.5b"]["train"])}
# Qwen/Qwen3-0.6B's shape (q/k norms, heads 128 wide where n_embd / n_head is 64, tied, theta 1e6, context
# 40960), trained as qwen2.5-0.5b; Qwen/Qwen3-1.7B's is the same but for its widths
RUN_PRESETS["qwen3-0.6b"] = {
    "model": dict(arch="llama", n_layer=28, n_embd=1024, n_head=16, n_kv_head=8, head_dim=128, ffn_hidden=3072,
                  qk_norm=True, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True, block_size=1024),
    "train": dict(RUN_PRESETS["qwen2.5-0.5b"]["train"])}
RUN_PRESETS["qwen3-1.7b"] = {"model": dict(RUN_PRESETS["qwen3-0.6b"]["model"], n_embd=2048, ffn_hidden=6144),
                             "train": dict(RUN_PRESETS["qwen2.5-0.5b"]["train"])}
# google/gemma-3-270m's shape (a 262,144-token vocabulary under 18 narrow layers; heads 256 wide, one kv head,
# local layers with a 512-token window, every sixth global; context 32768), trained at block 1024;
# google/gemma-3-1b-pt's is the same pattern at its widths and depth
RUN_PRESETS["gemma3-270m"] = {
    "model": dict(arch="gemma3", n_layer=18, n_embd=640, n_head=4, n_kv_head=1, head_dim=256, ffn_hidden=2048,
                  vocab_size=262144, rope_theta=1e6, rope_local_base_freq=10000.0, norm_eps=1e-6, sliding_window=512,
                  sliding_window_pattern=6, query_pre_attn_scalar=256.0, block_size=1024),
    "train": dict(RUN_PRESETS["qwen2.5-0.5b"]["train"])}
RUN_PRESETS["gemma3-1b"] = {"model": dict(RUN_PRESETS["gemma3-270m"]["model"], n_layer=26, n_embd=1152, ffn_hidden=6912),
                            "train": dict(RUN_PRESETS["qwen2.5-0.5b"]["train"])}
