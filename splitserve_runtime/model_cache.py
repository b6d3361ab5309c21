"""splitserve's own cache folder, and building an artefact into it exactly once.

The folder is `$SPLITSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/splitserve`, else
`~/.cache/splitserve`, read when called (never at import). Artefacts are built in a scratch folder
beside their target and renamed into place, so racing processes never see half of one.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

logger = logging.getLogger(__name__)


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Folder that holds splitserve's generated artefacts (read when called, not at import)."""
    env = os.environ if environ is None else environ
    if env.get("SPLITSERVE_CACHE_DIR"):
        return Path(env["SPLITSERVE_CACHE_DIR"])
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "splitserve"


def ensure_built(target: Path, marker: str, build: Callable[[Path], None], what: str) -> Path:
    """`target`, built by `build(folder)` on first use. `marker` is the file whose presence
    means the build finished; `build` receives a fresh folder that does not exist yet."""
    if (target / marker).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building %s in %s (first use)", what, target)
    scratch = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build(scratch / "out")
        try:
            (scratch / "out").rename(target)
        except OSError:
            if not (target / marker).exists():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
