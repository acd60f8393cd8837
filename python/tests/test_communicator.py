"""meshtrain.launch and the Communicator on numpy arrays (threads engine).

Closed-form results of every collective on 4 ranks, the asynchronous forms,
split, and the faults: a rank that raises, a rank that skips a collective,
mismatched collectives, and arrays the engines cannot take. No case may
hang: every launch has a short deadline.
"""

import resource
import time

import numpy as np
import pytest

import meshtrain

RANKS = 4


def run(fn, ranks=RANKS, timeout=30.0):
    return meshtrain.launch(fn, engine="threads", ranks=ranks, timeout=timeout)


def test_results_come_back_in_rank_order():
    assert run(lambda w: (w.rank, w.size)) == [(r, RANKS) for r in range(RANKS)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_all_reduce_sums_in_place(dtype):
    def fn(w):
        x = np.arange(6, dtype=dtype) + w.rank
        assert w.all_reduce(x) is None
        return x

    for x in run(fn):  # sum over r of (i + r) = 4 i + 6
        np.testing.assert_array_equal(x, 4 * np.arange(6) + 6)
        assert x.dtype == dtype


def test_all_reduce_ops():
    def fn(w):
        out = {}
        for op in ["max", "min", "prod", "avg"]:
            x = np.array([w.rank + 1.0, -(w.rank + 1.0)], dtype=np.float64)
            w.all_reduce(x, op=op)
            out[op] = x.tolist()
        return out

    for out in run(fn):
        assert out == {"max": [4.0, -1.0], "min": [1.0, -4.0], "prod": [24.0, 24.0], "avg": [2.5, -2.5]}


def test_all_gather_stacks_the_ranks():
    def fn(w):
        return w.all_gather(np.full((2, 3), w.rank, dtype=np.int64))

    for g in run(fn):
        assert g.shape == (RANKS, 2, 3)
        for r in range(RANKS):
            np.testing.assert_array_equal(g[r], np.full((2, 3), r))


def test_reduce_scatter_gives_each_rank_its_row():
    def fn(w):
        a = np.arange(RANKS * 2, dtype=np.float32).reshape(RANKS, 2) + w.rank
        return w.reduce_scatter(a)

    for r, got in enumerate(run(fn)):  # sum over ranks q of (2 r + j + q)
        np.testing.assert_array_equal(got, 4 * (2 * r + np.arange(2)) + 6)


def test_broadcast_from_a_root():
    def fn(w):
        x = np.full(5, w.rank, dtype=np.float32)
        w.broadcast(x, root=2)
        return x

    for x in run(fn):
        np.testing.assert_array_equal(x, np.full(5, 2.0))


def test_all_to_all_transposes_blocks():
    def fn(w):
        a = (w.rank * 10 + np.arange(RANKS, dtype=np.int32)).reshape(RANKS, 1)
        return w.all_to_all(a)

    for me, got in enumerate(run(fn)):  # block p of rank r lands at [r] on rank p
        np.testing.assert_array_equal(got[:, 0], np.arange(RANKS) * 10 + me)


def test_all_to_all_v_sends_uneven_rows():
    # Rank r sends p + r rows to rank p (rank 0 sends rank 0 nothing); row i
    # of the block to p holds (r, p, i).
    def fn(w):
        counts = [p + w.rank for p in range(w.size)]
        rows = [[w.rank, p, i] for p in range(w.size) for i in range(counts[p])]
        a = np.array(rows, dtype=np.int64).reshape(-1, 3)
        got = w.all_to_all_v(a, counts)  # receive counts exchanged first
        again = w.all_to_all_v(a, counts, recv_counts=[w.rank + r for r in range(w.size)], async_op=True).wait()
        np.testing.assert_array_equal(got, again)
        return got

    for me, got in enumerate(run(fn)):
        want = [[r, me, i] for r in range(RANKS) for i in range(me + r)]
        np.testing.assert_array_equal(got, np.array(want, dtype=np.int64).reshape(-1, 3))


def test_all_to_all_v_counts_that_disagree_raise_mismatch():
    def fn(w):
        recv = [1] * w.size
        if w.rank == 0:
            recv[1] = 2
        try:
            w.all_to_all_v(np.zeros((w.size, 2), dtype=np.float32), [1] * w.size, recv_counts=recv)
        except meshtrain.MismatchError as e:
            return str(e)
        return ""

    for got in run(fn):
        assert "rank 1 sends 2 elements to rank 0, which expects 4" in got, got  # rows of 2 values


def test_send_recv_around_a_ring_asynchronously():
    def fn(w):
        out = np.empty(3, dtype=np.float64)
        recv = w.recv(out, src=(w.rank - 1) % w.size, async_op=True)
        send = w.send(np.full(3, float(w.rank)), dst=(w.rank + 1) % w.size, async_op=True)
        send.wait()
        recv.wait()
        return out

    for r, x in enumerate(run(fn)):
        np.testing.assert_array_equal(x, np.full(3, float((r - 1) % RANKS)))


def test_async_collectives_return_work():
    def fn(w):
        x = np.ones(1000, dtype=np.float32)
        work = w.all_reduce(x, async_op=True)
        assert isinstance(work, meshtrain.Work)
        assert work.wait() is None
        gathered = w.all_gather(np.array([w.rank], dtype=np.int64), async_op=True).wait()
        w.barrier()
        return float(x[0]), gathered.tolist()

    for total, gathered in run(fn):
        assert total == RANKS
        assert gathered == [[r] for r in range(RANKS)]


def test_split_makes_subgroups():
    def fn(w):
        sub = w.split(color=w.rank % 2, key=w.rank)
        x = np.array([w.rank], dtype=np.int64)
        sub.all_reduce(x)
        none = w.split(color=-1)
        return sub.rank, sub.size, int(x[0]), none

    assert run(fn) == [(0, 2, 2, None), (0, 2, 4, None), (1, 2, 2, None), (1, 2, 4, None)]


def test_no_copy_an_all_reduce_of_256_mib_adds_no_peak_memory():
    def fn(w):
        x = np.ones(64 << 20, dtype=np.float32)  # 256 MiB on each rank, touched
        w.barrier()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        w.barrier()
        w.all_reduce(x)
        w.barrier()
        added_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        return added_mib, float(x[0]), float(x[-1])

    for added_mib, first, last in run(fn, ranks=2):
        assert (first, last) == (2.0, 2.0)
        assert added_mib < 16, added_mib


def test_out_is_written_and_returned():
    def fn(w):
        out = np.empty((w.size, 3), dtype=np.float64)
        got = w.all_gather(np.full(3, float(w.rank)), out=out)
        return got is out, out[:, 0].tolist()

    for same, column in run(fn):
        assert same and column == [0.0, 1.0, 2.0, 3.0]


# ---- faults ----


def test_a_rank_that_raises_ends_the_job_naming_it():
    def fn(w):
        if w.rank == 2:
            raise ValueError("boom on purpose")
        w.all_reduce(np.ones(4, dtype=np.float32))  # the others wait here: aborted, not hung

    start = time.monotonic()
    with pytest.raises(meshtrain.RankError) as info:
        run(fn, timeout=60.0)
    assert time.monotonic() - start < 30
    assert info.value.rank == 2
    assert "rank 2" in str(info.value) and "boom on purpose" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)


