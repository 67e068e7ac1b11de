"""Saved routing statistics: each layer's pick counts, kept across starts to warm the tiers and the policies.

One JSON file per checkpoint identity under the cache dir, written atomically; a file that does not match the
model exactly is ignored with a reason (a cold start is slower, never an error).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

STATS_FORMAT = 1  # bump when the routing-stats file layout changes; older files are ignored, not misread


def routing_key(model_dir: str | os.PathLike) -> str:
    """The identity a checkpoint's routing statistics are saved under: its directory name and config.json hash."""
    import hashlib

    digest = hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()[:16]
    return f"{Path(model_dir).name}-{digest}"


def saved_routing(cache_dir: str | os.PathLike, model_dir: str | os.PathLike, num_layers: int,
                  num_experts: int) -> tuple[np.ndarray | None, str]:
    """The statistics an earlier run of checkpoint `model_dir` saved under `cache_dir`: (counts or None, why)."""
    key = routing_key(model_dir)
    return load_routing_stats(routing_stats_path(cache_dir, key), key, num_layers, num_experts)


def routing_stats_path(cache_dir: str | os.PathLike, model_key: str) -> Path:
    """Where one model's routing statistics live under the cache dir (one file per model identity)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_key)
    return Path(cache_dir) / f"routing-{safe}.json"


def save_routing_stats(path: str | os.PathLike, counts: np.ndarray, model_key: str, steps: int = 0) -> None:
    """Write per-layer pick statistics (num_layers, num_experts) as JSON, atomically (write aside, rename).

    A crash mid-write leaves the previous file intact; a half-written file would cost a cold start.
    """
    counts = np.asarray(counts, np.float64)
    doc = {
        "format": STATS_FORMAT,
        "model": model_key,
        "num_layers": int(counts.shape[0]),
        "num_experts": int(counts.shape[1]),
        "steps": int(steps),
        "counts": [[round(float(c), 4) for c in row] for row in counts],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_routing_stats(
    path: str | os.PathLike, model_key: str, num_layers: int, num_experts: int
) -> tuple[np.ndarray | None, str]:
    """Read statistics saved by `save_routing_stats`; returns (counts or None, reason).

    Anything that does not match this model exactly (missing, unreadable, other format, other model, other
    shape, negative or non-finite counts) yields None with the reason, for a start-up log line: a cold cache is
    slower, a cache warmed from another model's routing is merely wrong-headed, never an error.
    """
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"no routing statistics at {path} (cold start)"
    except (OSError, ValueError) as e:
        return None, f"unreadable routing statistics {path}: {e}"
    if not isinstance(doc, dict) or doc.get("format") != STATS_FORMAT:
        return None, f"{path}: format {doc.get('format') if isinstance(doc, dict) else '?'}, expected {STATS_FORMAT}"
    if doc.get("model") != model_key:
        return None, f"{path}: statistics of model {doc.get('model')!r}, not {model_key!r}"
    try:
        counts = np.asarray(doc["counts"], np.float64)
    except (KeyError, TypeError, ValueError) as e:
        return None, f"{path}: bad counts: {e}"
    if counts.shape != (num_layers, num_experts):
        return None, f"{path}: counts shape {counts.shape}, expected ({num_layers}, {num_experts})"
    if not np.all(np.isfinite(counts)) or np.any(counts < 0):
        return None, f"{path}: counts not finite and non-negative"
    return counts, f"loaded routing statistics from {path} ({doc.get('steps', 0)} steps)"
