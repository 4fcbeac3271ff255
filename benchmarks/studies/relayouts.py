"""What a benchmark row says of the copies XLA makes around a kernel call: a user's call hands the kernel arrays
in XLA's default layouts, and XLA copies any the kernel reads in another layout (and results back) on every call
(`perf.argument_layouts`). Shared by every benchmark that charges them (attention, paged_attention, cb_step)."""

from __future__ import annotations

from benchmarks.perf import argument_layouts

NOT_PROBED = "not charged: the program around the kernel was not probed"


def relayouts(fn, inputs, generation: str) -> argument_layouts.LayoutProbe | dict:
    """The copies into other layouts XLA makes of `fn`'s arguments and results when a user jits it as it is
    called (arguments in XLA's default layouts), or {"error": why} if it does not compile."""
    try:
        return argument_layouts.probe(fn, inputs, generation)
    except Exception as error:  # noqa: BLE001 - a program that does not compile is a row with the reason
        return {"error": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"}


def relayout_fields(found) -> dict:
    """What a row says of the relayout copies of a probe (`relayouts`: their µs at the fitted share and at the
    peak, bytes, and which; or why there are none to charge); None: not probed, and why."""
    if found is None:
        return {"relayout_us": None, "relayout_missing": NOT_PROBED}
    if isinstance(found, dict):
        return {"relayout_us": None, "relayout_missing": f"not charged: the program did not compile: {found['error']}"}
    return {"relayout_us": found.seconds() * 1e6, "relayout_at_peak_bw_us": found.seconds(hbm_fraction=1.0) * 1e6,
            "relayout_hbm_bytes": found.hbm_bytes, "relayouts": [copy.describe() for copy in found.copies]}
