"""Connectors by name, or third-party ones by module path."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from siesta.config import ConfigError, KVTransferConfig
from siesta.tiers.base import ConnectorContext, KVConnector

# The built-in connectors load by module path, as third-party ones do: the factory imports no
# connector, so a connector (MultiConnector) may use the factory without an import cycle.
BUILTIN: dict[str, str] = {"OffloadingConnector": "siesta.tiers.offloading", "MultiConnector": "siesta.tiers.multi"}


def create_connector(config: KVTransferConfig | dict[str, Any], ctx: ConnectorContext) -> KVConnector:
    cfg = KVTransferConfig.from_any(config)
    cls = _connector_class(cfg)
    # Children of a MultiConnector get their own context copy; they share stats and the block pool.
    return cls(cfg.kv_connector_extra_config, dataclasses.replace(ctx), role=cfg.kv_role)


def _connector_class(cfg: KVTransferConfig) -> type[KVConnector]:
    module_path = cfg.kv_connector_module_path or BUILTIN.get(cfg.kv_connector)
    if module_path is None:
        raise ConfigError(
            f"unknown kv_connector {cfg.kv_connector!r}: built in are {sorted(BUILTIN)}; "
            "others load with kv_connector_module_path"
        )
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise ConfigError(f"cannot import kv_connector_module_path {module_path!r}: {e}") from e
    cls = getattr(module, cfg.kv_connector, None)
    if cls is None:
        raise ConfigError(f"module {module_path!r} has no connector {cfg.kv_connector!r}")
    if not (isinstance(cls, type) and issubclass(cls, KVConnector)):
        raise ConfigError(f"{cfg.kv_connector!r} is not a siesta KVConnector subclass")
    return cls
