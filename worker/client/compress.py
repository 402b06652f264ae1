"""A worker's compressed pushes (`PSClient(compress=...)`, `ps-worker --compress`): top-k or PowerSGD with error
feedback, encoded in the layouts of paramserver/wire/compression.py, one shard's part at a time.

Error feedback keeps, per shard part, what the pushes so far left out: each push compresses the gradient plus that
remainder, and the new remainder is what the shard will not see (after the wire dtype's rounding too), so nothing a
step computed is lost, only delayed. The shard decodes each worker's payload and sums, so workers never gather
one another's factors.

- top-k (`topk:RATIO`): about RATIO of the part's parameter elements, the largest in magnitude. The threshold is
  estimated from a random sample of the magnitudes, as Deep Gradient Compression does: a whole encode of a
  12.5 M-element part took about 23 ms here, error feedback included, and torch.topk's selection alone 240-300 ms
  (one thread, the same run).
- PowerSGD (`powersgd:RANK`): each matrix-shaped piece as P (rows x RANK) and Q (cols x RANK), one power
  iteration a step from the last step's Q (Vogels et al. 2019; torch's PowerSGD DDP hook). Each worker
  approximates its own gradient; the shard adds the products.

The first steps push whole (`Scheme.warmup`: DEFAULT_WARMUP, or K of `:warmup=K`), as torch's PowerSGD hook does
(`start_powerSGD_iter`). Only the data socket carries compressed pushes (the transport between hosts, where bytes
cost). Over shared memory or gRPC a push goes whole and the remainder waits for the next compressed one; a step
encoded for the data socket whose retry goes whole gives back to the remainder what encoding took (`whole`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from paramserver.placement import Piece, TensorSpec
from paramserver.v1 import ps_pb2
from paramserver.wire import compression
from paramserver.wire.chunks import FLOAT32, decode_into, encode, itemsize
from worker.client.binding import Binding

SAMPLE = 1 << 16  # magnitudes sampled for top-k's threshold


# Steps 1 .. DEFAULT_WARMUP push whole: error feedback on a model still far from any minimum delays most of what
# the first steps compute. Measured on make demo's default run (2 workers x 2 shards, sync, the CNN on digits, 230
# steps, --no-shared-memory, topk:0.01; 2026-11-27), the held-out accuracy over seeds 0-9: 0.923 without a warm-up
# (seeds 0-4), 0.955 at 46 and at 69 steps, 0.967-0.972 whole (seeds 0-2); seed 0 (the demo's): 0.936, 0.969 at
# 46, 0.942 at 50, 0.969 at 69. Past it a push costs what it did (12.1 kB against 605 kB whole).
DEFAULT_WARMUP = 46


@dataclass(frozen=True)
class Scheme:
    """What `--compress` names: top-k with a ratio, or PowerSGD with a rank, and the steps that push whole first."""

    kind: int  # a ps_pb2.Compression.Kind value
    ratio: float = 0.0
    rank: int = 0
    warmup: int = DEFAULT_WARMUP  # steps 1 .. warmup push whole (torch's PowerSGD hook: start_powerSGD_iter)

    @classmethod
    def parse(cls, text: str) -> Scheme:
        """`topk:RATIO` (0 < RATIO < 1) or `powersgd:RANK` (1 .. 64), optionally `:warmup=K` (K >= 0); ValueError
        naming what is wrong."""
        name, _, rest = text.partition(":")
        arg, colon, option = rest.partition(":")
        try:
            warmup = _warmup(option if colon else None)
            if name == "topk":
                ratio = float(arg)
                if 0.0 < ratio < 1.0:
                    return cls(compression.TOP_K, ratio=ratio, warmup=warmup)
            elif name == "powersgd":
                rank = int(arg)
                if 1 <= rank <= compression.MAX_RANK:
                    return cls(compression.POWER_SGD, rank=rank, warmup=warmup)
        except ValueError:
            pass
        raise ValueError(
            f"--compress {text!r}: give topk:RATIO (0 < RATIO < 1, e.g. topk:0.01) or powersgd:RANK "
            f"(1 to {compression.MAX_RANK}, e.g. powersgd:4), optionally :warmup=K, the steps that push whole "
            f"first (K >= 0; default {DEFAULT_WARMUP})"
        )

    def __str__(self) -> str:
        what = f"topk:{self.ratio:g}" if self.kind == compression.TOP_K else f"powersgd:{self.rank}"
        return what if self.warmup == DEFAULT_WARMUP else f"{what}:warmup={self.warmup}"


def _warmup(option: str | None) -> int:
    """The K of `warmup=K` (DEFAULT_WARMUP where no option is given); ValueError for anything else."""
    if option is None:
        return DEFAULT_WARMUP
    key, sep, value = option.partition("=")
    if key != "warmup" or not sep or not value.isdigit():
        raise ValueError(option)
    return int(value)


@dataclass(frozen=True)
class Encoded:
    """One shard's compressed push: its floats (float32, sent in the wire dtype), its raw arrays, its message."""

    values: np.ndarray
    raw: list[np.ndarray]
    message: ps_pb2.Compression


