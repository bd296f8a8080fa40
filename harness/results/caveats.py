"""What shaped a run, said where its figures are read: the cells timed on a busy machine, and the
variables that forced a library's kernel or cache size in the workers.

The rows get :data:`harness.results.schema.GUARD_COLUMNS` (:func:`cell_columns`), run.json a record
of each worker's steering variables and BLAS kernels (:func:`record_environment`), and the report's
Answer and the terminal summary open with :func:`lines` and keep contended cells from being called
the fastest (:func:`fastest`, :func:`speedup_mark`).
"""

from __future__ import annotations

import pandas as pd

from harness.run import guard
from harness.spec import tuning

from harness.results.standing import MARKS, UNSTEADY_SPREAD, Standing  # noqa: E402,F401  (one home for both)

#: other processes on this many cores or more, within those a cell left free, are local load worth naming
LOCAL_LOAD_CORES = 0.5
#: ... and a run says so when more than this share of its timed cells (two at least) did
UNSTEADY_SHARE = 0.25


# -- per cell ---------------------------------------------------------------------------------------------
def kernel_text(blas: list | None) -> str | None:
    """The BLAS kernels a worker ran, ``openblas 0.3.31 Haswell; openmp``-like (None where unreported)."""
    if not blas:
        return None
    parts = []
    for lib in blas:
        if lib.get("user_api") not in (None, "blas"):
            continue
        version = str(lib.get("version") or "").split()
        words = [lib.get("internal_api") or "?", version[1] if version[:1] == ["OpenBLAS"] and len(version) > 1
                 else (version[0] if version else ""), lib.get("architecture") or "kernel unreported"]
        parts.append(" ".join(w for w in words if w))
    return "; ".join(dict.fromkeys(parts)) or None


def forced_text(steering: dict | None) -> str | None:
    """The variables a worker got that force a kernel or a cache size, with their origin:
    ``OPENBLAS_CORETYPE=Haswell (caller)`` (None when none did)."""
    forced = [f"{k}={v['value']} ({v['origin']})" for k, v in (steering or {}).items()
              if not v.get("removed") and tuning.forces(k, v["value"])]
    return "; ".join(forced) or None


def cell_columns(outcome, cores: int | None) -> dict:
    """GUARD_COLUMNS of one cell: whether it was timed on a contended machine and the evidence, whether its
    worker ran in a clean environment, the variables that forced its kernels and the kernels it ran."""
    seen = guard.combine(outcome.conditions or [])
    contended, evidence = guard.judge(seen, outcome.cell.threads, cores)
    return {"contended": contended, "contention": evidence or None,
            "env_clean": bool(getattr(outcome.cell, "clean_env", False)),
            "env_forced": forced_text(outcome.steering), "blas_kernel": kernel_text(outcome.blas)}


def record_environment(meta: dict, outcome) -> None:
    """run.json's ``worker_environment``: per backend and thread count, whether its workers ran clean, every
    steering variable they got (or a clean environment left out) with its origin, and their BLAS kernels."""
    if outcome.steering is None and not outcome.blas:
        return
    key = _record_key(outcome.cell.backend, outcome.cell.threads)
    entry = meta.setdefault("worker_environment", {}).setdefault(key, {})
    entry["clean"] = bool(getattr(outcome.cell, "clean_env", False))
    if outcome.steering is not None:
        entry["variables"] = outcome.steering
    if outcome.blas:
        entry["blas"] = outcome.blas


# -- what the answer says first -----------------------------------------------------------------------------
def _record_key(backend: str, threads: int) -> str:
    """A ``worker_environment`` entry's key: ``backend|threads=N`` (read back by :func:`_record_backend`)."""
    return f"{backend}|threads={threads}"


def _record_backend(key: str) -> str:
    """The backend of a ``worker_environment`` key (:func:`_record_key`)."""
    backend, sep, _ = key.rpartition("|threads=")
    return backend if sep else key


def _records(meta: dict) -> dict:
    return meta.get("worker_environment") or {}


def _rows(timings) -> list[dict]:
    return pd.DataFrame(timings).to_dict("records") if not isinstance(timings, list) else timings


