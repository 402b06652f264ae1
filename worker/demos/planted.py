"""The planted click world of the recommendation demo: click logs drawn from a known model, written as Criteo files.

Why a planted model: real click logs have no known ceiling, so "close to the best achievable" could not be checked.
Here labels are Bernoulli(sigmoid(planted logit)), and the planted logit puts most of its signal where it can be
learned from the data (dense features, categories, tags, items, the head users and their taste for categories)
while the Zipf tail of users, most of the million-plus IDs, carries little: a model trained on the logs can come
within a few percent of the ceiling, the AUC of the planted probabilities themselves.

`write_criteo` writes the logs in Criteo's day-file layout (what `ps-prepare --format criteo` reads): the label, 13
integer features (the 4 dense ones as counts, the rest missing) and 26 categorical ones as 8-hex-digit hashes (the
user, the item, its category and up to 4 tags, one slot each; the rest missing).
"""

from __future__ import annotations

import gzip
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paramserver.tables import mix64
from worker.train.metrics import auc

USER_RANKS = 10**9  # users are Zipf ranks 1..USER_RANKS, hashed to int64 IDs
NUM_ITEMS = 100_000
NUM_CATEGORIES = 1_000
NUM_TAGS = 10_000
NUM_DENSE = 4
MAX_TAGS = 4  # tags per sample: 1..MAX_TAGS
TASTE_DIM = 4  # the planted user x category interaction's rank

USER_ZIPF = 1.0  # exponents of the rank distributions
ITEM_ZIPF = 1.0
TAG_ZIPF = 1.0
# Effects of a user or item shrink past these ranks as sqrt(head / rank): the head, seen often, carries the signal;
# the tail, seen once or never in training, carries little (its effects cannot be learned, only guessed at).
USER_HEAD = 300
ITEM_HEAD = 2_000

BASE_LOGIT = -1.0  # about 30 % clicks
USER_BIAS_STD = 0.7
USER_TASTE_STD = 0.6
ITEM_BIAS_STD = 0.5
CATEGORY_BIAS_STD = 0.5
TAG_BIAS_STD = 0.8


# eq=False: field-wise equality over arrays is ambiguous, identity is what a frozen holder needs.
@dataclass(frozen=True, eq=False)
class Clicks:
    """A split of the click logs, one row per impression, as numpy arrays."""

    dense: np.ndarray  # float32 [n, NUM_DENSE], standard normal
    user: np.ndarray  # int64 [n], hashes of Zipf ranks: any int64, negative ones included
    item: np.ndarray  # int64 [n]
    category: np.ndarray  # int64 [n], the item's category
    tags: np.ndarray  # int64 [sum of bag sizes], flat
    tag_offsets: np.ndarray  # int64 [n + 1], sample i's tags are tags[tag_offsets[i]:tag_offsets[i + 1]]
    label: np.ndarray  # float32 [n]
    prob: np.ndarray  # float64 [n], the planted model's click probability (label ~ Bernoulli(prob))

    def __len__(self) -> int:
        return len(self.label)

    def distinct_ids(self) -> dict[str, int]:
        """Distinct IDs per table in this split."""
        return {
            "user": len(np.unique(self.user)),
            "item": len(np.unique(self.item)),
            "category": len(np.unique(self.category)),
            "tags": len(np.unique(self.tags)),
        }


@dataclass(frozen=True, eq=False)
class ClickLogs:
    """Training and held-out click logs drawn from one planted model, and that model's own held-out AUC."""

    train: Clicks
    test: Clicks
    seed: int
    ceiling_auc: float  # AUC of the planted probabilities on the test split: what a perfect model would score
    user_vocab: np.ndarray  # int64, sorted: every user ID of train and test (the local model's user rows)

    def distinct_train_ids(self) -> int:
        """Distinct IDs over all tables that training touches: the rows a run's tables come to hold."""
        return sum(self.train.distinct_ids().values())


