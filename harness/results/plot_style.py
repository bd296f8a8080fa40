"""What every plot of the project shares: the figure grid, the colour of each backend and its variants,
readable log axes, and how a figure is saved (PNG and a deterministic SVG)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from harness.results.labels import fmt_seconds
from harness.spec.writes import write_file

def _setup():
    import sys

    import matplotlib

    # files only, no window; a notebook that already chose its backend keeps it (figures here are closed after saving)
    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    return plt, sns


#: a hue per backend in registry order (numpy blue, torch orange, jax green, ...); its variants and pinned
#: versions are shades of it
_HUES = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
         "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173"]
#: hues for backends from plugins: none of them is a registry backend's
_PLUGIN_HUES = ["#6b6ecf", "#b5cf6b", "#e7ba52", "#d6616b", "#ce6dbd", "#9c9ede", "#cedb9c", "#e7969c"]
_SHADES = [0.0, 0.45, -0.35, 0.7, -0.55, 0.25, -0.2, 0.6]  # > 0 toward white, < 0 toward black


def _label_parts(label: str) -> tuple[str, str | None, str]:
    """``"jax:unroll=4 0.4.38"`` -> ``("jax", "unroll=4", "0.4.38")``: a label's backend, variant and the
    version or pins it carries (:func:`backend_label` writes ``name[:variant] VERSION`` or ``name@PINS``)."""
    import backends

    base, _, version = str(label).partition(" ")
    ref = backends.ref(base)
    return ref.name, ref.variant, version or ref.pin_text


def _hue(name: str) -> np.ndarray:
    import zlib

    import backends
    from matplotlib.colors import to_rgb

    names = list(backends.registry())
    hue = _HUES[names.index(name) % len(_HUES)] if name in names else \
        _PLUGIN_HUES[zlib.crc32(name.encode()) % len(_PLUGIN_HUES)]
    return np.array(to_rgb(hue))


def _shade_index(name: str, variant: str | None) -> int:
    """A variant's place among its backend's shades: the default first, then the class's variant order."""
    import zlib

    import backends

    try:
        variants = list(backends.backend_class(name).variants)
    except Exception:  # an unknown or broken backend still gets a stable shade
        variants = []
    if variant is None:
        return 0
    return variants.index(variant) if variant in variants else 1 + zlib.crc32(variant.encode()) % (len(_SHADES) - 1)


def _shade(base: np.ndarray, k: int) -> tuple[float, float, float]:
    f = _SHADES[k % len(_SHADES)]
    rgb = base + (1 - base) * f if f > 0 else base * (1 + f)
    return tuple(float(c) for c in rgb)


def backend_colour(label: str) -> tuple[float, float, float]:
    """The colour of a backend label alone: its backend's hue (registry order; a plugin's from hues no
    registry backend has), its variant a shade of it (the class's variant order)."""
    name, variant, _ = _label_parts(label)
    return _shade(_hue(name), _shade_index(name, variant))


#: a marker per variant of a backend (its place among the class's variants), so that variants whose
#: shades lie close still read apart
MARKERS = ["o", "s", "D", "^", "v", "P", "X", "h"]


def backend_marker(label: str) -> str:
    """The marker of a backend label: its variant's, the default variant a circle."""
    name, variant, _ = _label_parts(label)
    return MARKERS[_shade_index(name, variant) % len(MARKERS)]


def _palette(sns, labels) -> dict:
    """A colour per backend label of one plot: each backend's fixed hue, its variants their fixed shades
    (:func:`backend_colour`); where two labels of the plot would share a colour (versions of one variant,
    a variant whose shade another took), the later ones, in label order, take the next free shade."""
    out, taken = {}, {}
    for label in sorted(set(labels), key=lambda l: (_label_parts(l)[0], _label_parts(l)[2], str(l))):
        name, variant, _ = _label_parts(label)
        used = taken.setdefault(name, set())
        k = _shade_index(name, variant)
        while k % len(_SHADES) in used and len(used) < len(_SHADES):
            k += 1
        used.add(k % len(_SHADES))
        out[label] = _shade(_hue(name), k)
    return out


def _log_axis(axis, fmt) -> None:
    """Readable labels on a log axis (call after plotting): 1-2-5 ticks on short ranges, fewer on long ones."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = sorted(abs(v) for v in axis.get_view_interval())
    decades = np.log10(hi / lo) if lo > 0 else 10
    subs = (1.0, 2.0, 5.0) if decades <= 2.5 else (1.0, 3.0) if decades <= 4 else (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: fmt(v)))
    axis.set_minor_formatter(NullFormatter())


def _seconds_axis(axis) -> None:
    _log_axis(axis, fmt_seconds)


def _number_axis(axis, suffix: str = "") -> None:
    _log_axis(axis, lambda v: f"{v:g}{suffix}")


def _measured_ticks(axis, values) -> None:
    """Log-scaled axis whose ticks are exactly the (integer) values measured."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ticks = sorted({int(v) for v in values})
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(lambda v, _: f"{int(round(v))}")


