"""A second KV tier: KV cache blocks saved to and loaded from a file or Redis store."""

from pagedattn.kv_transfer.codec import BlockFormat, BlockKeySpace, decode_block, encode_block
from pagedattn.kv_transfer.connector import KVConnector, connector_for_engine
from pagedattn.kv_transfer.stats import KVConnectorStats
from pagedattn.kv_transfer.store import KVStore, StoreUnavailableError, StoreURLError, make_store

__all__ = [
    "BlockFormat",
    "BlockKeySpace",
    "KVConnector",
    "connector_for_engine",
    "KVConnectorStats",
    "KVStore",
    "StoreURLError",
    "StoreUnavailableError",
    "decode_block",
    "encode_block",
    "make_store",
]