@dataclass
class _Part:
    """One shard part's memory: the remainder, PowerSGD's Qs, and the last push (a retry sends it again)."""

    flat: np.ndarray  # the remainder of the part's parameter elements (buffers are values, never compressed)
    residual: list[np.ndarray]  # per piece, its view of `flat` (empty for a buffer)
    rng: np.random.Generator  # top-k's samples (one per part: the parts are encoded on threads of their own)
    torch_rng: torch.Generator  # PowerSGD's first Qs
    qs: dict[int, torch.Tensor] = field(default_factory=dict)  # piece index -> cols x rank
    last: tuple[int, Encoded | None] = (-1, None)

    @classmethod
    def of(cls, pieces: tuple[Piece, ...], specs: dict[str, TensorSpec], seed: int) -> _Part:
        lengths = [0 if specs[p.name].buffer else p.length for p in pieces]
        flat = np.zeros(sum(lengths), np.float32)
        ends = np.cumsum(lengths)
        views = [flat[end - n : end] for n, end in zip(lengths, ends, strict=True)]
        return cls(flat, views, np.random.default_rng(seed), torch.Generator().manual_seed(seed))


def _wire(values: np.ndarray, dtype: int) -> np.ndarray:
    """A copy of the values as the shard will read them: rounded through the wire dtype."""
    if dtype == FLOAT32:
        return values.copy()
    out = np.empty_like(values)
    decode_into(out, encode(values, dtype), dtype)
    return out