def direct_labels(ax, ends, fontsize: float = 8) -> None:
    """Name each line of ``ax`` at its right end, in its colour: ``ends`` holds ``(label, x, y, colour)`` of
    each line's last point (data coordinates; call once the lines, scales and limits are set). The x axis
    grows to the right to hold the longest name inside the panel; names that would overlap are nudged apart
    (at least a line of text between two) and joined to their line's end by a thin line of its colour."""
    if not ends:
        return
    fig = ax.figure
    fig.tight_layout()  # the panel at the size it will be drawn: the names are spaced in its points
    ax.autoscale_view()
    width_pt = ax.get_position().width * fig.get_figwidth() * 72
    height_pt = ax.get_position().height * fig.get_figheight() * 72
    pad_pt, lead_pt = 5.0, 12.0
    room = min(0.45, (pad_pt + lead_pt + 0.58 * fontsize * max(len(str(e[0])) for e in ends)) / max(width_pt, 1.0))
    x0, x1 = ax.get_xlim()
    if ax.get_xscale() == "log":
        ax.set_xlim(x0, x1 * (x1 / x0) ** (room / (1 - room)))
    else:
        ax.set_xlim(x0, x1 + (x1 - x0) * room / (1 - room))
    ax.set_ylim(*ax.get_ylim())  # fixed now: the names are placed against these limits
    to_axes = ax.transData + ax.transAxes.inverted()
    at = [tuple(to_axes.transform((float(x), float(y)))) for _, x, y, _ in ends]
    gap = 1.4 * fontsize / max(height_pt, 1.0)  # a line of text and a little air
    order = sorted(range(len(ends)), key=lambda i: at[i][1])
    place = {}
    below = -1.0
    for i in order:  # upwards: each name at its line's end or a line of text above the one below it
        place[i] = max(at[i][1], below + gap, gap / 2)
        below = place[i]
    above = 2.0
    for i in reversed(order):  # then down from the top edge, where the upward pass ran out of room
        place[i] = min(place[i], above - gap, 1 - gap / 2)
        above = place[i]
    from matplotlib.colors import to_rgb

    nudged = [abs(place[i] - at[i][1]) > gap / 3 for i in range(len(ends))]
    # a nudged name's leader runs in the margin left of every name, never through another
    offset = (pad_pt + (lead_pt if any(nudged) else 0.0)) / max(width_pt, 1.0)
    for i, (label, _, _, colour) in enumerate(ends):
        (xf, yf), y_text, moved = at[i], place[i], nudged[i]
        ink = tuple(0.72 * c for c in to_rgb(colour))  # the line's hue, dark enough to read on white
        ax.annotate(str(label), xy=(xf, yf), xycoords="axes fraction",
                    xytext=(xf + offset, y_text), textcoords="axes fraction",
                    va="center", ha="left", fontsize=fontsize, color=ink, annotation_clip=False,
                    arrowprops={"arrowstyle": "-", "color": colour, "lw": 0.6, "shrinkA": 0, "shrinkB": 1,
                                "relpos": (0, 0.5)}
                    if moved else None)


def _grid(n_panels: int, max_cols: int, panel_w: float, panel_h: float):
    """A figure of ``n_panels`` panels, at most ``max_cols`` to a row: ``(plt, sns, fig, axes)``."""
    plt, sns = _setup()
    # as many to a row as fit, with the fewest empty slots (four panels: 2 x 2, not 3 + 1)
    ncol = min(range(1, min(max_cols, n_panels) + 1), key=lambda c: (-(-n_panels // c) * c - n_panels, -c))
    nrow = -(-n_panels // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(panel_w * ncol, panel_h * nrow), squeeze=False)
    return plt, sns, fig, axes


#: the resolution of every PNG plot (a report shows it at the size it was drawn in inches from this)
PLOT_DPI = 144
#: the salt of an SVG's element ids (clip paths, glyphs): fixed, so that a redrawing changes no byte
SVG_SALT = "harness-plot"


def _save(plt, fig, axes, n_panels: int, out: Path, **savefig) -> Path:
    """Hide the unused panels, lay out, write ``out`` (PNG) and an SVG beside it, and free the figure."""
    for ax in axes.flat[n_panels:]:
        ax.set_visible(False)
    fig.tight_layout()
    # by the one write rule: a plot belongs to the run whose plots/ holds it, and no link there is followed
    write_file(out, lambda tmp: fig.savefig(tmp, format="png", dpi=PLOT_DPI, **savefig), run=out.parent.parent)
    # the same drawing writes the same SVG: no date in its metadata, element ids from a fixed salt (not uuid4)
    with plt.rc_context({"svg.hashsalt": SVG_SALT}):
        write_file(out.with_suffix(".svg"), lambda tmp: fig.savefig(tmp, format="svg", metadata={"Date": None}, **savefig),
                   run=out.parent.parent)
    plt.close(fig)
    return out
