"""Balanced steps: the order in which packs reach (optimizer step, DP rank, micro-batch), chosen so that every
rank of a step carries about the same cost (``packing.cost``) and none waits on another at the gradient
all-reduce.

The trainer reads an epoch's packs as one stream in ``pack_id`` order (``pretrain.data.iter_batches``; later
epochs: **Epochs** below): micro-batch ``k`` is stream positions ``[k·mb, (k+1)·mb)``, it goes to DP rank
``k mod dp``, and a rank runs ``grad_accum`` micro-batches a step. So a step is ``G = dp·grad_accum·mb``
consecutive positions, and the rank of position ``p`` inside its step is ``(p mod G) // mb mod dp``. ``order``
permutes the packs so that this fixed layout is balanced; ``pack`` writes the packs in that order (``pack_id`` =
stream position), so the trainer's data position — the packs consumed, restored from the checkpoint — stays
exact on resume.

Per window of ``window`` steps (``W·G`` consecutive packs of the seeded shuffle ``binpack.bin_permutation``
made): the ``W·dp`` (step, rank) slots each take ``k = grad_accum·mb`` packs by a multiway partition with
equal cardinality — ``lpt``: rounds of the next ``W·dp`` largest packs, the largest to the least-loaded slot;
``kk``: Karmarkar–Karp's largest differencing on ``W·dp``-tuples — then slots sorted by load are cut into
steps of ``dp``, and the steps of the window, the ranks of a step and the micro-batches of a rank are put in a
seeded order. A pack moves at most one window from where the shuffle put it, so the run-scale mix of sources
and lengths is the shuffle's; within a window steps group by cost. The last ``n mod G`` packs (a partial step)
keep the shuffle's order. Measured (``bench/bench_balance.py``, ``docs/balance.md``): straggler loss at DP 64
on a realistic 1M-sample mix from 21.3% to 0.87% with one pack per rank and step (window 32), and from 12.2% to
0.01% with four (``kk``; ``lpt`` 0.05%); ordering 150K packs takes ~3 s (``kk``) on a loaded 2-core machine.

**Epochs.** ``order`` balances one epoch: ``W = n // G`` whole groups of ``G`` packs, then ``r = n mod G``
leftover packs. A run of several epochs reads the *balanced stream* (``stream_packs``), whole groups only:
every epoch reads its ``W`` groups in ``pack_id`` order, and the leftover packs queue up epoch after epoch;
once ``G`` visits are queued (after epoch ``e`` where ``⌊(e+1)·r/G⌋`` grows) they make one more group, the
last of that epoch (a pack twice in it where ``r < G``). So epoch ``e`` is groups ``[⌊e·n/G⌋, ⌊(e+1)·n/G⌋)``
of the stream and no step of any epoch straddles two groups; after epoch ``E`` a grouped pack was read ``E``
times and a leftover one ``E`` or fewer (it waits in the queue); a position is a pure function of ``(n, G)``,
so the data position (packs consumed) stays exact on resume, at any layout. A carried group is one
unbalanced step in ``W`` once every ``G / r`` epochs (``docs/balance.md``: why carried, not dropped or
re-balanced). ``G`` is the layout the pack step balanced for (``balanced_group``; 1 without ``balance_dp``:
the plain repetition). ``run_straggler_loss`` is the figure over a run's steps of that stream.

``straggler_loss``: mean over whole steps of (slowest rank's cost ÷ mean rank's cost − 1), from the
manifest alone. The order is a property of the costs, ``dp``, ``mb``, ``grad_accum``, ``window`` and the
seed: ``O(n log n)``, deterministic, computed once in ``pack``'s reduce, so it is the same for any task count.
"""
from __future__ import annotations

import heapq

import numpy as np

METHODS = ("lpt", "kk")