def test_a_skipped_collective_times_out_naming_the_rank():
    deadline = 1.0
    raised_after = {}

    def fn(w):
        if w.rank == 1:  # alive, but never calls the all_reduce
            time.sleep(3 * deadline)
            return
        start = time.monotonic()
        try:
            w.all_reduce(np.ones(4, dtype=np.float32))
        finally:
            raised_after[w.rank] = time.monotonic() - start

    with pytest.raises(meshtrain.RankError) as info:
        run(fn, timeout=deadline)
    cause = info.value.__cause__
    assert isinstance(cause, meshtrain.TimeoutError) and isinstance(cause, TimeoutError), repr(cause)
    assert "rank 1" in str(cause)
    assert sorted(raised_after) == [0, 2, 3]
    for rank, seconds in raised_after.items():  # every waiting rank, within 2x the deadline
        assert seconds < 2 * deadline, (rank, seconds)


def test_a_rank_that_returns_early_is_named_at_once():
    def fn(w):
        if w.rank != 1:
            w.all_reduce(np.ones(4, dtype=np.float32))

    start = time.monotonic()
    with pytest.raises(meshtrain.RankError) as info:
        run(fn, timeout=60.0)
    assert time.monotonic() - start < 10
    assert "rank 1 already returned from its function" in str(info.value)


