"""A kernel repo's record of the ahead-of-time compiles that passed, committed beside its build.toml.

`tpu-kernels check REPO --record` writes `REPO/aot_record.json` after its full sweep: every declared target that
compiled, per generation, with its argument shapes and the flops the compiler reported, under the fingerprint of
what decided those compiles (`aot.compile_fingerprint`: the built variant's content digest, which covers every
file of the kernel and its compile targets; the lowering code; the compiler libraries' versions; libtpu's flags).

A test run that reads the record (`compile_kernel(..., record=...)`) does not compile a target the record covers:
same fingerprint, generation, label and shapes. A record made from other sources or other versions covers nothing,
so a kernel change gets its full compile sweep until a new record is written. Per generation, one covered target
(a different one for each fingerprint) is compiled anyway and must give the recorded flops: a record whose claims
do not reproduce is dropped and every target compiled.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

RECORD_FILE = "aot_record.json"
WRITTEN_BY = "tpu-kernels check --record"


def shapes_text(avals) -> str:
    """A target's argument shapes as one line, e.g. "512x2048 bfloat16; 128 int32"."""
    return "; ".join(f"{'x'.join(map(str, a.shape)) or 'scalar'} {a.dtype}" for a in avals)


@dataclass(frozen=True)
class AotRecord:
    fingerprint: dict
    compiled: dict  # generation -> label -> {"shapes": shapes_text, "flops": float | None}

    @classmethod
    def read(cls, path: Path) -> AotRecord | None:
        """The record at `path`; None when there is none or it is not one (it then covers nothing)."""
        try:
            data = json.loads(Path(path).read_text())
            record = cls(dict(data["fingerprint"]), {g: dict(t) for g, t in data["compiled"].items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return record

    def write(self, path: Path) -> None:
        data = {"written_by": WRITTEN_BY, "fingerprint": self.fingerprint, "compiled": self.compiled}
        Path(path).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")

    def entry(self, fingerprint: dict | None, generation: str, label: str, avals) -> dict | None:
        """The recorded compile of this target, if the record covers it at `fingerprint`."""
        if fingerprint is None or fingerprint != self.fingerprint:
            return None
        entry = self.compiled.get(generation, {}).get(label)
        if not isinstance(entry, dict) or entry.get("shapes") != shapes_text(avals):
            return None
        return entry

    def spot_check(self, generation: str, covered_labels: list[str]) -> str | None:
        """Which of the covered targets of `generation` is compiled anyway: chosen by the fingerprint, so each
        change of sources or versions checks another one."""
        if not covered_labels:
            return None
        seed = json.dumps([self.fingerprint, generation], sort_keys=True).encode()
        return covered_labels[int(hashlib.sha256(seed).hexdigest(), 16) % len(covered_labels)]

    def updated(self, fingerprint: dict, results) -> AotRecord:
        """This record with the compiles that passed in `results` (aot.CompileResult) replacing those of their
        generations; entries under another fingerprint are dropped."""
        compiled = dict(self.compiled) if fingerprint == self.fingerprint else {}
        for generation in {r.generation for r in results}:
            compiled[generation] = {r.label: {"shapes": r.shapes, "flops": r.flops}
                                    for r in results if r.generation == generation and r.compiled}
        return AotRecord(fingerprint, compiled)


EMPTY = AotRecord({}, {})
