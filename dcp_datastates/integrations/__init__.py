"""Adapters for training frameworks; each module imports its framework only when used.

* :mod:`dcp_datastates.integrations.torchtitan`: torchtitan's ``CheckpointManager``.
"""
