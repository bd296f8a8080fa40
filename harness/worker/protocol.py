"""What the runner says to a worker, and what the worker answers: typed messages and their JSON form.

One request per line on the worker's stdin; one reply per line on its stdout, each
reply line starting with :data:`REPLY_PREFIX`. Any other line on stdout (a library or
a ``sitecustomize`` printing before the worker has pointed file descriptor 1 at stderr)
is not a reply: the client keeps it for the error tail instead of failing to parse it.

Worker-safe: the standard library and the spec layer's Status, so it runs in isolated environments on
numpy 1.23 too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from harness.spec.status import Status

# A prefix no library prints by accident (plain ASCII: str.splitlines would split at a control character).
REPLY_PREFIX = "@@harness-reply@@ "


@dataclass
class TrainSettings:
    """A ``train`` cell's settings, as the config resolved them (no defaults here: the config owns them).
    The learning rate is the cell's, sent once with ``init``."""

    epochs: int
    eval_every: int
    target_loss: float | None
    patience: int
    time_budget_s: float | None
    halve_lr_on_rise: bool
    seed: int

    @classmethod
    def of(cls, train, seed: int) -> "TrainSettings":
        """From the config's TrainConfig (or any object with the same attributes) and the run's seed."""
        return cls(**{f.name: getattr(train, f.name) for f in fields(cls) if f.name != "seed"}, seed=seed)


# -- reply bodies ---------------------------------------------------------------------
# What each request is answered with, typed: the worker builds one, the client reads its fields
# (:func:`typed` turns a reply's JSON body back into it).
@dataclass
class InitReply:
    versions: dict  # the backend's library versions
    python: str
    data_meta: dict  # what the task's data says of itself (e.g. its loss floor)
    blas: list = field(default_factory=list)  # the BLAS libraries loaded and the kernel each runs (blas_probe.kernels)


@dataclass
class WarmUpReply:
    compile_s: float  # the first call (compile, JIT, tuning)
    warm_s: float  # the untimed calls after it, together


@dataclass
class VerifyReply:
    ok: bool  # within the bound
    worst: str  # the tensor furthest from the reference, relative to its bound
    ratio: float  # its error over its bound (<= 1: within)
    bound: str  # the bound, as the check describes it


@dataclass
class CalibrateReply:
    inner: int  # calls per round
    one_s: float  # the one call it was calibrated from


@dataclass
class RoundsReply:
    samples: list  # seconds per call, one per round
    loss: float | None  # the last call's loss


@dataclass
class TrainReply:
    curve: list  # evaluation and training points: epoch, examples, wall_s, loss, split
    step_samples: list  # seconds of each SGD step
    train_s: float
    eval_s: float
    time_to_target_s: float | None
    stop: str | None  # why training stopped (target, time_budget, epochs) or what diverged
    status: Status  # ok or diverged
    examples: int
    final_lr: float

    def __post_init__(self):
        self.status = Status(self.status)


@dataclass
class CheckReply:
    results: list  # one CaseResult (as a mapping) per case


@dataclass
class GemmPeakReply:
    gflops: float
    blas: list = field(default_factory=list)  # the BLAS libraries the product ran through (blas_probe.kernels)


@dataclass
class GpuRoofsReply:
    rates: dict  # device name, GEMM GFLOP/s (fp32, tf32, fp64) and bandwidth GB/s


@dataclass
class QuitReply:
    pass


# -- requests ---------------------------------------------------------------------------
@dataclass
class Request:
    """A message to the worker; ``cmd`` names it on the wire."""

    cmd: ClassVar[str] = ""
    Body: ClassVar[type] = dict  # the type of the reply's body


@dataclass
class Init(Request):
    """Build the cell: its backend, data and initial parameters (its thread count is the worker's
    own, from the variables it was started with: ``spec.environments.worker_threads``)."""

    cmd: ClassVar[str] = "init"
    Body: ClassVar[type] = InitReply
    backend: str
    problem: dict
    task: dict
    seed: int
    lr: float


@dataclass
class WarmUp(Request):
    """Compile (timed as ``compile_s``; skipped when ``compile`` is false), then ``n`` untimed calls."""

    cmd: ClassVar[str] = "warmup"
    Body: ClassVar[type] = WarmUpReply
    n: int
    compile: bool = True


@dataclass
class Verify(Request):
    """This cell's own next step against the reference. ``memo``: a folder where the reference's answers
    are kept by their inputs, so that the other cells of a group, verified from the same parameters
    and data, read them instead of computing them again ("": none)."""

    cmd: ClassVar[str] = "verify"
    Body: ClassVar[type] = VerifyReply
    memo: str = ""


