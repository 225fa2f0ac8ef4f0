"""A third-party connector, loaded by module path, that does not declare it can keep its
cache across a pause (like the seed's MooncakeStoreConnector)."""

from siesta.tiers.offloading import OffloadingConnector


class NoRetentionConnector(OffloadingConnector):
    supports_retained_cache_on_pause = False
