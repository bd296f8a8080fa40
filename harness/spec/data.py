"""Task data (SPEC.md "Tasks"), deterministic from ``seed``. Worker-safe: numpy only.

Every task yields time-major arrays: ``x`` (T, N) token ids or (T, N, D) floats and
``y`` (T, N) class ids or (T, N, O) floats, for N sequences, plus a held-out
evaluation set and facts about the task (``meta``), such as a known loss floor.
"""

from __future__ import annotations

import re
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from harness.spec.errors import HarnessError
from harness.spec.model import ModelSpec, TaskSpec

START, END = 0, 1
SAMPLE_TEXT = Path(__file__).resolve().parent / "texts" / "sample.txt"


@dataclass
class Dataset:
    """Training and evaluation sequences of one task."""

    x: np.ndarray
    y: np.ndarray
    x_eval: np.ndarray
    y_eval: np.ndarray
    input_size: int
    output_size: int
    tokens: bool
    meta: dict = field(default_factory=dict)

    @property
    def n_sequences(self) -> int:
        return self.x.shape[1]

    def batch(self, idx) -> tuple[np.ndarray, np.ndarray]:
        """The sequences ``idx`` as one time-major minibatch (contiguous copies)."""
        return np.ascontiguousarray(self.x[:, idx]), np.ascontiguousarray(self.y[:, idx])


def make_dataset(task: TaskSpec, model: ModelSpec, seed: int, dtype: str = "float64") -> Dataset:
    """Build the task's data; targets follow the model's head (class ids or floats)."""
    rng = np.random.default_rng([seed, 7])
    n_total = task.n_sequences + task.n_eval
    maker = {"lm_markov": _lm_markov, "lm_text": _lm_text, "sobel": _sobel,
             "frame_diff": _frame_diff, "random": _random}[task.kind]
    x, y, meta = maker(task, model, rng, n_total, dtype)
    if task.kind in ("lm_markov", "lm_text") and model.head != "softmax_xent":
        raise HarnessError(f"task.kind: {task.kind} predicts tokens and needs model.head softmax_xent")
    if task.kind in ("sobel", "frame_diff") and model.head != "mse":
        raise HarnessError(f"task.kind: {task.kind} regresses pixels and needs model.head mse")
    n = task.n_sequences
    d_in, d_out = task.sizes()
    ds = Dataset(x[:, :n], y[:, :n], x[:, n:], y[:, n:], d_in, d_out, task.tokens, meta)
    if task.kind == "lm_markov":
        ds.meta["loss_floor"] = float(meta["row_entropy"][ds.x_eval].mean())
        del ds.meta["row_entropy"]
    return ds


def _random(task, model, rng, n, dtype):
    T = task.seq_len
    d_in, d_out = task.sizes()
    x = rng.integers(0, d_in, size=(T, n)) if task.tokens else rng.normal(size=(T, n, d_in)).astype(dtype)
    if model.head == "softmax_xent":
        y = rng.integers(0, d_out, size=(T, n))
    else:
        y = (0.5 * rng.normal(size=(T, n, d_out))).astype(dtype)
    return x, y, {}


