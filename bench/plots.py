"""PNG plots of a sweep (busbw against size) and of the scaling model (efficiency against ranks).

matplotlib is imported here, inside the functions, with the file-only Agg backend: the rest of the
benchmark works without it (it comes with the `bench` extra), and plotting must not need a display.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from collectives.backends.errors import BackendUnavailableError

from .measure import COPY_BOUND, OUT_OF_PLACE, SweepResult
from .scaling import Preset, ScalingPoint


def require_matplotlib() -> None:
    """Raise `BackendUnavailableError` naming the `bench` extra if matplotlib is missing.

    Commands call it before measuring, so a missing package fails at once, not after the sweep.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BackendUnavailableError("plots", "matplotlib", "bench") from None


def _pyplot() -> Any:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def size_label(nbytes: float) -> str:
    """4096 -> '4K', 1048576 -> '1M': the nccl-tests way of writing sizes."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{int(nbytes // scale)}{unit}"
    return f"{int(nbytes)}"


def plot_busbw(result: SweepResult, path: str, title: str) -> None:
    """busbw (GB/s) against size, one line per algorithm (out-of-place), copy-bound dashed.

    For all-reduce a ring marks, at every size, the algorithm auto picks there (`comm.explain`).
    """
    plt = _pyplot()
    rows = [r for r in result.rows if r.placement == OUT_OF_PLACE and r.nbytes > 0]  # log axes have no 0
    fig, ax = plt.subplots(figsize=(8, 5))
    algorithms = list(dict.fromkeys(r.algorithm for r in rows))
    for algorithm in algorithms:
        line = sorted((r.nbytes, r.busbw / 1e9) for r in rows if r.algorithm == algorithm)
        style = dict(color="grey", linestyle="--") if algorithm == COPY_BOUND else dict(marker=".")
        ax.plot(
            [x for x, _ in line],
            [y for _, y in line],
            label=f"{algorithm} (ceiling)" if algorithm == COPY_BOUND else algorithm,
            **style,
        )
    picks = [(r.nbytes, r.busbw / 1e9) for r in rows if result.choices.get(r.nbytes) == r.algorithm]
    if picks:
        ax.scatter(
            [x for x, _ in picks],
            [y for _, y in picks],
            s=120,
            facecolors="none",
            edgecolors="black",
            linewidths=1.5,
            label="auto's pick (model)",
            zorder=3,
        )
    sizes = sorted({r.nbytes for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([size_label(s) for s in sizes], rotation=45 if len(sizes) > 10 else 0)
    ax.minorticks_off()
    ax.set_xlabel("message size (bytes per rank)")
    ax.set_yscale("log")  # small sizes are 100x below large ones; a linear axis hides them
    ax.set_ylabel("bus bandwidth (GB/s, log scale)")
    ax.set_title(title, fontsize=9, wrap=True)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_COLORS = {"ring": "tab:blue", "hierarchical": "tab:green", "auto": "tab:red", "parameter_server": "tab:purple"}
_MARKERS = {"simulated": "s", "measured": "X"}


def plot_scaling(points: Sequence[ScalingPoint], path: str, title: str, note: str) -> None:
    """Efficiency (%) against rank count: model lines, simulated and measured points as markers.

    Line style tells the cluster kinds apart, colour the algorithm; `note` (the model's
    assumptions) is printed under the axes.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(13, 6))
    clusters = list(dict.fromkeys(p.cluster for p in points))
    styles = ["-", "--", ":", "-."]
    for cluster, algorithm, source in dict.fromkeys((p.cluster, p.algorithm, p.source) for p in points):
        curve = sorted(
            (p.ranks, p.efficiency * 100)
            for p in points
            if (p.cluster, p.algorithm, p.source) == (cluster, algorithm, source)
        )
        label = f"{algorithm}: {cluster}" + ("" if source == "model" else f" [{source}]")
        color = _COLORS.get(algorithm, "black")
        style = styles[clusters.index(cluster) % len(styles)]
        if source == "model" and algorithm == "auto":  # a wide band under the line auto follows
            ax.plot(*zip(*curve), color=color, label=label, linewidth=7, alpha=0.25, zorder=1)
        elif source == "model":
            ax.plot(*zip(*curve), color=color, linestyle=style, label=label, linewidth=1.6, zorder=2)
            _label_servers(
                ax, [p for p in points if (p.cluster, p.algorithm, p.source) == (cluster, algorithm, source)]
            )
        else:
            ax.scatter(
                *zip(*curve),
                color=color,
                marker=_MARKERS.get(source, "o"),
                facecolors="none" if source == "simulated" else color,
                s=60,
                label=label,
                zorder=3,
            )
    _efficiency_axes(ax, sorted({p.ranks for p in points}), "ranks (GPUs)")
    ax.set_ylabel("scaling efficiency (%) = compute / (compute + exposed communication)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: no point hidden
    fig.text(0.01, 0.01, note, fontsize=7, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _efficiency_axes(ax: Any, ranks: Sequence[int], xlabel: str) -> None:
    """Rank counts on a log2 axis, each one a tick; efficiency from 0 to 105%."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks)
    ax.set_xticklabels([str(r) for r in ranks])
    ax.minorticks_off()
    ax.set_ylim(0, 105)
    ax.set_xlabel(xlabel)


def _label_servers(ax: Any, points: Sequence[ScalingPoint]) -> None:
    """Write the best number of servers S next to each parameter-server point."""
    for point in points:
        if point.num_servers is not None:
            ax.annotate(
                f"S={point.num_servers}",
                (point.ranks, point.efficiency * 100),
                textcoords="offset points",
                xytext=(0, -11),
                ha="center",
                fontsize=6,
                color=_COLORS["parameter_server"],
            )


def plot_presets(presets: Sequence[Preset], points: Mapping[str, Sequence[ScalingPoint]], path: str) -> None:
    """One panel per preset: TensorFlow 1.1's parameter servers (best S labelled), ring and
    hierarchical from the model, and the published efficiencies as black crosses."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(presets), figsize=(4.2 * len(presets), 4.4), squeeze=False, sharey=True)
    for ax, preset in zip(axes[0], presets):
        for algorithm, style in (("parameter_server", "-"), ("ring", "--"), ("hierarchical", ":")):
            curve = sorted((p for p in points[preset.name] if p.algorithm == algorithm), key=lambda p: p.ranks)
            label = (
                "TF 1.1 parameter servers (best S)"
                if algorithm == "parameter_server"
                else f"{algorithm} (this library)"
            )
            ax.plot(
                [p.ranks for p in curve],
                [p.efficiency * 100 for p in curve],
                color=_COLORS[algorithm],
                linestyle=style,
                marker=".",
                label=label,
            )
            _label_servers(ax, curve)
        if preset.published:
            ax.scatter(
                *zip(*((gpus, efficiency * 100) for gpus, efficiency in preset.published)),
                marker="x",
                color="black",
                s=50,
                label="published (TF 1.1, parameter servers)",
                zorder=3,
            )
        _efficiency_axes(ax, sorted({p.ranks for p in points[preset.name]}), "GPUs")
        ax.set_title(f"{preset.name} ({preset.gpus_per_node} GPU/node)", fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("scaling efficiency (%)")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle("InceptionV3, batch 64 per GPU: model from hardware figures vs published", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