def step_rank(n: int, dp: int, micro_batch: int = 1, grad_accum: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(step, DP rank) of stream positions ``0..n-1`` under the trainer's layout (``pretrain.data``)."""
    p = np.arange(n, dtype=np.int64)
    G = dp * micro_batch * grad_accum
    return p // G, (p % G) // micro_batch % dp


def rank_costs(cost: np.ndarray, dp: int, micro_batch: int = 1, grad_accum: int = 1) -> np.ndarray:
    """``[steps, dp]``: each rank's summed cost per whole step of the stream ``cost`` (pack_id order)."""
    cost = np.asarray(cost, np.float64)
    G = dp * micro_batch * grad_accum
    steps = len(cost) // G
    # position s·G + (j·dp + r)·mb + i is micro-batch j of rank r in step s (``step_rank``), so a reshape sums it
    return cost[:steps * G].reshape(steps, grad_accum, dp, micro_batch).sum(axis=(1, 3))


def straggler_loss(cost: np.ndarray, dp: int, micro_batch: int = 1, grad_accum: int = 1) -> float | None:
    """Mean over whole steps of max/mean rank cost − 1 (0: no rank waits); None when no whole step."""
    rc = rank_costs(cost, dp, micro_batch, grad_accum)
    if not len(rc):
        return None
    mean = rc.mean(axis=1)
    ok = mean > 0
    return float(np.mean(rc.max(axis=1)[ok] / mean[ok] - 1)) if ok.any() else 0.0


def _lpt(cost: np.ndarray, bins: int, k: int) -> np.ndarray:
    """Slot of each pack (``len(cost) = bins·k``): in rounds, the next ``bins`` largest packs, the largest to
    the least-loaded slot — every slot takes exactly ``k``."""
    order = np.lexsort((np.arange(len(cost)), -cost))
    slot = np.empty(len(cost), np.int64)
    load = np.zeros(bins)
    for j in range(k):
        take = order[j * bins:(j + 1) * bins]
        emptiest = np.lexsort((np.arange(bins), load))
        slot[take] = emptiest
        load[emptiest] += cost[take]
    return slot


def _kk(cost: np.ndarray, bins: int, k: int) -> np.ndarray:
    """Slot of each pack by Karmarkar–Karp's largest differencing with equal cardinality: every round of
    ``bins`` packs (sorted) is a ``bins``-tuple of subsets; the two tuples of largest spread merge, the
    largest subset of one with the smallest of the other, until one tuple is left."""
    order = np.lexsort((np.arange(len(cost)), -cost))
    heap = []
    for j in range(k):
        take = order[j * bins:(j + 1) * bins]                      # descending
        sums = cost[take]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), j, sums.copy(), [[int(t)] for t in take]))
    uid = k
    while len(heap) > 1:
        _, _, sa, ma = heapq.heappop(heap)
        _, _, sb, mb = heapq.heappop(heap)
        ia, ib = np.argsort(-sa, kind="stable"), np.argsort(sb, kind="stable")
        sums = sa[ia] + sb[ib]
        members = [ma[x] + mb[y] for x, y in zip(ia, ib)]
        o = np.argsort(-sums, kind="stable")
        sums, members = sums[o], [members[x] for x in o]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), uid, sums, members))
        uid += 1
    slot = np.empty(len(cost), np.int64)
    for s, m in enumerate(heap[0][3] if heap else []):
        slot[m] = s
    return slot


def order(cost: np.ndarray, dp: int, micro_batch: int = 1, grad_accum: int = 1, window: int = 32,
          seed: int = 0, method: str = "kk") -> np.ndarray:
    """The balanced stream: ``perm`` such that position ``p`` holds pack ``perm[p]`` of ``cost``'s order."""
    if method not in METHODS:
        raise ValueError(f"balance method must be one of {list(METHODS)}, got {method!r}")
    if min(dp, micro_batch, grad_accum, window) < 1:
        raise ValueError(f"dp, micro_batch, grad_accum and window must be >= 1, got "
                         f"{(dp, micro_batch, grad_accum, window)}")
    cost = np.asarray(cost, np.float64)
    n = len(cost)
    k, G = micro_batch * grad_accum, dp * micro_batch * grad_accum
    perm = np.arange(n, dtype=np.int64)
    rng = np.random.default_rng(np.random.SeedSequence([seed, dp, micro_batch, grad_accum, window]))
    solve = _lpt if method == "lpt" else _kk
    whole = n // G
    for w0 in range(0, whole, window):
        steps = min(window, whole - w0)
        lo = w0 * G
        c = cost[lo:lo + steps * G]
        bins = steps * dp
        slot = solve(c, bins, k)
        load = np.bincount(slot, weights=c, minlength=bins)
        by_load = np.lexsort((np.arange(bins), load))               # slots of similar load side by side
        step_of_slot = np.empty(bins, np.int64)
        step_of_slot[by_load] = np.arange(bins) // dp
        step_order = rng.permutation(steps)                          # the window's steps in a seeded order
        rank_of_slot = np.empty(bins, np.int64)
        for s in range(steps):                                       # and a step's ranks
            rank_of_slot[by_load[s * dp:(s + 1) * dp]] = rng.permutation(dp)
        # inside a (step, rank) slot: its k packs in a seeded order → (micro-batch j, place i)
        within = np.empty(len(c), np.int64)
        o = np.lexsort((rng.random(len(c)), slot))
        within[o] = np.arange(len(c)) - np.repeat(np.arange(bins) * k, k)
        j, i = within // micro_batch, within % micro_batch
        pos = step_order[step_of_slot[slot]] * G + (j * dp + rank_of_slot[slot]) * micro_batch + i
        perm[lo + pos] = lo + np.arange(len(c))
    return perm