class Compressor:
    """Encodes a worker's pushes, shard part by shard part, keeping each part's error feedback."""

    def __init__(self, scheme: Scheme, seed: int = 0) -> None:
        self.scheme = scheme
        self._seed = seed
        self._parts: dict[tuple[str, int], _Part] = {}

    def remainder(self, digest: str, shard: int) -> np.ndarray:
        """A copy of what error feedback holds back for this model's part on `shard`: its parameter elements in
        piece order, buffers left out (empty before its first push)."""
        part = self._parts.get((digest, shard))
        return part.flat.copy() if part is not None else np.zeros(0, np.float32)

    def encode(self, b: Binding, shard: int, views: list[np.ndarray], step: int, dtype: int) -> Encoded | None:
        """The compressed payload of shard `shard`'s part of this push (views: its pieces' gradients), or None where
        compression would not make it smaller (the part then goes whole; its remainder waits). The same step asked
        again (a retry) gets the same payload."""
        pieces = b.placement.shards[shard]
        specs = {s.name: s for s in b.placement.specs}
        part = self._parts.get((b.digest, shard))
        if part is None:
            part = self._parts[(b.digest, shard)] = _Part.of(pieces, specs, self._seed * 1000 + shard)
        if part.last[0] == step:
            return part.last[1]
        if step <= self.scheme.warmup:  # a warm-up step: whole, and nothing held back yet to add to it
            part.last = (step, None)
            return None
        if self.scheme.kind == compression.TOP_K:
            encoded = self._top_k(part, pieces, specs, views, dtype)
        else:
            encoded = self._power_sgd(part, pieces, specs, views, dtype)
        part.last = (step, encoded)
        return encoded

    def whole(self, b: Binding, shard: int, views: list[np.ndarray], step: int) -> None:
        """This step's push of shard `shard`'s part goes whole after all (its retry took a transport that does not
        compress): give the remainder back what encoding the step took from it, so the next compressed push starts
        from what the shard has really been sent. Nothing to do for a step not encoded."""
        part = self._parts.get((b.digest, shard))
        if part is None or part.last[0] != step or part.last[1] is None:
            return
        encoded, pieces = part.last[1], b.placement.shards[shard]
        layout = compression.layout(encoded.message, pieces, {s.name: s for s in b.placement.specs})
        sent = np.empty(sum(p.length for p in pieces), np.float32)
        layout.decode(encoded.values, encoded.raw, sent)
        at = 0
        for k, piece in enumerate(pieces):
            if len(part.residual[k]):  # a parameter piece (a buffer keeps no remainder)
                part.residual[k] += sent[at : at + piece.length]
                part.residual[k] -= views[k]
            at += piece.length
        part.last = (-1, None)

    def _top_k(
        self, part: _Part, pieces: tuple[Piece, ...], specs: dict[str, TensorSpec], views: list[np.ndarray], dtype: int
    ) -> Encoded | None:
        params = [k for k, p in enumerate(pieces) if not specs[p.name].buffer]
        n = sum(len(views[k]) for k in params)
        want = max(1, math.ceil(self.scheme.ratio * n))
        size_of = itemsize(dtype)
        if not params or want * (size_of + compression.INDEX.itemsize) >= n * size_of:
            return None
        for k in params:  # the gradient plus what earlier pushes left out
            np.add(part.residual[k], views[k], out=part.residual[k])
        m = part.flat
        size = np.abs(m)
        sample = size[part.rng.integers(0, n, min(n, SAMPLE))]
        keep = max(1, round(self.scheme.ratio * len(sample)))
        threshold = np.partition(sample, len(sample) - keep)[len(sample) - keep]
        index = np.flatnonzero(size >= threshold) if threshold > 0 else np.flatnonzero(size)
        if len(index) > 2 * want:  # a sample that missed the tail: the largest `want` of those over it
            index = np.sort(index[np.argpartition(size[index], len(index) - want)[len(index) - want :]])
        if len(index) == 0:
            index = np.array([int(np.argmax(size))])
        sent = _wire(m[index], dtype)
        m[index] -= sent  # the remainder: what the shard does not get
        buffers = [views[k] for k, p in enumerate(pieces) if specs[p.name].buffer]
        values = np.concatenate([*buffers, sent]).astype(np.float32, copy=False)
        message = ps_pb2.Compression(kind=compression.TOP_K, count=len(index))
        return Encoded(values, [index.astype(compression.INDEX)], message)

    def _power_sgd(
        self, part: _Part, pieces: tuple[Piece, ...], specs: dict[str, TensorSpec], views: list[np.ndarray], dtype: int
    ) -> Encoded | None:
        rank = self.scheme.rank
        matrices = [compression.matrix_of(p, specs[p.name], rank) for p in pieces]
        if not any(matrices):
            return None
        out: list[np.ndarray] = []
        for k, (piece, m) in enumerate(zip(pieces, matrices, strict=True)):
            if specs[piece.name].buffer:
                out.append(views[k])
                continue
            full = part.residual[k]
            np.add(full, views[k], out=full)
            if m is None:
                sent = _wire(full, dtype)
                out.append(sent)
                full -= sent
                continue
            head, body, tail = full[: m.head], full[m.head : m.head + m.rows * m.cols], full[len(full) - m.tail :]
            mat = torch.from_numpy(body).view(m.rows, m.cols)
            q = part.qs.get(k)
            if q is None:
                q = torch.randn(m.cols, rank, generator=part.torch_rng)
            p, _ = torch.linalg.qr(mat @ q)  # P = orthonormal basis of M Q
            q = mat.t() @ p
            part.qs[k] = q
            p_sent = _wire(p.contiguous().numpy().reshape(-1), dtype)
            q_sent = _wire(q.contiguous().numpy().reshape(-1), dtype)
            head_sent, tail_sent = _wire(head, dtype), _wire(tail, dtype)
            out += [head_sent, p_sent, q_sent, tail_sent]
            mat -= torch.from_numpy(p_sent).view(m.rows, rank) @ torch.from_numpy(q_sent).view(m.cols, rank).t()
            head -= head_sent
            tail -= tail_sent
        values = np.concatenate(out).astype(np.float32, copy=False)
        return Encoded(values, [], ps_pb2.Compression(kind=compression.POWER_SGD, rank=rank))
