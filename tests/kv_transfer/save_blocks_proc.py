"""Run as a separate process: save seeded cache blocks through a KV store URL, then exit.

python -m tests.kv_transfer.save_blocks_proc URL SEED BLOCK_IDS(comma) NUM_HASHES
"""

from __future__ import annotations

import sys

import torch

from pagedattn.attention.layout import KVCacheLayout
from pagedattn.kv_transfer.connector import KVConnector
from pagedattn.kv_transfer.store import make_store
from tests.kv_transfer.caches import BLOCK_SIZE, hashes, make_caches


def main() -> None:
    url, seed, block_ids, num_hashes = sys.argv[1:5]
    ids = [int(b) for b in block_ids.split(",")]
    conn = KVConnector(
        make_store(url), "tiny-model", KVCacheLayout.FLASH, torch.float32, BLOCK_SIZE
    )
    queued = conn.save_blocks(make_caches(seed=int(seed)), ids, hashes(int(num_hashes)))
    conn.close()
    stats = conn.stats
    print(f"queued={queued} saved={stats.num_saved_blocks} failed={stats.num_failed_saves}")


if __name__ == "__main__":
    main()
