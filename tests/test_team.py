"""backends/cpu/team.py: a team of threads in one parallel region, meeting at barriers. What one
member writes before a barrier every member reads after it; an iteration left waiting for a member
that never comes runs alone (SOLO) and the late one leaves, so a region never hangs."""
import numba
import numpy as np
from numba import njit, prange

from handgrad.backends.cpu.team import LEAVE, SOLO, SYNC_SLOTS, TEAM, barrier, part, team_start


@njit(parallel=True)
def _rounds(sync, out, roles):
    """Round r: member me writes the columns me, me + team, ...: each the sum of the row before
    (written by every member) plus its column; a barrier after each round."""
    T = np.int64(numba.get_num_threads())
    for t in prange(T):
        role = team_start(sync, T)
        roles[t] = role
        if role != LEAVE:
            me, team = np.int64(0), np.int64(1)
            if role == TEAM:
                me, team = np.int64(t), T
            _member_rounds(out, me, team, sync)


@njit
def _member_rounds(out, me, team, sync):
    R, N = out.shape
    for r in range(R):
        before = 0.0
        if r > 0:
            for i in range(N):
                before += out[r - 1, i]
        for i in range(me, N, team):
            out[r, i] = before + i
        barrier(sync, team)


def _expected(R, N):
    out = np.zeros((R, N))
    for r in range(R):
        out[r] = (out[r - 1].sum() if r else 0.0) + np.arange(N)
    return out


def test_members_see_each_others_writes_after_a_barrier():
    sync, roles = np.zeros(SYNC_SLOTS, np.int64), np.zeros(numba.get_num_threads(), np.int64)
    for R in (1, 50, 2000):
        sync[:] = 0
        out = np.zeros((R, 7))
        _rounds(sync, out, roles)
        np.testing.assert_array_equal(out, _expected(R, 7))
    assert set(roles) == ({TEAM} if len(roles) > 1 else {SOLO})


def test_a_lone_iteration_goes_on_alone_and_a_late_one_leaves():
    """team_start called from one thread for a team of 2: the first polls its limit out and runs
    SOLO; the second, arriving after, leaves. A team of 1 is SOLO at once."""
    sync = np.zeros(SYNC_SLOTS, np.int64)
    assert team_start(sync, 2, 1000) == SOLO
    assert team_start(sync, 2, 1000) == LEAVE
    sync[:] = 0
    assert team_start(sync, 1) == SOLO


def test_shares_are_whole_steps_and_cover_the_range():
    for n in (0, 1, 3, 4, 576, 961):
        for team in (1, 2, 3):
            spans = [part(n, me, team, 4) for me in range(team)]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert all(lo == hi or (lo % 4 == 0 and (hi % 4 == 0 or hi == n)) for lo, hi in spans)
