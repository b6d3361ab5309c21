"""Which engine core owns this rank, and what it takes to (re)load a rank that serves.

A rank belongs to the core that loaded it: its CLAIM is the core's identity (the names in its
client certificate; "" under plaintext, where the epoch alone decides) and its epoch (chosen
when the core starts, so a restarted core presents a larger one). On a loaded rank:

    LoadModel from another identity                 -> PERMISSION_DENIED (a stranger)
    LoadModel, same identity, larger epoch          -> allowed: a deliberate takeover, logged
    LoadModel, same identity, equal/smaller epoch   -> FAILED_PRECONDITION (stale or repeated)
    GetKvCapacity / InitializeKvCache / Execute     -> only with the owner's exact claim (the
                                                       epoch in metadata `x-splitserve-owner-epoch`)

A rank with nothing loaded takes LoadModel from any core (the transport already admits only
the core role). Before a loaded rank drops its model for a new LoadModel, the new checkpoint is
checked (`check_model_loadable`), so a bad path leaves the rank serving its owner.

A refusal never names an epoch: under plaintext without --internal-secret the owner's epoch is
its only credential, and a caller that read it could present it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from splitserve_runtime.model_source import resolve_model
from splitserve_runtime.services import OWNER_EPOCH_METADATA_KEY
from worker_svc.model_loader.weights import open_checkpoint
from worker_svc.models.registry import read_model_config

logger = logging.getLogger(__name__)


class OwnershipError(Exception):
    """A call from a core that does not own this rank; `grpc_code` is its status."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class NotOwner(OwnershipError):
    """Another core identity owns this rank."""


class StaleClaim(OwnershipError):
    """The owner's identity, but not its current epoch."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


@dataclass(frozen=True, slots=True)
class Claim:
    """Who calls: the core's certificate identity and its epoch."""

    identity: str
    epoch: int

    def describe(self) -> str:
        return f"{self.identity or 'a plaintext core'} (epoch {self.epoch})"


def claim_from_metadata(identity: str, metadata: Sequence[tuple[str, str | bytes]]) -> Claim:
    """The claim of a call after LoadModel; ValueError when the epoch is not an integer.
    A call without the key claims epoch 0."""
    for key, value in metadata:
        if key == OWNER_EPOCH_METADATA_KEY:
            text = value.decode() if isinstance(value, bytes) else value
            if not text.isdigit():
                raise ValueError(f"metadata {OWNER_EPOCH_METADATA_KEY} must be an unsigned integer")
            return Claim(identity, int(text))
    return Claim(identity, 0)


class Ownership:
    """The rank's owner (thread-safe)."""

    def __init__(self) -> None:
        self._owner: Claim | None = None
        self._lock = threading.Lock()

    @property
    def owner(self) -> Claim | None:
        return self._owner

    def check_load(self, claim: Claim, is_loaded: bool) -> bool:
        """Raise OwnershipError unless `claim` may load now; True when it takes a loaded rank
        over from an older epoch of the same core."""
        with self._lock:
            owner = self._owner
        if not is_loaded or owner is None:
            return False
        if claim.identity != owner.identity:
            raise NotOwner(
                f"this rank is loaded and owned by {owner.identity or 'a plaintext core'}; "
                f"{claim.identity or 'a plaintext core'} may not reload it"
            )
        if claim.epoch <= owner.epoch:
            raise StaleClaim(
                "this rank is already loaded by its core; this LoadModel's epoch is not larger, "
                "so it is refused (only a restarted core, presenting a larger epoch, takes it "
                "over)"
            )
        logger.warning(
            "takeover: %s reloads this rank, which %s had loaded",
            claim.describe(),
            owner.describe(),
        )
        return True

    def loaded_by(self, claim: Claim) -> None:
        with self._lock:
            self._owner = claim

    def check_call(self, claim: Claim) -> None:
        """Raise OwnershipError unless `claim` is the owner's (no owner: anyone)."""
        with self._lock:
            owner = self._owner
        if owner is None or owner == claim:
            return
        if claim.identity != owner.identity:
            raise NotOwner(f"this rank is owned by {owner.identity or 'a plaintext core'}")
        raise StaleClaim(
            "this rank is owned by another epoch of its core than the call's (a core that "
            "restarted took it over)"
        )


def check_model_loadable(model_spec: str, revision: str = "") -> None:
    """Cheap checks that a model can be loaded (its files resolve; config, a known architecture,
    weight files), made before a loaded rank drops its model. Raises FileNotFoundError or
    ValueError."""
    checkpoint = open_checkpoint(resolve_model(model_spec, revision))
    read_model_config(checkpoint.hf_config)  # as its family reads it (LLaVA, Gemma, ...)