def contended(row) -> bool:
    """A row timed while the machine was contended."""
    v = row.get("contended") if hasattr(row, "get") else None
    return v is not None and not pd.isna(v) and bool(v)


def lines(meta: dict, timings) -> list[str]:
    """The sentences the Answer and the terminal summary open with (empty for a run that nothing shaped):
    a contended machine with its evidence, and each variable that forced a kernel or a cache size with
    the kernel its workers ran."""
    rows = _rows(timings)
    return (_contention_lines(meta, rows) + _unsteady_lines(rows) + tuning.fallback_lines(meta) + _forcing_lines(meta)
            + _clean_lines(meta))


def _contention_lines(meta: dict, rows: list[dict]) -> list[str]:
    from harness.results.labels import backend_label

    conditions = meta.get("conditions") or {}
    evidence = list(conditions.get("evidence") or [])
    timed = [r for r in rows if r.get("contention")]
    bad = [r for r in timed if contended(r)]
    if not bad and not evidence:
        return []
    out = []
    if bad:
        r = max(bad, key=lambda r: _others(r))
        label = backend_label(pd.DataFrame([r])).iloc[0]
        out.append(f"Contended machine: {len(bad)} of {len(timed)} timed cells ran while other processes loaded the "
                   f"cores (the worst, {label} {r.get('workload')} batch {r.get('batch')} {r.get('threads')} thread(s): "
                   f"{r['contention']}). Their times are slower and their speedups not to be trusted: none of them is "
                   f"called the fastest here; rerun on a quiet machine.")
    if evidence:
        out.append("Busy machine: " + "; ".join(evidence) + ". Figures of this run may be lower than the machine gives.")
    return out


def _unsteady_lines(rows: list[dict]) -> list[str]:
    """One sentence when the machine's own speed moved: many timed cells whose worker processes (of one pass
    or of passes apart) disagree by more than UNSTEADY_SPREAD, on a machine that no other process loaded
    (contended cells are said by :func:`_contention_lines`). A host shared with other tenants, a clock that
    changes: nothing on the machine shows it but the times themselves."""
    from harness.results.labels import backend_label

    def spread(r):
        v = r.get("process_spread")
        return None if v is None or pd.isna(v) else float(v)

    timed = [r for r in rows if spread(r) is not None and not contended(r)]
    wide = [r for r in timed if spread(r) > UNSTEADY_SPREAD]
    if len(wide) < 2 or len(wide) <= UNSTEADY_SHARE * len(timed):
        return []
    r = max(wide, key=spread)
    label = backend_label(pd.DataFrame([r])).iloc[0]
    quiet = "" if len(timed) == len([r for r in rows if spread(r) is not None]) else \
        "of the cells the guard did not find contended, "
    what = f"the worker processes of {len(wide)} of {len(timed)} timed cells" if not quiet else \
        f"the worker processes of {len(wide)} of {len(timed)}"
    local = max((_others(w) for w in wide), default=0.0)
    if local >= LOCAL_LOAD_CORES:  # what the guard saw: load on the cores the cells left free
        cause = (f"Other processes used up to {local:.2g} cores while they were timed: within the cores the cells "
                 f"left free, yet sharing their caches, memory bandwidth and perhaps a physical core. Rerun on a "
                 f"quiet machine.")
    else:
        cause = ("Nothing else loaded the cores while they were timed, so the machine's own speed moved (a host "
                 "shared with other tenants, a changing clock). The intervals cover what this run saw; a rerun may "
                 "differ by as much.")
    return [f"Unsteady machine: {quiet}{what} disagree by more than {UNSTEADY_SPREAD:.0%} (the most, {label} "
            f"{r.get('workload')} batch {r.get('batch')}: {spread(r):.0%}); they are marked "
            f"{MARKS[Standing.UNSTEADY]}. {cause}"]


def _others(row: dict) -> float:
    text = str(row.get("contention") or "")
    try:
        return float(text.split("used ", 1)[1].split(" ", 1)[0])
    except (IndexError, ValueError):
        return 0.0


