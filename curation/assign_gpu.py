"""Exact top-K on a GPU, near the GEMM floor: the fp16 score tile's top-K' candidates, rescored in fp32.

The concept matrix lives on the GPU in fp16 (500K × 1024 = 1 GB), padded to a multiple of ``GROUP``
rows. It is uploaded in chunks of ``UPLOAD_ROWS`` rows into that preallocated fp16 matrix: fp16 keys (what
the ``.npy`` shards hold) as they are, fp32 keys converted chunk by chunk on the GPU; the norm bound and
the fp16-exactness check run per chunk, and an fp32 copy is kept only for keys that are not fp16 numbers
(rescoring must read their exact values). Queries given as fp16 are uploaded as fp16 and widened on the
GPU (exactly). A query tile is uploaded on a side stream (pinned, overlapping the previous tile's work), and per
concept tile ``s = Q16 @ K16[c:c+T].T`` stays in fp16 (the GEMM's own output: no fp32 copy of the tile):
the maximum of each of ``T / GROUP`` groups of ``GROUP`` scores (columns ``g, g + T/GROUP, …``: one pass
over the tile, coalesced), the ``K'`` best groups, the ``K'`` best scores among their ``K' × GROUP``
members (every score left out is ≤ the ``K'``-th kept), merged into a running ``[n, K']`` on the GPU.
Then the ``K' = max(2K, K+16)`` candidates are rescored in fp32 from the original vectors (one batched
matrix-vector product) and the top K of those is the answer: what the fp32 CPU paths give, float ties
aside. Its time against the fp16 GEMM floor, and against the fp32-converting path it replaced, is in
docs/curation.md (figures in ``bench/results/h200.md``).

Certified exact: a row whose K-th rescored score beats ``t + |t|·2⁻¹¹ + |q|·max|k|·ε`` (``t`` the
``K'``-th fp16 score: every concept left out scores ≤ ``t`` in fp16; 2⁻¹¹ bounds fp16's rounding of the
output, ``ε`` the fp32 accumulation and, for inputs that are not fp16 numbers, their rounding) is exactly
the fp32 top-K; any other row (a crowd of near-equal scores at the cut) is recomputed in fp32 against
all concepts. One transfer back per query tile: scores, ids and the certificate packed in one tensor.
"""
from __future__ import annotations

import numpy as np

GROUP = 64
UPLOAD_ROWS = 65536           # keys uploaded and converted to fp16 in chunks of this many rows
ACC_EPS = 2.0 ** -16          # fp32 accumulation over d ≤ 4096 terms, relative to |q|·|k| (generous)
INPUT_EPS = 2.0 ** -10        # fp16 rounding of both inputs, relative to |q|·|k|


def candidates(k: int) -> int:
    return max(2 * k, k + 16)


class _Precise:
    """fp32 matmuls in full fp32 (no TF32) and fp16 GEMMs with fp32 reductions, restored after."""

    def __enter__(self):
        import torch

        self.prec = torch.get_float32_matmul_precision()
        self.red = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False

    def __exit__(self, *exc):
        import torch

        torch.set_float32_matmul_precision(self.prec)
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = self.red


