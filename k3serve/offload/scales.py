"""Calibrated fp8 latent scales beside a tier directory (issue 63 item 1): `kv_scales.json`
holds the first engine's scales (layer -> s), and the entries written under a set of scales live
in a folder named after them, so engines that calibrated other scales on the same directory
never read each other's latents."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger("k3serve.offload")
SCALES_FILE = "kv_scales.json"


def scales_folder(root: Path, scales: dict[int, float]) -> Path:
    """The folder of the entries written under `scales`: 16 hex digits of their values."""
    text = json.dumps({str(i): float(s).hex() for i, s in sorted(scales.items())})
    return root / f"scales-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def saved_scales(root: Path) -> dict[int, float] | None:
    """The scales saved in `root` (the first engine's), or None: none yet, or unreadable."""
    path = root / SCALES_FILE
    try:
        return {int(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError, AttributeError) as e:
        log.warning("prefix tier: %s is unreadable (%s): calibrating anew", path, e)
        return None


def save_scales(root: Path, scales: dict[int, float]) -> Path:
    """Make the folder of `scales` and save them as root's scales unless a set is there already
    (os.link: the first set stays). Returns the folder; OSError when root cannot be written."""
    folder = scales_folder(root, scales)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{SCALES_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({str(i): s for i, s in scales.items()}))
    try:
        os.link(tmp, root / SCALES_FILE)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return folder
