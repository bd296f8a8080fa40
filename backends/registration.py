"""What the registry knows of a backend beyond the protocol its author implements: how its names are
spelt (a bare name is the first variant), the versions or source revision a name pins, and the isolated
environment its workers run in. :class:`backends.base.Backend` inherits it; a plugin sets at most the
class attributes below."""

from __future__ import annotations


class Registration:
    #: name of the isolated environment its workers run in (None: the main environment)
    environment: str | None = None
    #: what that environment holds (a :class:`harness.spec.environments.Recipe`); the harness builds it
    recipe = None
    #: the distribution whose version a name may pin (``jax@0.4.38``: jax 0.4.38 in an environment of its
    #: own); None: this backend cannot be pinned
    package: str | None = None
    #: True when a name may pin a git revision of the backend's own sources, built on first use
    #: (``native@rev:4aee8db``: the C++ engine at that commit; ``backends.native_build``)
    revisions: bool = False

    name: str = ""
    variants: tuple[str, ...] = ("default",)

    def __init__(self, variant: str | None = None):
        self.variant = self.variant_of(variant)
        #: the versions its name pins (``backends.create("jax@0.4.38")``: {"jax": "0.4.38"}), {} for none
        self.pins: dict[str, str] = {}
        #: the revision of its sources its name pins (``native@rev:4aee8db``: "4aee8db"), None for none
        self.revision: str | None = None

    @property
    def full_name(self) -> str:
        name = self.full_name_of(self.variant, self.pins)
        return f"{name}@rev:{self.revision}" if self.revision else name

    # -- naming (the one rule: a bare name means the first variant, which is written bare) ----
    @classmethod
    def variant_of(cls, variant: str | None) -> str:
        """The variant a name asks for: the first one (the default) when it names none."""
        return variant or cls.variants[0]

    @classmethod
    def full_name_of(cls, variant: str | None, pins: dict[str, str] | None = None) -> str:
        """``name`` for the default variant, ``name:variant`` for the others; with ``pins``, then
        ``@version`` of its package and ``+package@version`` of the others, sorted."""
        variant = cls.variant_of(variant)
        name = cls.name if variant == cls.variants[0] else f"{cls.name}:{variant}"
        if not pins:
            return name
        return f"{name}@{pins[cls.package]}" + "".join(f"+{p}@{v}" for p, v in sorted(pins.items()) if p != cls.package)

    # -- where its workers run ------------------------------------------------------------
    @property
    def environment_name(self) -> str | None:
        """The isolated environment this backend's workers run in: its pin set's, else its class's."""
        from harness.spec.environments import pins_text

        return pins_text(self.pins) if self.pins else self.environment

    @property
    def environment_recipe(self):
        """What its environment holds: its pin set's recipe, else its class's (None: the main environment)."""
        from harness.spec import environments

        return environments.pinned_recipe(self.pins) if self.pins else self.recipe
