#!/usr/bin/env python3
"""Schedule sketch of sparse_mla_producer's chunk loop (docs/sparse_mla.md, "v13").

Each warpgroup runs a program of steps in order: waits on named events,
signals, local work (the softmax, the producer's conversion), and tensor-core
groups it issues asynchronously and later waits for. The tensor cores take the
groups one at a time, in issue order. The step durations (us) come from the
clock64 trace of the H200 (docs/runs/sparse_mla_producer_trace_9b86be5.txt);
barrier latencies are left out (an issue costs its warpgroup 0.02 us), so
the periods come out ~0.2 us below the trace's. The programs keep only the
waits that order the chunk loop (warpgroup 1's wait for the first S and
warpgroup 0's for p_free are left out: they never hold it up). It compares the kernel's schedule (v13.1) with FlashMLA's seesaw
(branch sparse-mla-producer-seesaw), with S split by entries across the two
consumers (not built; half the softmax each, +0.05 us for the exchanges),
and the seesaw with tiles converted and released by halves (not built), all
with the same two tile slots.

Usage: python3 scripts/producer_schedule_sim.py
"""

CHUNKS = 32
MEASURED = dict(S=0.71, PV=0.45, softmax=0.78, convert=0.81)


def release_count(event):
    """Arrivals an event needs: a whole tile's release both consumers'; with
    tiles by halves, the half the other consumer's P V reads two (the
    owner's S and that P V), the owner's own half one."""
    if event.startswith("free"):
        return 2
    if event.startswith("left_free"):
        return 2 if int(event[len("left_free"):]) % 2 == 1 else 1
    if event.startswith("right_free"):
        return 2 if int(event[len("right_free"):]) % 2 == 0 else 1
    return 1


def run(programs, durations):
    """Runs the programs (warpgroup -> step generator); returns event -> times."""
    clock = {w: 0.0 for w in programs}
    events, in_flight, tensor_free = {}, {w: [] for w in programs}, 0.0
    steps = {w: iter(programs[w]) for w in programs}
    current = {w: next(steps[w], None) for w in programs}

    def ready_at(w):
        kind, *args = current[w]
        if kind != "wait":
            return clock[w]
        need = release_count(args[0])
        times = events.get(args[0], [])
        return max(clock[w], max(times[:need])) if len(times) >= need else None

    while True:  # the runnable warpgroup with the earliest clock takes its next step
        runnable = [(ready_at(w), w) for w in programs if current[w] is not None]
        runnable = [(t, w) for t, w in runnable if t is not None]
        if not runnable:
            break
        when, w = min(runnable)
        kind, *args = current[w]
        clock[w] = when
        if kind == "signal":
            events.setdefault(args[0], []).append(when)
        elif kind == "work":
            clock[w] += durations[args[0]]
        elif kind == "issue":
            tensor_free = max(when, tensor_free) + durations[args[0]]
            in_flight[w].append(tensor_free)
            clock[w] += 0.02
        elif kind == "wait_groups":  # wgmma.wait_group<keep>
            keep = args[0]
            done = in_flight[w][: len(in_flight[w]) - keep]
            if done:
                clock[w] = max(clock[w], max(done))
            in_flight[w] = in_flight[w][len(in_flight[w]) - keep :]
        current[w] = next(steps[w], None)
    stuck = [w for w in programs if current[w] is not None]
    assert not stuck, f"deadlock: warpgroups {stuck}"
    return events


def producer(by_halves=False):
    """Converts chunk n into chunk n - 2's slot once released: the whole tile,
    or by halves (the left half's events prefixed left_, the right's right_;
    "ready{n}" announces the last part)."""
    parts = (("left_", "left_ready"), ("right_", "ready")) if by_halves else (("", "ready"),)
    for n in range(CHUNKS):
        for prefix, ready in parts:
            if n >= 2:
                yield ("wait", f"{prefix}free{n - 2}")
            yield ("work", "convert_half" if by_halves else "convert")
            yield ("signal", f"{ready}{n}")


