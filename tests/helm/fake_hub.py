"""A stand-in for the Hugging Face Hub (no network here): a `huggingface_hub` module whose
snapshot_download copies a repository from a local folder (only the files allow_patterns
selects, as the real one does) and logs each call with the environment it saw. Put on the
PYTHONPATH of init containers only; the services keep the real library."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

MODULE = """
import fnmatch, json, os, shutil
from pathlib import Path
from typing import Any

def snapshot_download(repo_id, *, revision=None, local_dir=None, allow_patterns=None,
                      max_workers=8, **_):
    source = Path(os.environ["FAKE_HUB_ROOT"]) / repo_id
    if not source.is_dir():
        raise FileNotFoundError(f"404: repository {repo_id} not found")
    target = Path(local_dir)
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        name = path.relative_to(source).as_posix()
        if allow_patterns and not any(fnmatch.fnmatch(name, p) for p in allow_patterns):
            continue
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target / name)
        copied.append(name)
    call = {
        "repo_id": repo_id, "revision": revision, "local_dir": str(target),
        "allow_patterns": allow_patterns, "max_workers": max_workers, "files": copied,
        "HF_TOKEN": os.environ.get("HF_TOKEN"), "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE"),
    }
    with open(os.environ["FAKE_HUB_LOG"], "a") as log:
        log.write(json.dumps(call) + "\\n")
    return str(target)
"""


def install_fake_hub(folder: Path, repos: dict[str, Path]) -> dict[str, str]:
    """Serve `repos` (repo id -> checkpoint folder) from a fake Hub under `folder`; returns the
    environment that makes an init container use it."""
    (folder / "lib" / "huggingface_hub").mkdir(parents=True)
    (folder / "lib" / "huggingface_hub" / "__init__.py").write_text(MODULE)
    for repo_id, source in repos.items():
        shutil.copytree(source, folder / "repos" / repo_id)
    return {
        "PYTHONPATH": str(folder / "lib"),
        "FAKE_HUB_ROOT": str(folder / "repos"),
        "FAKE_HUB_LOG": str(folder / "calls.jsonl"),
    }


def hub_calls(env: dict[str, str]) -> list[dict[str, Any]]:
    log = Path(env["FAKE_HUB_LOG"])
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]
