"""The registry of backends. Modules are imported lazily and import failures become
"unavailable: <reason>" entries rather than crashes.

Three sources, in this order of precedence: ``HARNESS_BACKENDS`` (a quick override for one
shell or test), the built-in :data:`REGISTRY`, and installed packages that declare an entry
point in the group ``rnn_harness.backends`` (``name = "module:Class"``).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from dataclasses import dataclass

from harness.spec.errors import HarnessError

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


ENTRY_POINT_GROUP = "rnn_harness.backends"


@dataclass(frozen=True)
class Plugin:
    """A backend declared by an installed package's entry point."""

    name: str
    module: str
    cls: str
    value: str  # the entry point as declared, for messages
    dist: str  # the distribution that declares it


@functools.lru_cache(maxsize=4)
def _entry_points(path: tuple[str, ...]) -> tuple[dict[str, Plugin], tuple[Plugin, ...]]:
    """Installed plugins by name, and those left out because their name was taken.

    Cached per ``sys.path`` (scanning every installed distribution costs tens of ms)."""
    from importlib.metadata import entry_points

    found: dict[str, Plugin] = {}
    shadowed: list[Plugin] = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep.dist, "name", None) or "an unknown distribution"
        module, _, attr = ep.value.partition(":")
        plugin = Plugin(ep.name, module.strip(), attr.strip(), ep.value, dist)
        if ep.name in REGISTRY or ep.name in found:
            shadowed.append(plugin)
        else:
            found[ep.name] = plugin
    return found, tuple(shadowed)


def plugins() -> dict[str, Plugin]:
    """Backends from installed packages (entry-point group ``rnn_harness.backends``)."""
    return _entry_points(tuple(sys.path))[0]


def registry() -> dict[str, tuple[str, str]]:
    """Every backend name -> ``(module, class)``: the built-in ones, installed plugins, and
    ``HARNESS_BACKENDS`` over both."""
    found = {name: (p.module, p.cls) for name, p in plugins().items()}
    return {**REGISTRY, **found, **_plugins()}  # a plugin never takes a built-in name (see _entry_points)


def origin(name: str) -> str:
    """Where a registered backend comes from: ``built-in``, ``HARNESS_BACKENDS`` or ``plugin <dist>``."""
    if name in _plugins():
        return "HARNESS_BACKENDS"
    if name in REGISTRY:
        return "built-in"
    found = plugins().get(name)
    return f"plugin {found.dist}" if found else "unknown"


@dataclass(frozen=True)
class BackendRef:
    """A backend as a config, a command line or a run names it, parsed once:
    ``name[:variant][@version[+package@version...]]`` or ``name[:variant]@rev:REVISION``.

    ``full`` is the text it was parsed from (the canonical name once :func:`resolve` made it);
    ``variant`` is None for the default one; ``pin_text`` is what follows ``@`` ("" for none);
    ``pins`` the versions it pins, ``{package: version}`` with the backend's own package first
    (empty for a revision, and for a backend that cannot be imported here); ``revision`` the git
    revision of its sources it pins (``native@rev:4aee8db``), None for none."""

    full: str
    name: str
    variant: str | None = None
    pin_text: str = ""
    revision: str | None = None

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def parse(full: str) -> "BackendRef":
        """The parts of a backend name, by its syntax alone (no registry lookup)."""
        base, _, pin_text = str(full).partition("@")
        name, _, variant = base.partition(":")
        revision = pin_text[len("rev:"):] if pin_text.startswith("rev:") else None
        return BackendRef(str(full), name, variant or None, pin_text, revision)

    def __str__(self) -> str:
        return self.full

    @property
    def base(self) -> str:
        """``name[:variant]`` without the pins: ``jax:unroll=4`` of ``jax:unroll=4@0.4.38``."""
        return self.full.partition("@")[0]

    @property
    def environment_key(self) -> str:
        """The key of its environment's versions: its name with the versions it pins (``jax`` and
        ``jax@0.4.38+jaxlib@0.4.38`` are two environments; a variant shares its backend's)."""
        return f"{self.name}@{self.pin_text}" if self.pin_text else self.name

    @property
    def pins(self) -> dict[str, str]:
        """The versions it pins, ``{package: version}`` (the backend's own ``package`` first); ``{}`` for a name
        that pins a revision of its sources instead, or none."""
        from harness.spec.environments import parse_pins

        if "@" not in self.full or self.revision is not None:
            return {}
        cls = backend_class(self.name)
        try:
            return parse_pins(f"{cls.package}@{self.pin_text}")
        except ValueError as exc:
            raise HarnessError(f"backend {_short(self.full)}: {exc}") from None

    def backend_class(self):
        """Its backend class (:func:`backend_class`)."""
        return backend_class(self.name)