def v13():
    def softmax_warpgroup():
        for n in range(CHUNKS):
            yield ("wait", f"ready{n}")
            yield ("issue", "S")
            yield ("wait_groups", 0)
            yield ("signal", f"scores{n}")
            yield ("work", "softmax")
            yield ("signal", f"p{n}")
            yield ("issue", "PV")
            yield ("wait_groups", 0)
            yield ("signal", f"free{n}")

    def right_warpgroup():
        for n in range(CHUNKS):
            yield ("wait", f"p{n}")
            if n + 1 < CHUNKS:
                yield ("wait", f"scores{n + 1}")
            yield ("issue", "PV")
            yield ("wait_groups", 0)
            yield ("signal", f"free{n}")

    return {0: softmax_warpgroup(), 1: right_warpgroup(), 2: producer()}


def seesaw(by_halves=False):
    """FlashMLA's seesaw: consumer w owns the chunks n % 2 == w (S, softmax,
    P) and runs its half of O over every chunk. By halves: the tiles are
    converted and released by halves, dims 0..255 read by S and consumer 0's
    P V, dims 256..511 by S and consumer 1's."""
    def consumer(w):
        mine, others = ("left_", "right_") if w == 0 else ("right_", "left_")
        if not by_halves:
            mine = others = ""
        for n in range(w, CHUNKS, 2):
            yield ("wait_groups", 0)
            if n >= 2:
                yield ("signal", f"{mine}free{n - 2}")
            if by_halves:
                yield ("wait", f"left_ready{n}")
                yield ("issue", "S_half")
                yield ("wait", f"ready{n}")
                yield ("issue", "S_half")
                yield ("wait_groups", 0)
                yield ("signal", f"{others}free{n}")  # S: this consumer's last read of that half
            else:
                yield ("wait", f"ready{n}")
                yield ("issue", "S")
                yield ("wait_groups", 0)
            if n >= 1:
                yield ("wait", f"p{n - 1}")
                yield ("issue", "PV")
            yield ("work", "softmax")
            yield ("signal", f"p{n}")
            if n >= 1:
                yield ("wait_groups", 0)
                yield ("signal", f"{mine}free{n - 1}")
            yield ("issue", "PV")
        yield ("wait_groups", 0)
        last = CHUNKS - 1
        if last % 2 != w:
            yield ("wait", f"p{last}")
            yield ("issue", "PV")
            yield ("wait_groups", 0)
            yield ("signal", f"{mine}free{last}")

    return {0: consumer(0), 1: consumer(1), 2: producer(by_halves)}


def split_scores():
    """Each consumer computes S of half the chunk's entries (m64n32), the two
    exchange the row max and then P through shared memory, and each runs its
    half of O over all 64 entries: the softmax split in two."""
    def consumer(w):
        for n in range(CHUNKS):
            yield ("wait", f"ready{n}")
            yield ("issue", "S_half")
            yield ("wait_groups", 0)
            yield ("signal", f"max{n}_{w}")
            yield ("wait", f"max{n}_{1 - w}")
            yield ("work", "softmax_half")
            yield ("signal", f"p{n}_{w}")
            yield ("wait", f"p{n}_{1 - w}")
            yield ("issue", "PV")
            yield ("wait_groups", 0)
            yield ("signal", f"free{n}")

    return {0: consumer(0), 1: consumer(1), 2: producer()}


def period(events):
    ready = [events[f"ready{n}"][0] for n in range(CHUNKS)]
    return (ready[-1] - ready[4]) / (CHUNKS - 5)


if __name__ == "__main__":
    cases = [
        ("as traced", {}),
        ("conversion 0.40", dict(convert=0.40)),
        ("softmax 0.40", dict(softmax=0.40)),
        ("conversion and softmax 0.40", dict(convert=0.40, softmax=0.40)),
        ("S and P V at the tensor rate", dict(S=0.57, PV=0.29)),
    ]
    print(f"{'durations':32s} {'v13.1':>8s} {'seesaw':>8s} {'split S':>8s} {'seesaw/2':>8s}   (us a chunk)")
    for label, change in cases:
        durations = dict(MEASURED, **change)
        durations.update(S_half=durations["S"] / 2, softmax_half=durations["softmax"] / 2 + 0.05,
                         convert_half=durations["convert"] / 2)
        print(f"{label:32s} {period(run(v13(), durations)):8.2f} {period(run(seesaw(), durations)):8.2f} "
              f"{period(run(split_scores(), durations)):8.2f} {period(run(seesaw(by_halves=True), durations)):8.2f}")
