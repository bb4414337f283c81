"""Numba's compilations in this process, as its event API reports them: "numba:compile" fires when a
kernel is compiled, not when Numba's cache (cache=True) loads it, so a warm cache counts nothing.
The commands read it to say when a step's or a reply's time includes compiling (`train`'s
"(compiling kernels)", `sample`'s report), and on a terminal a line says so while it happens."""
import sys
import time

from numba.core import event


class CompileWatch(event.Listener):
    """count: the kernels compiled so far (a kernel's callees included); seconds: the wall time
    spent in them (the outermost compile's, so nested ones are not counted twice)."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0
        self._depth, self._started = 0, 0.0
        self.notice = None  # a line shown on a terminal at the first compile (announce())

    def on_start(self, ev):
        if self._depth == 0:
            self._started = time.perf_counter()
            if self.notice is not None:
                _show(self.notice)
                self.notice = None
        self._depth += 1
        self.count += 1

    def on_end(self, ev):
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._started


_watch = None


def compile_watch():
    """The process's CompileWatch, listening from the first call on."""
    global _watch
    if _watch is None:
        _watch = CompileWatch()
        event.register("numba:compile", _watch)
    return _watch


def announce_compiles():
    """Show one line on stderr, on a terminal only (as the progress bars), when Numba first compiles
    a kernel from now on: a cold cache is 20-30 s of silence otherwise."""
    compile_watch().notice = "compiling kernels (once: Numba caches them for later runs) ..."


def _show(line):
    if sys.stderr.isatty():
        from tqdm import tqdm
        tqdm.write(line, file=sys.stderr)  # above a progress bar, if one is shown
