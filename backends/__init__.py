"""The registry of backends. Modules are imported lazily and import failures become
"unavailable: <reason>" entries rather than crashes."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from harness.errors import HarnessError

# name -> (module, class). One explicit list: adding a backend means adding a line here.
REGISTRY: dict[str, tuple[str, str]] = {
    "numpy": ("backends.numpy_backend", "NumpyBackend"),
    "torch": ("backends.torch_backend", "TorchBackend"),
    "jax": ("backends.jax_backend", "JaxBackend"),
    "native": ("backends.native_backend", "NativeBackend"),
    "numba": ("backends.numba_backend", "NumbaBackend"),
    "theano": ("backends.theano_backend", "TheanoBackend"),
    "pytensor": ("backends.pytensor_backend", "PytensorBackend"),
    "halide": ("backends.halide_backend", "HalideBackend"),
    "cuda": ("backends.cuda_backend", "CudaBackend"),
}


def _plugins() -> dict[str, tuple[str, str]]:
    """Extra backends from ``HARNESS_BACKENDS="name=module:Class,..."`` (third-party or test backends)."""
    out = {}
    for item in filter(None, (s.strip() for s in os.environ.get("HARNESS_BACKENDS", "").split(","))):
        name, _, target = item.partition("=")
        module, _, cls = target.partition(":")
        if not (name and module and cls):
            raise HarnessError(f"HARNESS_BACKENDS: expected name=module:Class, got {item!r}")
        out[name] = (module, cls)
    return out


def registry() -> dict[str, tuple[str, str]]:
    """The built-in backends plus any registered through ``HARNESS_BACKENDS``."""
    return {**REGISTRY, **_plugins()}


def split_name(full: str) -> tuple[str, str | None]:
    """``"numpy:wildml"`` -> ``("numpy", "wildml")``; ``"jax"`` -> ``("jax", None)``."""
    name, _, variant = str(full).partition(":")
    return name, (variant or None)


def backend_class(name: str):
    """The backend class for ``name``; raises HarnessError for unknown names or broken modules."""
    known = registry()
    if name not in known:
        raise HarnessError(f"unknown backend {name!r}; known backends are {', '.join(known)}")
    module, cls = known[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except Exception as exc:  # a broken or missing module is reported, never fatal
        raise HarnessError(f"unavailable: backend {name!r} failed to import: {type(exc).__name__}: {exc}") from exc


def validate_name(full: str) -> str:
    """Check ``name[:variant]`` against the registry; returns the canonical full name."""
    name, variant = split_name(full)
    if name not in registry():
        backend_class(name)  # raises the "unknown backend" error with the known names
    try:
        cls = backend_class(name)
    except HarnessError:
        # known but broken here (missing library, failed build): the run records the
        # cells as unavailable with this reason instead of refusing the whole config
        return full
    if variant is not None and variant not in cls.variants:
        raise HarnessError(f"backend {full!r}: unknown variant {variant!r}; valid variants are {', '.join(cls.variants)}")
    return name if variant in (None, cls.variants[0]) else f"{name}:{variant}"


def create(full: str):
    """Instantiate ``name[:variant]``."""
    name, variant = split_name(full)
    validate_name(full)
    return backend_class(name)(variant)


@dataclass
class Listing:
    name: str
    variant: str
    full_name: str
    available: bool
    reason: str
    devices: tuple[str, ...]
    environment: str | None


def list_backends() -> list[Listing]:
    """Every registered backend and variant with its availability here."""
    rows: list[Listing] = []
    for name in registry():
        try:
            cls = backend_class(name)
        except HarnessError as exc:
            rows.append(Listing(name, "-", name, False, str(exc), (), None))
            continue
        for variant in cls.variants:
            inst = cls(variant)
            try:
                ok, why = inst.availability()
            except Exception as exc:  # availability must never crash the listing
                ok, why = False, f"unavailable: {type(exc).__name__}: {exc}"
            rows.append(Listing(name, variant, inst.full_name, ok, why, cls.devices, cls.environment))
    return rows
