"""Checkpoint tiers: node memory, durable storage, peer replicas, and the manager over them."""

from .manager import CheckpointManager, SaveFigures, SaveHandle, TierFullError

__all__ = ["CheckpointManager", "SaveFigures", "SaveHandle", "TierFullError"]