def _zipf_ranks(rng: np.random.Generator, n: int, exponent: float, size: int) -> np.ndarray:
    """n ranks in 1..size with P(rank) roughly proportional to rank^-exponent (inverse CDF of the continuous
    power law, floored): vectorised and exact enough for a workload, where an exact sampler would need the table."""
    u = rng.random(n)
    if exponent == 1.0:
        r = np.exp(u * math.log(size + 1.0))
    else:
        a = 1.0 - exponent
        r = (u * ((size + 1.0) ** a - 1.0) + 1.0) ** (1.0 / a)
    return np.clip(np.floor(r), 1, size).astype(np.int64)


def _hash_normals(keys: np.ndarray, salt: int, k: int) -> np.ndarray:
    """Standard normals [len(keys), k], a fixed function of (key, salt): per-user effects for a billion possible
    users without a table (Box-Muller over SplitMix64 hashes of the key)."""
    base = mix64(keys.astype(np.uint64) ^ mix64(np.array([salt], dtype=np.uint64)))
    out = np.empty((len(keys), k), dtype=np.float64)
    for j in range(k):
        h1 = mix64(base + np.uint64(2 * j))
        h2 = mix64(base + np.uint64(2 * j + 1))
        u1 = (h1 >> np.uint64(11)).astype(np.float64) * 2.0**-53
        u2 = (h2 >> np.uint64(11)).astype(np.float64) * 2.0**-53
        out[:, j] = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * math.pi * u2)
    return out


def _head_scale(ranks: np.ndarray, head: int) -> np.ndarray:
    """1 for ranks up to `head`, then sqrt(head / rank): how much of an ID's effect the planted model keeps."""
    return np.sqrt(np.minimum(1.0, head / ranks.astype(np.float64)))


def make_click_logs(n_train: int, n_test: int, seed: int = 0) -> ClickLogs:
    """Draw n_train + n_test i.i.d. impressions from the planted model of `seed` (the same logs for the same
    arguments, on every machine) and split them; the ceiling is the planted probabilities' AUC on the test split.

    Each impression: a user (Zipf over USER_RANKS ranks, hashed to int64), an item (Zipf over NUM_ITEMS, through a
    fixed permutation), the item's category, 1..MAX_TAGS tags (Zipf over NUM_TAGS) and NUM_DENSE standard normal
    features. The planted logit: BASE_LOGIT + a nonlinear function of the dense features + category, item and
    mean tag biases + the user's bias + the user's taste for the category (a TASTE_DIM dot product), user and item
    effects shrinking past their head ranks.
    """
    if n_train < 1 or n_test < 1:
        raise ValueError(f"need at least one training and one test sample, not {n_train} and {n_test}")
    n = n_train + n_test
    world = np.random.default_rng([seed, 0])  # the planted model
    rng = np.random.default_rng([seed, 1])  # the impressions
    salt = int(world.integers(0, 2**63))

    item_ids = world.permutation(NUM_ITEMS)  # the item at popularity rank r is item_ids[r - 1]
    item_rank = np.empty(NUM_ITEMS, dtype=np.int64)
    item_rank[item_ids] = np.arange(1, NUM_ITEMS + 1)
    item_category = world.integers(0, NUM_CATEGORIES, NUM_ITEMS)
    item_bias = world.normal(0.0, ITEM_BIAS_STD, NUM_ITEMS) * _head_scale(item_rank, ITEM_HEAD)
    category_bias = world.normal(0.0, CATEGORY_BIAS_STD, NUM_CATEGORIES)
    category_taste = world.normal(0.0, 1.0, (NUM_CATEGORIES, TASTE_DIM))
    tag_ids = world.permutation(NUM_TAGS)
    tag_bias = world.normal(0.0, TAG_BIAS_STD, NUM_TAGS)

    user_rank = _zipf_ranks(rng, n, USER_ZIPF, USER_RANKS)
    user = (mix64(user_rank.astype(np.uint64) ^ np.uint64(salt))).view(np.int64)
    item = item_ids[_zipf_ranks(rng, n, ITEM_ZIPF, NUM_ITEMS) - 1]
    category = item_category[item]
    sizes = rng.integers(1, MAX_TAGS + 1, n)
    tag_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(sizes, out=tag_offsets[1:])
    tags = tag_ids[_zipf_ranks(rng, int(tag_offsets[-1]), TAG_ZIPF, NUM_TAGS) - 1]
    dense = rng.standard_normal((n, NUM_DENSE)).astype(np.float32)

    x = dense.astype(np.float64)
    logit = BASE_LOGIT + 0.6 * x[:, 0] - 0.5 * x[:, 1] + 0.4 * x[:, 2] + 0.4 * np.tanh(2.0 * x[:, 3])
    logit += 0.3 * x[:, 0] * x[:, 1]
    logit += category_bias[category] + item_bias[item]
    logit += np.add.reduceat(tag_bias[tags], tag_offsets[:-1]) / sizes
    effects = _hash_normals(user_rank, salt, 1 + TASTE_DIM) * _head_scale(user_rank, USER_HEAD)[:, None]
    logit += USER_BIAS_STD * effects[:, 0]
    taste = (effects[:, 1:] * category_taste[category]).sum(axis=1) / math.sqrt(TASTE_DIM)
    logit += USER_TASTE_STD * taste
    prob = 1.0 / (1.0 + np.exp(-logit))
    label = (rng.random(n) < prob).astype(np.float32)

    def split(lo: int, hi: int) -> Clicks:
        offs = tag_offsets[lo : hi + 1]
        return Clicks(
            dense=dense[lo:hi],
            user=user[lo:hi],
            item=item[lo:hi],
            category=category[lo:hi],
            tags=tags[offs[0] : offs[-1]],
            tag_offsets=offs - offs[0],
            label=label[lo:hi],
            prob=prob[lo:hi],
        )

    train, test = split(0, n_train), split(n_train, n)
    return ClickLogs(
        train=train, test=test, seed=seed, ceiling_auc=auc(test.label, test.prob), user_vocab=np.unique(user)
    )


