"""A team of threads inside one parallel region, meeting at barriers: for work that is a long chain
of short parallel steps (a decode step's 120 products, each 5-60 us), where opening a parallel
region per step costs a fork and a join each time and every step's memory stream starts cold.

Numba's prange has no barrier and no atomics, so both are here: a few atomic operations on an int64
array (`sync`, SYNC_SLOTS long, zeroed before each region) written in LLVM IR through Numba
intrinsics, and on them `team_start` (who forms the team) and `barrier`. The one non-obvious
danger is a region run serially, where a thread waiting for an iteration queued behind it on the
same thread would wait forever: team_start bounds that wait and lets one iteration do all the work."""
import platform

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

COUNT, GEN, MODE, ARRIVED = 0, 8, 16, 24  # sync's slots, a cache line (8 int64) apart
SYNC_SLOTS = 32
TEAM, SOLO, LEAVE = 1, 2, 3
SPIN_LIMIT = 1 << 26  # polls before the first arrival goes on alone (1.6 s on the 2-core Zen 5)
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _typed(ret, emit, arr, *rest):
    """The typing and the code of an atomic operation on the int64 arr[i] (rest: i, then its
    operands): emit(builder, pointer, *operands as int64) gives its result (None: void)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        i = context.cast(builder, args[1], sig.args[1], types.intp)
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [i], wraparound=False)
        out = emit(builder, ptr, *(context.cast(builder, a, t, types.int64) for a, t in zip(args[2:], sig.args[2:])))
        return context.get_dummy_value() if out is None else out
    return ret(arr, *rest), codegen


def _atomic(ret, operands, emit, doc):
    """An intrinsic op(arr, i, *operands), `operands` 0, 1 or 2 of them (an intrinsic's arguments
    are named: no *args)."""
    if operands == 0:
        def op(typingctx, arr, i):
            return _typed(ret, emit, arr, i)
    elif operands == 1:
        def op(typingctx, arr, i, v):
            return _typed(ret, emit, arr, i, v)
    else:
        def op(typingctx, arr, i, expected, v):
            return _typed(ret, emit, arr, i, expected, v)
    op.__doc__ = doc
    return intrinsic(op)


atomic_add = _atomic(types.int64, 1, lambda b, p, v: b.atomic_rmw("add", p, v, "seq_cst"),
                     "arr[i] += v atomically; returns the value before.")
atomic_load = _atomic(types.int64, 0, lambda b, p: b.load_atomic(p, "seq_cst", 8), "arr[i], read atomically.")
atomic_store = _atomic(types.void, 1, lambda b, p, v: b.store_atomic(v, p, "seq_cst", 8), "arr[i] = v atomically.")
atomic_cas = _atomic(types.int64, 2, lambda b, p, e, v: b.extract_value(b.cmpxchg(p, e, v, "seq_cst", "seq_cst"), 0),
                     "arr[i] = v if arr[i] == expected, atomically; returns the value arr[i] held.")


@intrinsic
def spin_pause(typingctx):
    """The x86 `pause` hint inside a polling loop (nothing elsewhere)."""
    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@njit(cache=True)
def team_start(sync, T, limit=SPIN_LIMIT):
    """This iteration's part in a region of T: TEAM, SOLO or LEAVE; called once by each of the
    region's T iterations (`for t in prange(T)`, T = numba.get_num_threads()).

    Numba hands each thread one iteration, so the T normally run at once and form a team (TEAM).
    Should one iteration wait for another that runs only after it on the same thread (a parallel
    region run serially), waiting would never end: so the first to arrive polls at most `limit`
    times for the rest, then claims the region for itself alone (SOLO: it does every thread's part)
    and the others, arriving, leave (LEAVE). The choice is one compare-and-swap, so exactly one of
    TEAM and SOLO is taken."""
    if T == 1:
        return SOLO
    if atomic_add(sync, ARRIVED, 1) == T - 1:  # the last to arrive: every iteration is running
        return TEAM if atomic_cas(sync, MODE, 0, TEAM) == 0 else LEAVE
    for _ in range(limit):
        mode = atomic_load(sync, MODE)
        if mode != 0:
            return TEAM if mode == TEAM else LEAVE
        spin_pause()
    mode = atomic_cas(sync, MODE, 0, SOLO)
    return SOLO if mode == 0 else (TEAM if mode == TEAM else LEAVE)


@njit(cache=True)
def barrier(sync, team):
    """Wait until all `team` members have called it (returns at once for a team of one): a counter
    and a generation, the last to arrive resetting the counter, then advancing the generation the
    others poll. Its atomics are sequentially consistent, so what a member wrote before it is seen
    by every member after it."""
    if team == 1:
        return
    gen = atomic_load(sync, GEN)
    if atomic_add(sync, COUNT, 1) == team - 1:
        atomic_store(sync, COUNT, 0)
        atomic_add(sync, GEN, 1)
    else:
        while atomic_load(sync, GEN) == gen:
            spin_pause()


@njit(cache=True)
def part(n, me, team, step):
    """[lo, hi): member me's share of range(n) among `team` members, each a whole number of `step`s
    (the last may end short, at n), so no step is split between two members."""
    per = -(-n // (team * step)) * step
    return min(n, me * per), min(n, (me + 1) * per)
