"""Routing policies over engine replicas: prefix-aware, power of two choices, round robin.

Pure logic: a policy ranks replica ids given their queue lengths and the request's chained block
hashes, computed the way the engine computes them (`RequestHasher`). The Ray Serve request
router (`serve_router.py`) and the benchmark both call these.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pagedattn.core.kv_cache_utils import BlockHash, hash_request_tokens
from pagedattn.entrypoints.serve_config import DEFAULT_IMBALANCE_THRESHOLD, ROUTERS

if TYPE_CHECKING:
    from pagedattn.serve.prefix_index import PrefixIndex

# ROUTERS (the policies by name) and DEFAULT_IMBALANCE_THRESHOLD (queue-length spread past
# which the prefix router ignores cache affinity ...) are ServeConfig's choices and default.
# ... when the longest queue is also this many times the shortest (SGLang's and the vLLM router's
# rule: two deep queues a few requests apart are both saturated, and moving a prefix between them
# only computes it twice).
DEFAULT_IMBALANCE_RATIO = 1.5


class RequestHasher:
    """Chained block hashes of a prompt, equal to the engine's (same block size, seed, salt)."""

    def __init__(self, tokenizer, block_size: int, hash_seed: str = "pagedattn") -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.hash_seed = hash_seed

    def prompt_token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a completion prompt, as LLMEngine.add_request tokenizes it."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return list(prompt)

    def chat_token_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a chat, rendered as OpenAIServing renders it."""
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        """Hashes of the full blocks of token_ids under a tenant's salt."""
        return hash_request_tokens(
            self.block_size, token_ids, self.hash_seed, cache_salt=cache_salt
        )


class RoutingPolicy(ABC):
    """Ranks replicas for one request: best first."""

    name: str

    @abstractmethod
    def rank(
        self,
        replica_ids: Sequence[str],
        queue_lens: Mapping[str, int],
        block_hashes: Sequence[BlockHash] = (),
    ) -> list[str]:
        """Replica ids, most preferred first (every given id appears once)."""

    def on_routed(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """The request went to replica_id (after rank; policies with state update it)."""
        return None


class RoundRobinPolicy(RoutingPolicy):
    """Each request to the next replica in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def rank(self, replica_ids, queue_lens, block_hashes=()):
        ids = sorted(replica_ids)
        if not ids:
            return []
        start = next(self._counter) % len(ids)
        return ids[start:] + ids[:start]


class PowerOfTwoPolicy(RoutingPolicy):
    """Two random replicas, the shorter queue first (Ray Serve's default policy)."""

    name = "pow2"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def rank(self, replica_ids, queue_lens, block_hashes=()):
        ids = list(replica_ids)
        self._rng.shuffle(ids)
        first_two = sorted(ids[:2], key=lambda r: queue_lens.get(r, 0))
        return first_two + sorted(ids[2:], key=lambda r: queue_lens.get(r, 0))


class PrefixAwarePolicy(RoutingPolicy):
    """The replica holding the longest cached prefix, unless queues are imbalanced.

    - If max(queue) - min(queue) > imbalance_threshold and max(queue) > imbalance_ratio *
      min(queue): least loaded first (affinity off).
    - Else the replicas with the longest match (in blocks, >= 1), shortest queue first among them.
    - A miss everywhere goes to the least loaded replica; among equally loaded ones, to the one
      holding the fewest blocks (so new prefixes spread), then at random.
    """

    name = "prefix"

    def __init__(
        self,
        index: PrefixIndex,
        imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
        seed: int | None = None,
        imbalance_ratio: float = DEFAULT_IMBALANCE_RATIO,
    ) -> None:
        if imbalance_ratio < 1.0:
            raise ValueError(f"imbalance_ratio={imbalance_ratio} is invalid: use >= 1.0")
        self.index = index
        self.imbalance_threshold = imbalance_threshold
        self.imbalance_ratio = imbalance_ratio
        self._rng = random.Random(seed)
        self.num_hits = 0
        self.num_misses = 0
        self.num_imbalanced = 0

    def rank(self, replica_ids, queue_lens, block_hashes=()):
        ids = list(replica_ids)
        self._rng.shuffle(ids)
        index = self.index
        by_load = sorted(ids, key=lambda r: (queue_lens.get(r, 0), index.num_blocks(r)))
        if not ids or not block_hashes:
            return by_load
        loads = [queue_lens.get(r, 0) for r in ids]
        longest, shortest = max(loads), min(loads)
        if (
            longest - shortest > self.imbalance_threshold
            and longest > self.imbalance_ratio * shortest
        ):
            self.num_imbalanced += 1
            return by_load
        matches = {r: self.index.match_length(r, block_hashes) for r in ids}
        best = max(matches.values())
        if best == 0:
            self.num_misses += 1
            return by_load
        self.num_hits += 1
        return sorted(by_load, key=lambda r: -matches[r])

    def on_routed(self, replica_id, block_hashes):
        self.index.note_routed(replica_id, block_hashes)


def make_policy(
    name: str,
    index: PrefixIndex | None = None,
    imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
    seed: int | None = None,
    imbalance_ratio: float = DEFAULT_IMBALANCE_RATIO,
) -> RoutingPolicy:
    """A policy by name (`ROUTERS`)."""
    if name == "prefix":
        # NOTE: imported here: it loads msgspec and zmq, ~60 ms of every CLI start otherwise
        # (the CLI's parser reads ROUTERS).
        from pagedattn.serve.prefix_index import PrefixIndex

        return PrefixAwarePolicy(index or PrefixIndex(), imbalance_threshold, seed, imbalance_ratio)
    if name == "pow2":
        return PowerOfTwoPolicy(seed)
    if name == "round_robin":
        return RoundRobinPolicy()
    raise ValueError(f"router={name!r} is not known: choose one of {', '.join(ROUTERS)}")