CRITEO_INTEGERS = 13
CRITEO_CATEGORICAL = 26


def criteo_lines(clicks: Clicks) -> list[str]:
    """The impressions as Criteo lines: label, I1..I13, C1..C26, tab-separated, without the newline.

    A dense feature x becomes the count round(4 exp(x)), which ps-prepare's log(1 + count) brings back to about
    x + log 4; the user, item and category become the low 32 bits of their IDs in hex, the tags one slot each."""
    n = len(clicks)
    counts = np.rint(4.0 * np.exp(clicks.dense.astype(np.float64))).astype(np.int64)
    sizes = np.diff(clicks.tag_offsets)
    columns: list[list[str]] = [[str(int(v)) for v in clicks.label]]
    columns += [[str(int(v)) for v in counts[:, j]] for j in range(counts.shape[1])]
    columns += [[""] * n for _ in range(CRITEO_INTEGERS - counts.shape[1])]
    for ids in (clicks.user, clicks.item, clicks.category):
        columns.append([f"{v:08x}" for v in (ids.astype(np.uint64) & np.uint64(0xFFFFFFFF)).tolist()])
    for slot in range(MAX_TAGS):
        has = sizes > slot
        tag = np.where(has, clicks.tags[np.minimum(clicks.tag_offsets[:-1] + slot, len(clicks.tags) - 1)], 0)
        columns.append([f"{v:08x}" if h else "" for v, h in zip(tag.tolist(), has.tolist(), strict=True)])
    columns += [[""] * n for _ in range(CRITEO_CATEGORICAL - 3 - MAX_TAGS)]
    return ["\t".join(fields) for fields in zip(*columns, strict=True)]


def write_criteo(logs: ClickLogs, directory: Path) -> list[Path]:
    """The logs as two Criteo day files in `directory`: the training impressions as day_0.tsv and the held-out ones
    gzipped as day_1.tsv.gz (ps-prepare holds its own test split out of both)."""
    directory.mkdir(parents=True, exist_ok=True)
    plain, packed = directory / "day_0.tsv", directory / "day_1.tsv.gz"
    plain.write_text("\n".join(criteo_lines(logs.train)) + "\n")
    with gzip.open(packed, "wt", compresslevel=1) as f:
        f.write("\n".join(criteo_lines(logs.test)) + "\n")
    return [plain, packed]


def ceiling_auc(logs: ClickLogs) -> float:
    """The planted probabilities' AUC over every impression written (a held-out split of them scores about
    this): what a perfect model would score."""
    return auc(np.concatenate([logs.train.label, logs.test.label]), np.concatenate([logs.train.prob, logs.test.prob]))