def _forcing_lines(meta: dict) -> list[str]:
    """One sentence per origin and set of workers: the variables that forced a kernel or a cache size there,
    their values, and the kernels those workers ran."""
    reached: dict[tuple, list[str]] = {}  # (name, value, origin, what) -> the workers it reached
    kernels: dict[str, set] = {}  # worker -> its BLAS kernels
    for key, entry in _records(meta).items():
        backend = _record_backend(key)
        for name, v in (entry.get("variables") or {}).items():
            what = tuning.forces(name, v.get("value", ""))
            if what is not None and not v.get("removed") and not v.get("fixes"):  # a fix: tuning.fallback_lines says it
                reached.setdefault((name, v["value"], v["origin"], what), []).append(backend)
                kernels.setdefault(backend, set()).update(
                    kernel_text([b]) for b in entry.get("blas") or [] if b.get("user_api") in (None, "blas"))
    together: dict[tuple, list[tuple]] = {}  # (origin, workers) -> its variables
    for (name, value, origin, what), backends in reached.items():
        together.setdefault((origin, tuple(dict.fromkeys(backends))), []).append((name, value, what))
    flags = (meta.get("machine") or {}).get("cpu_flags") or []
    words = {"caller": "inherited from the caller's environment", "config": "set by the config's env",
             "harness": "set by the harness for the backend"}
    out = []
    for (origin, backends), variables in together.items():
        names = " and ".join(f"{n}={v}" for n, v, _ in variables)
        whats = " and ".join(dict.fromkeys(w for _, _, w in variables))
        ran = ", ".join(sorted({k for b in backends for k in kernels.get(b, ()) if k})) or "kernel unreported"
        cpu = "".join(_own_openblas_choice(v, flags) for n, v, _ in variables if n == "OPENBLAS_CORETYPE")
        fix = " `clean_env: true` in the config runs the workers without the caller's steering variables." \
            if origin == "caller" else ""
        out.append(f"{names} ({words.get(origin, origin)}) forced {whats} in the workers of {', '.join(backends)}: "
                   f"they ran {ran}.{cpu}{fix}")
    return out


def _own_openblas_choice(forced: str, flags) -> str:
    """What OpenBLAS would pick on this CPU by itself, beside the core type a variable forced: on AVX-512 a
    SkylakeX-class kernel; on AVX2 without it Haswell's, so that forcing Haswell there changes no kernel."""
    if "avx512f" in flags:
        return " This CPU has AVX-512 (avx512f), where OpenBLAS picks a SkylakeX-class kernel on its own."
    if "avx2" in flags and forced.strip().lower() == "haswell":
        return (" This CPU has AVX2 and no AVX-512, where OpenBLAS picks Haswell's kernels on its own: "
                "the core type forced here is the one it would run.")
    return ""


def _clean_lines(meta: dict) -> list[str]:
    """One sentence on the workers that ran in a clean environment: what it left out and the kernels they ran."""
    left_out: dict[str, str] = {}
    backends, ran = [], set()
    for key, entry in _records(meta).items():
        if not entry.get("clean"):
            continue
        backends.append(_record_backend(key))
        ran.update(kernel_text([b]) for b in entry.get("blas") or [] if b.get("user_api") in (None, "blas"))
        left_out.update({k: v["value"] for k, v in (entry.get("variables") or {}).items() if v.get("removed")})
    if not backends:
        return []
    what = ", ".join(f"{k}={v}" for k, v in sorted(left_out.items())) or "no steering variable was set"
    kernels = ", ".join(sorted(k for k in ran if k)) or "kernel unreported"
    return [f"Clean environment: the workers of {', '.join(dict.fromkeys(backends))} ran without the caller's "
            f"steering variables (left out: {what}); they ran {kernels}."]


# -- the fastest, unless contended --------------------------------------------------------------------------
def fastest(group: pd.DataFrame, best, text: str) -> str:
    """The Answer's "fastest" entry of a comparison group: ``text`` as it is, unless the fastest cell or what
    its speedup is over was timed on a contended machine; then no winner is named."""
    over = best.get("speedup_over") if hasattr(best, "get") else None
    ref = group[group["cell_id"].str.endswith(f"|{over}")] if isinstance(over, str) else group.iloc[:0]
    if contended(best) or any(contended(r) for r in ref.to_dict("records")):
        return f"none named: {text} timed on a contended machine"
    return text
