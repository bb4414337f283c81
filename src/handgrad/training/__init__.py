"""Training: the Trainer and its loop (trainer.py, loop.py, resume.py, rundir.py), one step's
arithmetic (step.py), AdamW (optim.py), data parallelism (distributed.py), the gpu's sync-free
step (device_loop.py), and the `handgrad train` command (command.py). The checkpoint format is
interop/checkpoint.py's."""
