"""Which tasks of a step are done: the marker files under ``RUN/<step>/``.

``completions/{rank:05d}`` (a map rank: empty, written last, after the rank's parts and stats),
``completions/reduced`` (the reduce: the digest of ``reduced/``), ``completions/apply-{rank:05d}``
(an apply rank: the reduce digest it applied), ``completions/finalized``; ``failures/{rank}`` (the
traceback of a task that raised), ``logs/task_{rank:05d}.log``, ``stats/{rank:05d}.json`` merged into
``stats.json``. Only a marker says a task is done: a half-written part is never mistaken for one.
"""
from __future__ import annotations

import json
from pathlib import Path

from ovpipe.step import Stats, save_json

FINALIZED = "finalized"
REDUCED = "reduced"         # completions/reduced: the reduce ran; it holds the digest of reduced/
APPLY = "apply"             # apply-phase markers: completions/apply-{rank:05d} (content: the reduce digest applied)


def rank_name(rank: int, phase: str = "map") -> str:
    """The name of a rank's marker files: ``00003`` (map, as every step always had), ``apply-00003``."""
    return f"{rank:05d}" if phase == "map" else f"{phase}-{rank:05d}"


def reduce_digest(sdir: Path) -> str | None:
    """The digest of the reduce's artifacts recorded when it completed (None: not reduced)."""
    try:
        return (Path(sdir) / "completions" / REDUCED).read_text().strip() or None
    except OSError:
        return None


def is_reduced(sdir: Path) -> bool:
    return reduce_digest(sdir) is not None


def mark_reduced(sdir: Path) -> str:
    """Record the reduce as done, with a digest of ``reduced/*`` (names + bytes): an apply rank done
    under another digest (the reduce was redone and came out different) is pending again."""
    import hashlib

    h = hashlib.sha256()
    rdir = Path(sdir) / "reduced"
    for f in sorted(p for p in rdir.rglob("*") if p.is_file() and not p.name.startswith(".")) if rdir.is_dir() else []:
        h.update(str(f.relative_to(rdir)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    digest = h.hexdigest()[:16]
    fp = failure_path(sdir, 0, "reduce")
    fp.unlink(missing_ok=True)
    from manifests.io import atomic_write   # (pyarrow: not at import, so `ovpipe status` stays light)

    with atomic_write(Path(sdir) / "completions" / REDUCED) as tmp:
        tmp.write_text(digest + "\n")
    return digest


def done_ranks(sdir: Path, phase: str = "map") -> set[int]:
    """Ranks with a completion marker. Apply ranks count only if they applied the current reduce."""
    comp = sdir / "completions"
    if not comp.is_dir():
        return set()
    if phase == "map":
        return {int(p.name) for p in comp.iterdir() if p.name.isdigit()}
    digest = reduce_digest(sdir)
    if digest is None:
        return set()
    prefix = f"{phase}-"
    out = set()
    for p in comp.iterdir():
        if p.name.startswith(prefix) and p.name[len(prefix):].isdigit():
            try:
                if p.read_text().strip() == digest:
                    out.add(int(p.name[len(prefix):]))
            except OSError:
                pass
    return out


def pending_ranks(sdir: Path, tasks: int, phase: str = "map") -> list[int]:
    done = done_ranks(sdir, phase)
    return [r for r in range(tasks) if r not in done]


def failure_path(sdir: Path, rank: int, phase: str = "map") -> Path:
    return sdir / "failures" / ("reduce" if phase == "reduce" else rank_name(rank, phase))


def running_path(sdir: Path, rank: int, phase: str = "map") -> Path:
    return sdir / "running" / ("reduce" if phase == "reduce" else rank_name(rank, phase))


def log_path(sdir: Path, rank: int, phase: str = "map") -> Path:
    """``logs/task_00003.log`` (map), ``logs/apply_00003.log``, ``logs/reduce.log``."""
    if phase == "reduce":
        return sdir / "logs" / "reduce.log"
    return sdir / "logs" / f"{'task' if phase == 'map' else phase}_{rank:05d}.log"


def mark_done(sdir: Path, rank: int, phase: str = "map") -> None:
    fp = failure_path(sdir, rank, phase)
    if fp.exists():
        fp.unlink()
    marker = sdir / "completions" / rank_name(rank, phase)
    if phase == "map":
        marker.touch()
    else:
        marker.write_text((reduce_digest(sdir) or "") + "\n")


def is_finalized(sdir: Path) -> bool:
    return (sdir / "completions" / FINALIZED).exists()


def write_failure(sdir: Path, rank: int, text: str, phase: str = "map") -> None:
    from manifests.io import atomic_write

    with atomic_write(failure_path(sdir, rank, phase)) as tmp:
        tmp.write_text(text)


def merge_stats(sdir: Path, tasks: int) -> dict:
    """Per-rank stats plus the finalize stats, summed into ``stats.json``."""
    files = sorted((sdir / "stats").glob("*.json"))
    merged = Stats.merge([json.loads(f.read_text()) for f in files])
    merged["tasks"] = tasks
    save_json(sdir / "stats.json", merged)
    return merged
