"""padding.json -> its study page's table: what padding sizes to the kernels' shape buckets costs, per model and
entry point."""

from __future__ import annotations

from statistics import median

from benchmarks.studies.tables import markdown_table

# The generation whose HBM rate prices the largest bucket's copies in the table (the JSON has each).
GENERATION = "v6e"


def _overhead(entry: dict) -> float:
    """A bucket's bytes for padding (the pad's copy and the kernel's padded rows) over the real rows' bytes, at the
    worst size it holds."""
    return (entry["pad_copy_bytes"] + entry["kernel_bytes"]) / entry["real_bytes"]


def buckets(data: dict) -> str:
    """Per model and entry point: its buckets, padding's bytes over the real rows' at the worst and the median
    bucket, and the largest bucket's padding time at `GENERATION`'s HBM rate."""
    rows = []
    for model, found in data["models"].items():
        for entry_point, entries in found["entry_points"].items():
            overheads = [_overhead(entry) for entry in entries]
            largest = entries[-1]
            seconds = largest["pad_copy_seconds"][GENERATION] + largest["kernel_seconds"][GENERATION]
            rows.append([model, f"`{entry_point}`", f"{len(entries)}: {entries[0]['bucket']:,} to "
                         f"{largest['bucket']:,}", f"{max(overheads):.1f}x", f"{median(overheads):.2f}x",
                         f"{largest['bucket']:,}: {seconds * 1e6:.1f}"])
    return markdown_table(["model", "entry point", "buckets", "padding bytes / real bytes, worst bucket",
                           "median bucket", f"largest bucket: padding µs at {GENERATION}'s HBM rate"],
                          "| --- | --- | --- | ---: | ---: | ---: |", rows)


def render_markdown(data: dict) -> dict[str, str]:
    return {"buckets": buckets(data)}
