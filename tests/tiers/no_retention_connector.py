"""A third-party connector, loaded by module path, that does not declare it can keep its
cache across a pause (like the seed's MooncakeStoreConnector)."""

from siesta.tiers.base import KVConnector
from siesta.tiers.offloading import OffloadingConnector


class NoRetentionConnector(OffloadingConnector):
    # It says nothing about retention, so the base class's default holds for it: the tests
    # that it is refused test that default (False), not a value set here.
    supports_retained_cache_on_pause = KVConnector.supports_retained_cache_on_pause
