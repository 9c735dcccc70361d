"""Host memory: page-aligned arenas and their leases, the engine's arenas, and a snapshot's
place aside while the memory it goes to is being made."""