def markov_chain(vocab: int, branching: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """A sparse random chain: each token has ``branching`` successors (Zipf-popular), ``END`` among them."""
    ranks = np.arange(2, vocab)
    zipf = 1.0 / (ranks - 1.0)
    zipf /= zipf.sum()
    k = min(branching, vocab - 2)
    succ = np.empty((vocab, k + 1), dtype=np.int64)
    prob = np.zeros((vocab, k + 1))
    for tok in range(vocab):
        succ[tok, :k] = rng.choice(ranks, size=k, replace=False, p=zipf)
        succ[tok, k] = END
        prob[tok, :k] = rng.dirichlet(np.full(k, 0.5)) * 0.9
        prob[tok, k] = 0.1  # sentences of about ten words
    succ[START, k], prob[START, :k], prob[START, k] = succ[START, 0], prob[START, :k] / 0.9, 0.0
    succ[END] = START  # after the end token a new sentence starts
    prob[END] = 0.0
    prob[END, 0] = 1.0
    return succ, prob


def _lm_markov(task, model, rng, n, dtype):
    succ, prob = markov_chain(task.vocab, task.branching, rng)
    cum = np.cumsum(prob, axis=1)
    T = task.seq_len
    seq = np.empty((T + 1, n), dtype=np.int64)
    seq[0] = START
    for t in range(T):
        rows = seq[t]
        u = rng.random(n)[:, None] * cum[rows, -1:]
        pick = (cum[rows] < u).sum(axis=1)
        seq[t + 1] = succ[rows, np.minimum(pick, succ.shape[1] - 1)]
    with np.errstate(divide="ignore", invalid="ignore"):
        row_entropy = -np.where(prob > 0, prob * np.log(prob), 0.0).sum(axis=1)
    return seq[:-1], seq[1:], {"row_entropy": row_entropy, "entropy_rate_note": "loss_floor = mean entropy of the true next-token distribution over the evaluation set"}


MAX_TEXT_BYTES = 1 << 30


def read_text_file(path: Path, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """A task's text: a regular file (never a folder, /dev/zero or a pipe that never ends), at most
    ``max_bytes`` long, undecodable bytes replaced."""
    try:
        st = path.stat()
    except OSError:
        raise HarnessError(f"task.path: no such file {str(path)[:200]!r}") from None
    if not stat.S_ISREG(st.st_mode):
        raise HarnessError(f"task.path: expected a regular text file, got {str(path)[:200]!r}")
    if st.st_size > max_bytes:
        raise HarnessError(f"task.path: expected a text file of at most {max_bytes >> 20} MB, got {st.st_size >> 20} MB")
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise HarnessError(f"task.path: cannot read {str(path)[:200]!r}: {exc.strerror}") from None
    return data[:max_bytes].decode("utf-8", errors="replace")


def tokenize_text(text: str, vocab: int) -> tuple[list[list[int]], list[str]]:
    """WildML preprocessing: lower-cased word sentences wrapped in start/end; the ``vocab - 1`` most
    frequent words (start and end among them) keep ids, every other word becomes UNKNOWN."""
    sentences = [s for s in re.split(r"(?<=[.!?])\s+|\n\s*\n", text) if s.strip()]
    words = [re.findall(r"[a-z0-9']+|[,;:]", s.lower()) for s in sentences]
    words = [w for w in words if w]
    counts = Counter(w for s in words for w in s)
    keep = [w for w, _ in counts.most_common(max(vocab - 3, 0))]
    itos = ["<s>", "</s>"] + keep + ["UNKNOWN"]
    stoi = {w: i for i, w in enumerate(itos)}
    unk = len(itos) - 1
    ids = [[START] + [stoi.get(w, unk) for w in s] + [END] for s in words]
    return ids, itos


def _lm_text(task, model, rng, n, dtype):
    path = Path(task.path) if task.path != "sample" else SAMPLE_TEXT
    ids, itos = tokenize_text(read_text_file(path), task.vocab)
    stream = np.array([i for s in ids for i in s], dtype=np.int64)
    T = task.seq_len
    if stream.size < T + 2:
        raise HarnessError(f"task.path: {path} holds too little text for seq_len {T}")
    starts = rng.integers(0, stream.size - T - 1, size=n)
    windows = stream[starts[None, :] + np.arange(T + 1)[:, None]]
    return windows[:-1], windows[1:], {"vocab_used": len(itos), "n_words": int(stream.size)}


def _images(n_images, height, width, rng):
    """Smooth synthetic grey images in [0, 1): blurred blobs on a gradient."""
    yy, xx = np.mgrid[0:height, 0:width] / max(height, width)
    imgs = np.empty((n_images, height, width))
    for k in range(n_images):
        img = rng.random() * xx + rng.random() * yy
        for _ in range(4):
            cy, cx, r = rng.random(), rng.random(), 0.05 + 0.2 * rng.random()
            img += rng.random() * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r))
        imgs[k] = (img - img.min()) / (img.max() - img.min() + 1e-12) * 0.999
    return imgs


def _sobel(task, model, rng, n, dtype):
    T = task.seq_len  # one image row of T pixels is one sequence
    n_images = -(-n // task.height)
    rows = _images(n_images, task.height, T, rng).reshape(-1, T)[:n]
    x = rows.T[:, :, None]
    shifted = np.zeros_like(x)
    shifted[2:] = x[:-2]
    return x.astype(dtype), (x - shifted).astype(dtype), {"filter": "[-1, 0, 1] along the row"}


def _frame_diff(task, model, rng, n, dtype):
    T, h, w = task.seq_len, task.height, task.width
    yy, xx = np.mgrid[0:h, 0:w]
    x = np.zeros((T, n, h * w))
    for s in range(n):
        pos = rng.random((3, 2)) * [h, w]
        vel = rng.normal(size=(3, 2)) * 0.8
        rad = 1.5 + rng.random(3) * max(1.0, min(h, w) / 6)
        for t in range(T):
            frame = np.zeros((h, w))
            for p, r in zip(pos, rad):
                frame = np.maximum(frame, ((yy - p[0]) ** 2 + (xx - p[1]) ** 2 <= r * r) * 0.9)
            x[t, s] = frame.ravel()
            pos += vel
            for a, lim in ((0, h), (1, w)):  # bounce off the borders
                out = (pos[:, a] < 0) | (pos[:, a] >= lim)
                vel[out, a] *= -1
                pos[:, a] = np.clip(pos[:, a], 0, lim - 1e-6)
    prev = np.zeros_like(x)
    prev[1:] = x[:-1]
    return x.astype(dtype), (x - prev).astype(dtype), {"frame": f"{h}x{w}"}


def eval_loss(model: ModelSpec, outputs: np.ndarray, y: np.ndarray) -> float:
    """Reported loss (per token / per step) of inference ``outputs`` against targets ``y``."""
    if model.head == "softmax_xent":
        p = np.take_along_axis(outputs, y[..., None], axis=-1)[..., 0]
        return float(-np.log(np.maximum(p.astype(np.float64), 1e-300)).mean())
    diff = outputs.astype(np.float64) - y
    return float(0.5 * (diff * diff).sum(axis=-1).mean())
