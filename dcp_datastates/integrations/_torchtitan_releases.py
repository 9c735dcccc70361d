"""torchtitan's releases: one object per release this adapter supports, chosen once at import
(:data:`TORCHTITAN`), holding everything that differs between them."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class TorchtitanAPI:
    """The torchtitan installed: :class:`_Titan03` or :class:`_Titan02`, one per release the
    adapter supports, holding everything that differs between them; this class itself where
    torchtitan cannot be imported (``error`` says why).

    ``dcp_save``, ``dcp_load``, the async modes, the step folders and the manager's attributes
    the adapter reads are the same in both.
    """

    version: str | None = None
    """torchtitan's version; None where it cannot be imported (see ``error``)."""

    manager: type | None = None
    """torchtitan's ``CheckpointManager``."""

    config: type | None = None
    """Its config class: ``CheckpointManager.Config`` (0.3.x), ``torchtitan.config.Checkpoint``
    (0.2.x)."""

    error: str | None = None
    """Why torchtitan could not be imported."""

    legacy: ClassVar[bool] = False
    """torchtitan 0.2.x."""

    save_hook: ClassVar[str] = "_save"
    """The method a manager subclass overrides to change ``save``."""

    load_hook: ClassVar[str] = "_load"
    """The method a manager subclass overrides to change ``load``."""

    config_arg: ClassVar[str] = "config"
    """The name of the manager constructor's config argument."""

    def build(self, manager_cls: type, config: Any, **kwargs: Any) -> Any:
        """A manager of ``manager_cls`` from ``config`` and what torchtitan's trainer passes
        (``dataloader=``, ``model_parts=``, ``optimizers=``, ``lr_schedulers=``, ``states=``,
        ``sd_adapter=``, ``base_folder=``; ``engine=`` for :class:`DataStatesCheckpointManager`),
        as 0.3's ``config.build(...)`` and 0.2.x's trainer make one."""
        return manager_cls(**{self.config_arg: config}, **kwargs)

    def config_of(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The config among the arguments of a manager's constructor."""
        if self.config_arg in kwargs:
            return kwargs[self.config_arg]
        manager: Any = self.manager  # torchtitan's class (no stubs)
        bound = inspect.signature(manager.__init__).bind_partial(None, *args, **kwargs)
        return bound.arguments[self.config_arg]

    def containers(self, model_parts: list[Any], lr_lambda: Callable[[int], float],
                   implementation: str = "for-loop", **adamw: Any) -> tuple[Any, Any]:
        """torchtitan's own ``OptimizersContainer`` (AdamW with ``adamw``) over ``model_parts``
        and its ``LRSchedulersContainer`` (``lr_lambda``), made as each release makes them: what
        a manager saves besides the model, for code that drives one without a trainer."""
        raise ImportError(f"torchtitan cannot be imported: {self.error}")

    def load_replica_state(self, manager: Any) -> None:
        """Load a torchft replica's own state, as torchtitan's load does first (0.2.x only)."""


@dataclass(frozen=True)
class _Titan03(TorchtitanAPI):
    """torchtitan 0.3.x: Python configs; ``CheckpointManager.Config(...).build(dataloader=...,
    ...)`` makes a manager (``CheckpointManager(config, *, dataloader=..., ...)``); a subclass
    overrides the ``_save`` and ``_load`` hooks of ``BaseCheckpointManager``."""

    def containers(self, model_parts: list[Any], lr_lambda: Callable[[int], float],
                   implementation: str = "for-loop", **adamw: Any) -> tuple[Any, Any]:
        from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
        from torchtitan.components.optimizer.optimizer import ParamGroupConfig

        optimizers = OptimizersContainer(
            OptimizersContainer.Config(
                param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                               optimizer_kwargs=adamw)],
                implementation=implementation),
            model_parts=model_parts)
        return optimizers, LRSchedulersContainer(optimizers, lr_lambda)


@dataclass(frozen=True)
class _Titan02(TorchtitanAPI):
    """torchtitan 0.2.x: one ``JobConfig`` parsed from a TOML file and the command line; its
    ``checkpoint`` section (``torchtitan.config.Checkpoint``) goes to
    ``CheckpointManager(..., checkpoint_config=...)``, which the trainer calls itself; a
    subclass overrides ``save`` and ``load`` (its trainer calls no hooks)."""

    legacy: ClassVar[bool] = True
    save_hook: ClassVar[str] = "save"
    load_hook: ClassVar[str] = "load"
    config_arg: ClassVar[str] = "checkpoint_config"

    def containers(self, model_parts: list[Any], lr_lambda: Callable[[int], float],
                   implementation: str = "for-loop", **adamw: Any) -> tuple[Any, Any]:
        from torchtitan.components.lr_scheduler import LRSchedulersContainer
        from torchtitan.components.optimizer import OptimizersContainer

        flags = {"for-loop": {"foreach": False}, "foreach": {"foreach": True},
                 "fused": {"fused": True}}[implementation]
        optimizers = OptimizersContainer(model_parts, torch.optim.AdamW, {**adamw, **flags})
        return optimizers, LRSchedulersContainer(optimizers, lr_lambda)

    def load_replica_state(self, manager: Any) -> None:
        """A torchft replica's dataloader, saved apart in ``ft-replicat-<r>`` and left out of
        the shared checkpoint."""
        if getattr(manager, "enable_ft_dataloader_checkpoints", False):
            manager._ft_load()


def _torchtitan() -> TorchtitanAPI:
    try:
        import torchtitan
        from torchtitan.components.checkpoint import CheckpointManager
    except ImportError as exc:  # not installed (or a dependency missing): enable_datastates works
        return TorchtitanAPI(error=f"{type(exc).__name__}: {exc}")
    version = str(getattr(torchtitan, "__version__", "unknown"))
    if hasattr(CheckpointManager, "Config"):
        return _Titan03(version, CheckpointManager, CheckpointManager.Config)
    from torchtitan.config import Checkpoint

    return _Titan02(version, CheckpointManager, Checkpoint)


#: The torchtitan this process imports (:class:`TorchtitanAPI`).
TORCHTITAN = _torchtitan()
