"""KV-cache events -> prefix index: which pods hold the longest prefix of a request (see README.md).

Pure layers are re-exported here; the ZMQ adapter (``subscriber``, ``subscriptions``) is imported
from its own modules so that importing the index never imports zmq.
"""

from extproc.kvindex.decode import MAX_PAYLOAD_BYTES, KVDecodeError, decode_batch
from extproc.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch, KVEvent, Source
from extproc.kvindex.index import PrefixIndex
from extproc.kvindex.keys import block_keys, namespace_seed
from extproc.kvindex.results import ApplyResult, IndexStats, SourceStats

__all__ = [
    "MAX_PAYLOAD_BYTES",
    "AllBlocksCleared",
    "ApplyResult",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "IndexStats",
    "KVDecodeError",
    "KVEvent",
    "PrefixIndex",
    "Source",
    "SourceStats",
    "block_keys",
    "decode_batch",
    "namespace_seed",
]
