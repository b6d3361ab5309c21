"""Model sources: what `--model` names, Hub ids through a stand-in Hub, tokenizer look-up."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve_runtime.model_source import resolve_model, resolve_tokenizer
from splitserve_runtime.model_spec import ModelSourceError, model_kind, served_model_name
from tests.fixtures.hub_server import HubStandIn

REPO = "acme/tiny-llama"


@pytest.fixture(scope="module")
def revisions(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """main: the tiny model; v1: the same without its chat template (tell-apart content)."""
    v1 = tmp_path_factory.mktemp("hub-v1") / "tiny"
    shutil.copytree(tiny_model_dir, v1)
    (v1 / "chat_template.jinja").unlink()
    return {"main": tiny_model_dir, "v1": v1}


@pytest.fixture(scope="module")
def hub(revisions: dict[str, Path]) -> Iterator[HubStandIn]:
    server = HubStandIn({REPO: revisions}).start()
    yield server
    server.stop()


@pytest.fixture
def hub_env(hub: HubStandIn, tmp_path: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_TOKEN": "hf_x"}


def test_kinds_and_served_names(tiny_model_dir: Path, tmp_path: Path) -> None:
    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    assert [model_kind(s) for s in ("", "tiny", str(tiny_model_dir), str(gguf), REPO)] == [
        "default",
        "tiny",
        "folder",
        "gguf",
        "hub",
    ]
    assert served_model_name("") == "SmolLM2-135M-Instruct"
    assert served_model_name("tiny") == "tiny-llama-v1"
    assert served_model_name(str(tiny_model_dir) + "/") == tiny_model_dir.name
    assert served_model_name(str(gguf)) == "m.Q4_1"
    assert served_model_name(REPO) == REPO


def test_tiny_resolves_to_the_locally_built_model(tiny_model_dir: Path) -> None:
    env = {"SPLITSERVE_CACHE_DIR": str(tiny_model_dir.parent)}
    assert resolve_model("tiny", "", env).path == tiny_model_dir


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("./no/such/folder", "does not exist"),
        ("/no/such", "does not exist"),
        ("not a hub id/at all/x", "does not exist"),
    ],
)
def test_missing_paths_are_one_line_errors(spec: str, needle: str) -> None:
    with pytest.raises(ModelSourceError, match=needle) as err:
        resolve_model(spec)
    assert "\n" not in str(err.value)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="not a .gguf"):
        resolve_model(str(tmp_path / "model.bin"))


def test_a_folder_needs_config_and_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="has no config.json"):
        resolve_model(str(tmp_path))
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, weights_only / name)
    model = resolve_model(str(weights_only))
    with pytest.raises(ModelSourceError) as err:
        resolve_tokenizer(model)
    message = str(err.value)
    assert "has no tokenizer" in message and "--tokenizer" in message and "\n" not in message
    assert resolve_tokenizer(model, str(tiny_model_dir)).path == tiny_model_dir


def test_hub_id_downloads_the_revision_asked_for(
    hub: HubStandIn, hub_env: dict[str, str], revisions: dict[str, Path]
) -> None:
    main = resolve_model(REPO, "", hub_env)
    v1 = resolve_model(REPO, "v1", hub_env)
    assert main.kind == v1.kind == "hub"
    assert main.path.is_relative_to(hub_env["HF_HUB_CACHE"])
    assert (main.path / "chat_template.jinja").exists()
    assert not (v1.path / "chat_template.jinja").exists()
    assert (main.path / "model.safetensors").read_bytes() == (
        revisions["main"] / "model.safetensors"
    ).read_bytes()
    assert resolve_tokenizer(v1).path == v1.path
    seen = [r for r in hub.requests if r.path.startswith(f"/api/models/{REPO}/revision/")]
    assert {r.path.rsplit("/", 1)[1] for r in seen} >= {"main", "v1"}
    model_requests = [r for r in hub.requests if r.path.startswith(("/api/models/", f"/{REPO}/"))]
    assert {r.authorization for r in model_requests} == {"Bearer hf_x"}


def test_hub_errors_are_one_line(hub_env: dict[str, str]) -> None:
    with pytest.raises(ModelSourceError, match="has no revision 'v9'"):
        resolve_model(REPO, "v9", hub_env)
    with pytest.raises(ModelSourceError, match="'acme/nothing' not found"):
        resolve_model("acme/nothing", "", hub_env)


def test_offline_uses_the_cache_or_names_id_and_cache(
    hub: HubStandIn, hub_env: dict[str, str]
) -> None:
    offline = {**hub_env, "HF_HUB_OFFLINE": "1"}
    with pytest.raises(ModelSourceError) as err:
        resolve_model(REPO, "", offline)
    message = str(err.value)
    assert REPO in message and hub_env["HF_HUB_CACHE"] in message and "\n" not in message
    assert "HF_HUB_OFFLINE" in message
    online = resolve_model(REPO, "", hub_env)
    num_requests = len(hub.requests)
    assert resolve_model(REPO, "", offline).path == online.path
    assert len(hub.requests) == num_requests  # offline: not a single request