def ref(full) -> BackendRef:
    """``full`` as a :class:`BackendRef` (a ref is returned as it is)."""
    return full if isinstance(full, BackendRef) else BackendRef.parse(str(full))


def _short(full: str) -> str:
    """A backend name as messages quote it: its start and end where it is long (a runaway version)."""
    from harness.spec.model import short_repr

    return short_repr(str(full), 80)


def revision_of(full: str) -> str | None:
    """The git revision of its sources a backend name pins: ``"native@rev:4aee8db"`` -> ``"4aee8db"`` (None: none;
    ``backends.native_build``)."""
    return ref(full).revision


def pins_of(full: str) -> dict[str, str]:
    """The versions a backend name pins, ``{package: version}`` (the backend's own ``package`` first); ``{}`` for
    a name that pins a revision of its sources instead (``native@rev:4aee8db``)."""
    return ref(full).pins


def backend_class(name: str):
    """The backend class for ``name``; raises HarnessError for unknown names or broken modules."""
    known = registry()
    if name not in known:
        import difflib

        close = difflib.get_close_matches(str(name), list(known), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise HarnessError(f"unknown backend {name!r}{hint}; known backends are {', '.join(known)}")
    module, cls = known[name]
    where = f"{module}:{cls}" + ("" if origin(name) == "built-in" else f", {origin(name)}")
    if not (module and cls):
        raise HarnessError(f"unavailable: backend {name!r} ({where}): expected an entry point 'module:Class'")
    try:
        obj = getattr(importlib.import_module(module), cls)
    except Exception as exc:  # a broken or missing module is reported, never fatal
        raise HarnessError(f"unavailable: backend {name!r} failed to import ({where}): {type(exc).__name__}: {exc}") from exc
    problem = _class_problem(name, obj)
    if problem:
        raise HarnessError(f"unavailable: backend {name!r} ({where}): {problem}")
    return obj


def _class_problem(name: str, obj) -> str:
    """Why ``obj`` cannot serve as the backend ``name`` (empty when it can)."""
    from backends.base import Backend

    if not (isinstance(obj, type) and issubclass(obj, Backend)):
        return f"{obj!r} is not a subclass of backends.base.Backend"
    if obj.name != name:
        return f"the class calls itself {obj.name!r}; its name attribute must match the registered name"
    variants = obj.variants
    if not (isinstance(variants, tuple) and variants and all(isinstance(v, str) and v for v in variants)):
        return f"variants must be a non-empty tuple of names, got {variants!r}"
    return ""


def resolve(full, versions: dict[str, str] | None = None) -> BackendRef:
    """Check ``name[:variant][@version[+package@version...]]`` against the registry; returns it as a
    :class:`BackendRef` of its canonical name. ``versions`` (package -> version, from a config's
    ``versions:``) adds companions to a name that pins a version; the name's own pins win."""
    from harness.spec.environments import normalise_package

    given = ref(full)
    name, variant = given.name, given.variant
    if name not in registry():
        backend_class(name)  # raises the "unknown backend" error with the known names
    try:
        cls = backend_class(name)
    except HarnessError:
        # known but broken here (missing library, failed build): the run records the
        # cells as unavailable with this reason instead of refusing the whole config
        return given
    if variant is not None and variant not in cls.variants:
        raise HarnessError(f"backend {_short(full)}: unknown variant {variant!r}; valid variants are {', '.join(cls.variants)}")
    canonical = cls.full_name_of(variant)
    if "@" not in given.full:
        return ref(canonical)
    if given.revision is not None:
        if not cls.revisions:
            raise HarnessError(f"backend {_short(given.full)}: {name} cannot be built from another revision of its sources "
                               f"(a backend whose class sets `revisions`, such as native, can); expected {name}, "
                               f"{name}:variant or {name}@version")
        from backends import native_build

        try:
            return ref(f"{canonical}@rev:{native_build.canonical(given.revision)}")
        except HarnessError as exc:
            raise HarnessError(f"backend {_short(given.full)}: {exc}") from None
    if cls.package is None:
        why = (f"it runs in its own environment {cls.environment!r}" if cls.environment
               else "its class names no `package` to pin")
        raise HarnessError(f"backend {_short(full)}: {name} cannot be pinned to a version ({why}); expected {name} "
                           f"or {name}:variant")
    pins = given.pins
    for package, version in (versions or {}).items():
        pins.setdefault(normalise_package(package), version)
    return ref(cls.full_name_of(variant, pins))


def validate_name(full: str, versions: dict[str, str] | None = None) -> str:
    """The canonical name of ``full`` (:func:`resolve`), as text."""
    return resolve(full, versions).full


def default_variant(name: str) -> str | None:
    """The variant a bare ``name`` means (None when the backend cannot be imported here)."""
    try:
        return backend_class(name).variant_of(None)
    except HarnessError:
        return None


def full_name(name: str, variant: str | None) -> str:
    """``name`` for its default variant, ``name:variant`` otherwise (a backend that cannot be imported
    here, say a plugin named in an old run, keeps its variant in the name)."""
    return name if variant in (None, default_variant(name)) else f"{name}:{variant}"


def create(full):
    """Instantiate ``name[:variant][@versions]`` (a name or a :class:`BackendRef`; the instance's ``pins`` hold
    the versions)."""
    canonical = resolve(full)
    cls = backend_class(canonical.name)
    try:
        inst = cls(canonical.variant)
    except Exception as exc:  # a constructor that raises makes the backend unavailable, not the run fail
        raise HarnessError(f"unavailable: backend {str(full)!r} could not be created: {type(exc).__name__}: {exc}") from exc
    inst.pins = canonical.pins
    inst.revision = canonical.revision
    return inst


def environment_of(full) -> str | None:
    """The isolated environment the workers of backend ``full`` run in: its pin set's (``jax@0.4.38``),
    its class's (``theano``), or None for the main one."""
    return create(full).environment_name


@dataclass
class Listing:
    name: str
    variant: str
    full_name: str
    available: bool
    reason: str
    devices: tuple[str, ...]
    environment: str | None
    origin: str = "built-in"  # or "plugin <distribution>", "HARNESS_BACKENDS"


def list_backends() -> list[Listing]:
    """Every registered backend and variant with its availability here; plugins that could not be
    registered (their name is taken) are listed too, as unavailable with the reason."""
    from harness.spec import environments

    rows: list[Listing] = []
    for name in registry():
        source = origin(name)
        try:
            cls = backend_class(name)
        except HarnessError as exc:
            rows.append(Listing(name, "-", name, False, str(exc), (), None, source))
            continue
        for variant in cls.variants:
            full = cls.full_name_of(variant)
            try:
                inst = create(full)
            except HarnessError as exc:
                rows.append(Listing(name, variant, full, False, str(exc), cls.devices, cls.environment, source))
                continue
            try:
                ok, why = environments.reachable(inst.environment_name, inst.environment_recipe, inst.availability)
            except Exception as exc:  # availability must never crash the listing
                ok, why = False, f"unavailable: availability() raised {type(exc).__name__}: {exc}"
            rows.append(Listing(name, variant, inst.full_name, ok, why, cls.devices, cls.environment, source))
    for p in _entry_points(tuple(sys.path))[1]:
        taken = "a built-in backend" if p.name in REGISTRY else f"the plugin of {plugins()[p.name].dist}"
        rows.append(Listing(p.name, "-", f"{p.name} ({p.dist})", False,
                            f"unavailable: the name {p.name!r} is taken by {taken}; this entry point ({p.value}) is ignored",
                            (), None, f"plugin {p.dist}"))
    return rows
