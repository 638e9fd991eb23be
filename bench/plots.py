"""PNG plots of a ``bench.serving`` result (and of the run before it, side by side, when given)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["bars", "plot"]


def bars(ax: Any, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str) -> None:
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)


def plot(result: dict[str, Any], before: dict[str, Any] | None, directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = result["detail"]
    tiny, vit = d["s1_tiny"], d["s1_vitb32"]
    paths = []

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    bars(a, ["tiny", "ViT-B/32"], {
        "bare batched (in-process)": [tiny["bare_images_per_s"], vit["bare_images_per_s"]],
        "server, 16 concurrent": [tiny["server_images_per_s"], vit["server_images_per_s"]],
    }, "images/s", "S1 throughput, unique 640x480 JPEGs")
    bars(b, ["tiny", "ViT-B/32"], {
        "bare batch-1": [tiny["bare_batch1_ms"], vit["bare_batch1_ms"]],
        "server, raw body": [tiny["server_raw_p50_ms"], vit["server_raw_p50_ms"]],
        "server, JSON base64": [tiny["server_json_p50_ms"], vit["server_json_p50_ms"]],
    }, "ms (p50)", "S1 one request at a time")
    fig.tight_layout()
    paths.append(directory / "s1.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    two = d["s2"]
    sizes = ["64", "576", "2500"]
    fig, ax = plt.subplots(figsize=(8, 4))
    bars(ax, [f"{n} x 1024" for n in sizes], {
        "raw wire, safetensors bytes": [two[f"safetensors_{n}"]["raw_gb_s"] for n in sizes],
        "server, safetensors": [two[f"safetensors_{n}"]["server_gb_s"] for n in sizes],
        "raw wire, JSON bytes": [two[f"json_{n}"]["raw_gb_s"] for n in sizes],
        "server, JSON": [two[f"json_{n}"]["server_gb_s"] for n in sizes],
    }, "GB/s of embedding", "S2 hash-only hits, one at a time")
    fig.tight_layout()
    paths.append(directory / "s2.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    bars(a, ["local hit", "Redis hit", "encode"], {"p50 ms": [
        result["s4_redis_vs_local"]["local_ms"], result["s4_redis_vs_local"]["redis_ms"],
        result["s4_redis_vs_local"]["encode_ms"],
    ]}, "ms", "S4 1 MiB of embeddings per request")
    bars(b, ["hit as JSON b64", "hit as raw", "hash-only hit", "/health"], {"p50 ms": [
        tiny["hit_json_p50_ms"], tiny["hit_raw_p50_ms"], tiny["hit_hash_p50_ms"], tiny["health_p50_ms"],
    ]}, "ms", "A cache hit, by how it is sent (tiny tower)")
    fig.tight_layout()
    paths.append(directory / "hits.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    if before is not None:
        keys = ["s1_ratio", "s1_ratio_tiny", "s2_ratio_safetensors", "s2_ratio_json", "s3_speedup",
                "s5_upload_bytes_ratio", "hashfirst_allmiss_ratio"]
        ms_keys = [("s1_overhead_ms", "raw"), ("s1_overhead_ms", "json"), ("upload_hit_overhead_ms", None)]
        fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [2.2, 1]})
        bars(a, [k.replace("_ratio", "\nratio").replace("_speedup", "\nspeedup") for k in keys], {
            "before": [float(before[k]) for k in keys], "after": [float(result[k]) for k in keys],
        }, "ratio", "Before and after (higher is better, but s5: lower)")

        def ms(r: dict[str, Any], key: str, sub: str | None) -> float:
            return float(r[key][sub] if sub else r[key])

        bars(b, ["overhead raw", "overhead JSON", "JSON hit - raw hit"], {
            "before": [ms(before, k, s) for k, s in ms_keys], "after": [ms(result, k, s) for k, s in ms_keys],
        }, "ms", "Serving overhead, tiny tower (lower is better)")
        fig.tight_layout()
        paths.append(directory / "before_after.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