class GpuTopK:
    """Exact top-``k`` inner products against a fixed key matrix resident on ``device``.

    ``submit(queries)`` queues one query tile and returns at once; ``result(handle)`` waits for it. So a
    caller can gather the next tile on the host while the GPU works (``Searcher``, ``topk_torch``)."""

    def __init__(self, keys: np.ndarray, k: int, device: str, concept_tile: int = 65536, layout: str = "strided"):
        import torch

        if layout not in ("strided", "contiguous"):
            raise ValueError(f"layout must be 'strided' or 'contiguous', got {layout!r}")
        self.device, self.V, self.layout = device, len(keys), layout
        self.k = min(k, self.V)
        self.kp = min(candidates(self.k), self.V)
        self.tile = max(GROUP, concept_tile // GROUP * GROUP)
        keys = np.asarray(keys)
        d = keys.shape[1] if keys.ndim == 2 else 0
        fp16 = keys.dtype == np.float16                             # the shards' dtype: uploaded as is
        # Row chunks: the GPU never holds an fp32 copy of all the keys unless they need one (below).
        self.k16 = torch.empty((self.V + -self.V % GROUP, d), dtype=torch.float16, device=device)
        self.k16[self.V:] = 0                                       # the padding rows
        k32, norms, exact = None, [], True
        for a in range(0, self.V, UPLOAD_ROWS):
            host = np.ascontiguousarray(keys[a:a + UPLOAD_ROWS], dtype=None if fp16 else np.float32)
            chunk = torch.from_numpy(host).to(device)
            c16 = self.k16[a:a + len(chunk)]
            c16.copy_(chunk)                                        # (fp32 → fp16 on the device)
            c32 = chunk if not fp16 else c16.float()
            norms.append(c32.norm(dim=1).max())
            if exact and not fp16 and not torch.equal(c16.float(), c32):
                exact = False                                       # rescoring must read the fp32 vectors:
                k32 = torch.empty((self.V, d), dtype=torch.float32, device=device)
                k32[:a].copy_(self.k16[:a])                         # (the chunks so far were fp16 numbers)
            if k32 is not None:
                k32[a:a + len(chunk)] = c32
            del chunk, c32
        self.kmax = float(torch.stack(norms).max()) if norms else 0.0
        self.keys_exact = exact                                     # fp16 shards: always
        self.kx = self.k16 if exact else k32                        # the vectors rescoring reads
        self.recomputed = 0                                         # rows the certificate sent to fp32
        cuda = device.startswith("cuda")
        self.copy_stream = torch.cuda.Stream(device) if cuda else None

    # ------------------------------------------------------------------ one query tile
    def submit(self, queries: np.ndarray):
        import torch

        queries = np.asarray(queries)
        # fp16 queries (the shards' dtype) travel as fp16: half the bytes, and Q16.float() is exact.
        dt = np.float16 if queries.dtype == np.float16 else np.float32
        q = torch.from_numpy(np.ascontiguousarray(queries, dtype=dt))
        if self.copy_stream is not None:
            q = q.pin_memory()
            with torch.cuda.stream(self.copy_stream):
                Q = q.to(self.device, non_blocking=True)
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
            Q.record_stream(torch.cuda.current_stream(self.device))
        else:
            Q = q.to(self.device)
        with torch.inference_mode(), _Precise():
            Q = Q.float()                                           # (a no-op for fp32 queries)
            packed = self._tile(Q)
            out = packed.to("cpu", non_blocking=True)
        done = None
        if self.copy_stream is not None:
            done = torch.cuda.Event()
            done.record()
        return Q, out, done

    def result(self, handle) -> tuple[np.ndarray, np.ndarray]:
        Q, out, done = handle
        if done is not None:
            done.synchronize()
        k = self.k
        a = out.numpy()
        s = np.ascontiguousarray(a[:, :k])
        i = np.ascontiguousarray(a[:, k:2 * k]).view(np.int32).astype(np.int64)
        doubt = np.flatnonzero(a[:, 2 * k] == 0)
        if len(doubt):
            self.recomputed += len(doubt)
            import torch

            s[doubt], i[doubt] = self.exact(Q[torch.as_tensor(doubt, device=Q.device)])
        return s, i

    def __call__(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.result(self.submit(queries))

    def _tile(self, Q):
        import torch

        n, G, kp = len(Q), GROUP, self.kp
        Q16 = Q.half()
        best_s = best_i = None
        for c in range(0, len(self.k16), self.tile):
            s = Q16 @ self.k16[c:c + self.tile].T                 # [n, T] fp16, the GEMM's precision
            T = s.shape[1]
            if c + T > self.V:
                s[:, self.V - c:] = float("-inf")                   # the padding rows
            kg = min(kp, T // G)
            if self.layout == "contiguous":                         # group g: columns g·G … g·G + G-1
                groups = s.view(n, T // G, G)
                _, gi = groups.amax(2).topk(kg, dim=1, sorted=False)
                members = groups.gather(1, gi[:, :, None].expand(n, kg, G)).view(n, kg * G)
                ts, ti = members.topk(min(kp, kg * G), dim=1, sorted=False)
                ids = gi.gather(1, ti // G) * G + ti % G + c
            else:                                                   # group g: columns g, g + T/G, g + 2T/G, …
                groups = s.view(n, G, T // G)                       # (a max over a strided dim reads coalesced)
                _, gi = groups.amax(1).topk(kg, dim=1, sorted=False)
                members = groups.gather(2, gi[:, None, :].expand(n, G, kg)).reshape(n, G * kg)
                ts, ti = members.topk(min(kp, kg * G), dim=1, sorted=False)
                ids = (ti // kg) * (T // G) + gi.gather(1, ti % kg) + c
            if best_s is None:
                best_s, best_i = ts, ids
            else:
                cs, ci = torch.cat([best_s, ts], 1), torch.cat([best_i, ids], 1)
                best_s, pos = cs.topk(min(kp, cs.shape[1]), dim=1, sorted=False)
                best_i = ci.gather(1, pos)
        # rescore the K' candidates in fp32 from the original vectors, keep the top K
        ex = torch.empty(best_i.shape, dtype=torch.float32, device=Q.device)
        for a in range(0, n, 4096):
            kv = self.kx[best_i[a:a + 4096]].float()               # [r, K', d]
            ex[a:a + 4096] = torch.bmm(kv, Q[a:a + 4096, :, None]).squeeze(2)
        es, pos = ex.topk(self.k, dim=1)
        ei = best_i.gather(1, pos)
        if self.kp < self.V:                                       # else every concept was a candidate
            t = best_s.min(1).values.float()
            eps = ACC_EPS
            if not self.keys_exact:
                eps = eps + INPUT_EPS
            q_inexact = (Q16.float() != Q).any(1)
            bound = (t + t.abs() * 2.0 ** -11 + 2.0 ** -24
                     + Q.norm(dim=1) * self.kmax * (eps + INPUT_EPS * q_inexact.float()))
            sure = es[:, -1] > bound
        else:
            sure = torch.ones(n, dtype=torch.bool, device=Q.device)
        return torch.cat([es, ei.to(torch.int32).view(torch.float32), sure.float()[:, None]], 1)

    def exact(self, Q) -> tuple[np.ndarray, np.ndarray]:
        """fp32 top-k of ``Q`` against every key (the rows the certificate could not vouch for)."""
        import torch

        best_s = best_i = None
        with torch.inference_mode(), _Precise():
            for c in range(0, self.V, self.tile):
                s = Q @ self.kx[c:min(c + self.tile, self.V)].float().T   # (not the padding rows of k16)
                ts, ti = s.topk(min(self.k, s.shape[1]), dim=1)
                ti = ti + c
                if best_s is None:
                    best_s, best_i = ts, ti
                else:
                    best_s, pos = torch.cat([best_s, ts], 1).topk(self.k, dim=1)
                    best_i = torch.cat([best_i, ti], 1).gather(1, pos)
        return best_s.cpu().numpy(), best_i.cpu().numpy()


def topk_tiles(search: GpuTopK, queries: np.ndarray, image_tile: int) -> tuple[np.ndarray, np.ndarray]:
    """All of ``queries`` in tiles of ``image_tile``, the next tile queued before the last is read."""
    out_s = np.empty((len(queries), search.k), np.float32)
    out_i = np.empty((len(queries), search.k), np.int64)
    pending = None
    for a in range(0, len(queries) + image_tile, image_tile):
        handle = search.submit(queries[a:a + image_tile]) if a < len(queries) else None
        if pending is not None:
            b, h = pending
            s, i = search.result(h)
            out_s[b:b + len(s)], out_i[b:b + len(s)] = s, i
        pending = (a, handle) if handle is not None else None
    return out_s, out_i