def test_mismatched_collectives_give_the_fingerprint_error():
    def fn(w):
        x = np.ones(4, dtype=np.float32)
        if w.rank == 0:
            w.broadcast(x, root=0)
        else:
            w.all_reduce(x)

    with pytest.raises(meshtrain.RankError) as info:
        run(fn, ranks=2, timeout=10.0)
    cause = info.value.__cause__
    assert isinstance(cause, meshtrain.MismatchError), repr(cause)
    assert "broadcast" in str(cause) and "all_reduce" in str(cause)


def test_arrays_the_engines_cannot_take_are_refused_with_the_reason():
    def fn(w):
        errors = []
        for bad in [np.ones(4, dtype=np.complex64), np.ones(8, dtype=np.float32)[::2]]:
            with pytest.raises(meshtrain.InvalidArgument) as info:
                w.all_reduce(bad)
            errors.append(str(info.value))
        frozen = np.ones(4, dtype=np.float32)
        frozen.setflags(write=False)
        with pytest.raises(ValueError) as info:
            w.all_reduce(frozen)
        errors.append(str(info.value))
        with pytest.raises(ValueError) as info:
            w.reduce_scatter(np.ones((3, 2), dtype=np.float32))
        errors.append(str(info.value))
        return errors

    errors = run(fn, ranks=2)[0]
    assert "dtype complex64" in errors[0] and "float32" in errors[0]
    assert "not C-contiguous" in errors[1]
    assert "read-only" in errors[2]
    assert "(3, 2) for 2 ranks" in errors[3]


def test_every_way_of_calling_all_reduce_means_the_same():
    # all_reduce's common forms take a path without pybind11's dispatch; the
    # others (async_op=True, bad arguments) the bound method: same results, same errors.
    def fn(w):
        out = []
        for call in [lambda x: w.all_reduce(x), lambda x: w.all_reduce(x, "max"), lambda x: w.all_reduce(x, op="max"),
                     lambda x: w.all_reduce(array=x, op="min", async_op=False),
                     lambda x: w.all_reduce(x, "avg", True).wait()]:
            x = np.array([w.rank + 1.0, 10.0], dtype=np.float64)
            assert call(x) is None
            out.append(x.tolist())
        errors = []
        for bad in [lambda: w.all_reduce(np.ones(2), "median"), lambda: w.all_reduce(np.ones(2), 3),
                    lambda: w.all_reduce([1.0, 2.0]), lambda: w.all_reduce(np.ones(2), op="sum", nope=1),
                    lambda: w.all_reduce()]:
            with pytest.raises((ValueError, TypeError)) as info:
                bad()
            errors.append(f"{type(info.value).__name__}: {info.value}")
        return out, errors

    (out, errors), _ = run(fn, ranks=2)
    assert out == [[3.0, 20.0], [2.0, 10.0], [2.0, 10.0], [1.0, 10.0], [1.5, 10.0]]
    assert "median" in errors[0] and errors[0].startswith("InvalidArgument")
    assert all(e.startswith("TypeError") for e in errors[1:]), errors


def test_a_communicator_outliving_its_launch_raises():
    kept = run(lambda w: w, ranks=1)[0]
    with pytest.raises(meshtrain.InvalidArgument, match="after its job ended"):
        kept.barrier()
    with pytest.raises(meshtrain.InvalidArgument, match="after its job ended"):
        kept.all_reduce(np.ones(2))


def test_bad_launch_arguments():
    with pytest.raises(meshtrain.InvalidArgument, match="engine"):
        meshtrain.launch(lambda w: None, engine="carrier-pigeon", ranks=2)
    with pytest.raises(ValueError, match="timeout"):
        meshtrain.launch(lambda w: None, ranks=2, timeout=0)