def displacement_steps(perm: np.ndarray, dp: int, micro_batch: int = 1, grad_accum: int = 1) -> int:
    """The most steps any pack moved from its place in the shuffle (``order``'s bound: one window)."""
    G = dp * micro_batch * grad_accum
    p = np.arange(len(perm))
    return int(np.abs(p // G - np.asarray(perm) // G).max(initial=0))


def pack_costs(files) -> np.ndarray | None:
    """The ``cost`` column of a pack step's ``packs`` parts (``files``, in path order: pack_id order), or None
    where it is undefined: no parts, a manifest written before costs, or a pack without one (NaN)."""
    import pyarrow.parquet as pq

    if not files or "cost" not in pq.read_schema(files[0]).names:
        return None
    cost = np.concatenate([pq.read_table(f, columns=["cost"]).column("cost").to_numpy(zero_copy_only=False)
                           for f in files]).astype(np.float64)
    return None if np.isnan(cost).any() else cost


def balanced_group(cfg) -> int:
    """The packs of one balanced group under a pack step's config (its dataclass or its ``config.json`` as a
    dict): ``balance_dp × balance_micro_batch × balance_grad_accum``, 1 without ``balance_dp`` (or no config)."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    dp = int(get("balance_dp", 0) or 0)
    return dp * int(get("balance_micro_batch", 1) or 1) * int(get("balance_grad_accum", 1) or 1) if dp else 1


def stream_index_sql(q: str, n: int, group: int) -> str:
    """``stream_packs`` as a SQL expression of the position ``q`` (an integer column), for DuckDB."""
    whole, r = n // group, n % group
    g, o = f"({q} // {group})", f"({q} % {group})"
    e = f"((({g} + 1) * {group} - 1) // {n})"
    j = f"({g} - {e} * {n} // {group})"
    return (f"CASE WHEN {j} < {whole} THEN {j} * {group} + {o} "
            f"ELSE {whole * group} + (({e} * {r} // {group} + {j} - {whole}) * {group} + {o}) % {max(r, 1)} END")


def epoch_start(e, n: int, group: int):
    """The first group of epoch ``e`` in the balanced stream: ``⌊e·n/group⌋`` (``e`` an int or an array)."""
    return np.asarray(e, np.int64) * n // group


def epoch_of(q, n: int, group: int):
    """The epoch of balanced-stream position ``q``: the largest ``e`` with ``⌊e·n/group⌋ <= q // group``."""
    return ((np.asarray(q, np.int64) // group + 1) * group - 1) // n


def stream_packs(n: int, group: int, start: int, count: int) -> np.ndarray:
    """Pack (``pack_id`` order index) at balanced-stream positions ``[start, start + count)`` of ``n`` packs
    balanced in groups of ``group`` (module docstring, **Epochs**)."""
    if n < 1 or group < 1:
        raise ValueError(f"the balanced stream needs n >= 1 packs and a group >= 1, got n={n}, group={group}")
    q = np.arange(start, start + count, dtype=np.int64)
    g, o = q // group, q % group
    e = epoch_of(q, n, group)
    j = g - epoch_start(e, n, group)                     # the group's place within its epoch
    whole, r = n // group, n % group
    out = j * group + o                                  # one of the epoch's whole groups, in pack_id order
    carried = j >= whole
    if carried.any():                                    # a carried group: visits c·G + o of the leftover queue
        c = (e[carried] * r) // group + (j[carried] - whole)
        out[carried] = whole * group + (c * group + o[carried]) % r
    return out


def stream_positions(pack: int, n: int, group: int, upto: int) -> np.ndarray:
    """The balanced-stream positions below ``upto`` that read pack ``pack`` (``stream_packs``' inverse)."""
    whole, r = n // group, n % group
    if pack < whole * group:                              # once an epoch, at its place in the epoch's groups
        e = np.arange(0, upto // max(whole * group, 1) + 2, dtype=np.int64)
        q = epoch_start(e, n, group) * group + pack
    else:                                                 # leftover t: queue visits v = t + i·r, v // G its group
        v = (pack - whole * group) + r * np.arange(0, upto // n + 2, dtype=np.int64)   # one visit an epoch
        c, o = v // group, v % group
        e = -(-(c + 1) * group // r) - 1                  # the epoch whose end completes carried group c
        q = (epoch_start(e, n, group) + whole + c - e * r // group) * group + o
    return q[q < upto]


def stream_costs(cost: np.ndarray, group: int, start: int, count: int) -> np.ndarray:
    """``cost[stream_packs(len(cost), group, start, count)]``, an epoch's whole groups copied as one slice."""
    n = len(cost)
    whole, out, q, end = n // group * group, [], start, start + count
    while q < end:
        e = int(epoch_of(q, n, group))
        lo, hi = int(epoch_start(e, n, group)) * group, int(epoch_start(e + 1, n, group)) * group
        if q < lo + whole:                                   # the epoch's whole groups: packs q − lo onwards
            b = min(end, lo + whole)
            out.append(cost[q - lo:b - lo])
        else:                                                # its carried group
            b = min(end, hi)
            out.append(cost[stream_packs(n, group, q, b - q)])
        q = b
    return np.concatenate(out) if out else np.zeros(0)


def run_straggler_loss(cost: np.ndarray, group: int, dp: int, micro_batch: int = 1, grad_accum: int = 1,
                       steps: int | None = None, chunk_steps: int | None = None) -> float | None:
    """``straggler_loss`` over a run's ``steps`` steps (None: one epoch's whole steps) of the balanced stream of
    ``cost`` (groups of ``group``), a chunk of steps at a time (default ~4M positions), so a run of many epochs
    never sits in memory."""
    cost = np.asarray(cost, np.float64)
    G = dp * micro_batch * grad_accum
    if steps is None:
        steps = len(cost) // G
    if steps <= 0 or not len(cost):
        return None
    chunk_steps = chunk_steps or max(1, (1 << 22) // G)
    total, counted = 0.0, 0
    for s0 in range(0, steps, chunk_steps):
        s1 = min(s0 + chunk_steps, steps)
        rc = rank_costs(stream_costs(cost, group, s0 * G, (s1 - s0) * G), dp, micro_batch, grad_accum)
        mean = rc.mean(axis=1)
        ok = mean > 0
        total += float((rc.max(axis=1)[ok] / mean[ok] - 1).sum())
        counted += int(ok.sum())
    return total / counted if counted else 0.0


def epoch_straggler_losses(cost: np.ndarray, dp: int, micro_batch: int = 1, grad_accum: int = 1,
                           epochs: int = 4) -> list:
    """``straggler_loss`` of each of the first ``epochs`` epochs of the balanced stream at the layout it was
    balanced for (an epoch is whole groups, so whole steps: a carried group is its epoch's last step)."""
    G, n = dp * micro_batch * grad_accum, len(cost)
    cost = np.asarray(cost, np.float64)
    out = []
    for e in range(epochs):
        lo, hi = (int(x) * G for x in epoch_start(np.array([e, e + 1]), n, G))
        out.append(straggler_loss(stream_costs(cost, G, lo, hi - lo), dp, micro_batch, grad_accum) if n else None)
    return out
