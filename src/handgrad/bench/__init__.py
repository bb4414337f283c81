"""Benchmarks, handgrad beside PyTorch in the same run: ops (ops.py; gpu.py on the gpu backend),
whole training steps (train.py), loss curves (learn.py); `handgrad bench` is command.py."""
