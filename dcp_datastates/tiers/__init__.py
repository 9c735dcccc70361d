"""Checkpoint tiers: node memory, durable storage, peer replicas, and the manager over them."""

from ..errors import TierFullError  # where the tiers' users imported it from
from ._handles import SaveFigures, SaveHandle
from ._manager import CheckpointManager

__all__ = ["CheckpointManager", "SaveFigures", "SaveHandle", "TierFullError"]