@dataclass
class Calibrate(Request):
    """Time one call; answer the inner loop count that makes a round last ``round_s``."""

    cmd: ClassVar[str] = "calibrate"
    Body: ClassVar[type] = CalibrateReply
    round_s: float


@dataclass
class Rounds(Request):
    """``n`` timed rounds of ``inner`` calls each."""

    cmd: ClassVar[str] = "rounds"
    Body: ClassVar[type] = RoundsReply
    n: int
    inner: int


@dataclass
class Train(Request):
    """SGD epochs from the shared initial parameters, with a loss curve."""

    cmd: ClassVar[str] = "train"
    Body: ClassVar[type] = TrainReply
    settings: TrainSettings

    @classmethod
    def from_json(cls, body: dict) -> "Train":
        return cls(TrainSettings(**body["settings"]))


@dataclass
class Check(Request):
    """Conformance of one backend against the reference (``harness check``), in the worker's environment."""

    cmd: ClassVar[str] = "check"
    Body: ClassVar[type] = CheckReply
    backend: str
    device: str = "cpu"
    quick: bool = False
    representative: bool = False
    index: int | None = None  # only this case of the chosen list (one request per case: progress, timeouts)


@dataclass
class GemmPeak(Request):
    """The machine's best GFLOP/s of an ``n`` x ``n`` x ``n`` GEMM in ``dtype`` through ``library``
    (:mod:`harness.worker.cpu_roofs`), on the worker's own thread count (as a cell's: the variables it was
    started with, ``spec.environments.worker_threads``; a library that takes them per call gets that count)."""

    cmd: ClassVar[str] = "gemm_peak"
    Body: ClassVar[type] = GemmPeakReply
    dtype: str
    n: int
    library: str = "numpy"


@dataclass
class GpuRoofs(Request):
    """The GPU's measured roofs: GEMM rates (TF32 off and on, float64) and memory bandwidth."""

    cmd: ClassVar[str] = "gpu_roofs"
    Body: ClassVar[type] = GpuRoofsReply
    n: int = 4096


@dataclass
class Quit(Request):
    """End the worker."""

    cmd: ClassVar[str] = "quit"
    Body: ClassVar[type] = QuitReply


REQUESTS: dict[str, type[Request]] = {c.cmd: c for c in (Init, WarmUp, Verify, Calibrate, Rounds, Train, Check, GemmPeak,
                                                             GpuRoofs, Quit)}


def typed(req: Request, reply: "Reply") -> "Reply":
    """The reply with its body as ``req``'s body type (an ok reply's; a failed one carries none)."""
    if reply.status == Status.OK and isinstance(reply.body, dict) and req.Body is not dict:
        try:
            reply.body = req.Body(**reply.body)
        except TypeError as exc:
            raise ProtocolError(f"a {req.cmd!r} reply with another request's body ({exc})") from None
    return reply


def _fields(obj) -> dict:
    # shallow on purpose: dataclasses.asdict deep-copies every list, which a round's reply pays for
    return obj.__dict__


def encode_request(req: Request) -> str:
    """The request's JSON line (without the newline)."""
    return json.dumps({"cmd": req.cmd, **req.__dict__}, default=_fields)


def decode_request(line: str) -> Request:
    """A request from its JSON line; ProtocolError when it is not one."""
    try:
        body = json.loads(line)
        cls = REQUESTS[body.pop("cmd")]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"not a request: {line[:200]!r} ({exc})") from None
    return cls.from_json(body) if cls is Train else cls(**body)


# -- replies ----------------------------------------------------------------------------
@dataclass
class Reply:
    """A worker's answer. ``status`` is ``ok``, ``error`` (with ``traceback``) or ``diverged``;
    ``body`` holds the request's results: its ``Body`` type (the worker builds it, and the client
    reads it back with :func:`typed`), a mapping on the wire; every reply carries the worker's peak
    RSS so far."""

    status: Status
    body: dict = field(default_factory=dict)
    peak_rss_mb: float | None = None
    error: str = ""
    traceback: str = ""

    def __post_init__(self):
        self.status = Status(self.status)  # the word on the wire becomes the member

    def get(self, key: str, default: Any = None) -> Any:
        """A body value, or ``default``."""
        return self.body.get(key, default)


def encode_reply(reply: Reply) -> str:
    """The reply's framed line (without the newline)."""
    return REPLY_PREFIX + json.dumps(reply.__dict__, default=_fields)


def decode_reply(line: str) -> Reply | None:
    """The reply framed in ``line``, or None for a line that is not a reply (stray output)."""
    if not line.startswith(REPLY_PREFIX):
        return None
    try:
        return Reply(**json.loads(line[len(REPLY_PREFIX):]))
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"malformed reply: {line[:200]!r} ({exc})") from None


class ProtocolError(Exception):
    """A line that claims to be a message but is not a valid one."""
