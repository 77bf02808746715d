"""A KV store on a Redis or Valkey server (redis-py), behind a circuit breaker.

Eviction is the server's: run it with a maxmemory and an LRU policy, e.g.
``redis-server --maxmemory 8gb --maxmemory-policy allkeys-lru``. Socket timeouts are short and
redis-py's own retries are off, so a dead or slow server costs one timeout, then the breaker
skips it for a back-off period while the engine recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedattn.kv_transfer.circuit_breaker import CircuitBreaker
from pagedattn.kv_transfer.store import KVStore, StoreUnavailableError

# Keys per pipelined round trip: GET values are a block each (~0.1-1 MB), EXISTS replies tiny.
_GET_BATCH_KEYS = 16
_EXISTS_BATCH_KEYS = 1024
# The start of the error a GET of a list, hash or set key returns.
_WRONGTYPE = "WRONGTYPE"


def _import_redis():
    try:
        import redis
    except ImportError:
        raise StoreUnavailableError(
            "the redis client is not installed: pip install 'pagedattn[kvstore]'"
        ) from None
    return redis


class RedisKVStore(KVStore):
    """Values under their key (bytes), no TTL; GET/SET/EXISTS pipelined per batch of keys."""

    name = "redis"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 6379,
        db: int = 0,
        password: str | None = None,
        socket_timeout_s: float = 1.0,
        connect_timeout_s: float = 0.5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
    ) -> None:
        redis = _import_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors = (redis.RedisError, OSError)
        self._response_error = redis.ResponseError
        self.url = f"redis://{host}:{port}/{db}"
        self.breaker = CircuitBreaker(self.url, backoff_s=backoff_s, max_backoff_s=max_backoff_s)
        self._client = redis.Redis(
            host=host,
            port=port,
            db=db,
            password=password,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )

    def _run(self, fn):
        """Call fn() through the breaker; redis and socket errors become StoreUnavailableError."""
        self.breaker.before_call()
        try:
            result = fn()
        except self._errors as error:
            raise self.breaker.record_failure(error) from error
        self.breaker.record_success()
        return result

    def _pipelined(self, command: str, keys: Sequence[str], batch: int) -> list:
        """One pipelined round trip per `batch` keys."""

        def call() -> list:
            out = []
            for start in range(0, len(keys), batch):
                pipe = self._client.pipeline(transaction=False)
                for key in keys[start : start + batch]:
                    getattr(pipe, command)(key)
                out.extend(self._value(r) for r in pipe.execute(raise_on_error=False))
            return out

        return self._run(call) if keys else []

    def _value(self, reply):
        """A GET reply; a key of another type (WRONGTYPE) reads as an empty value.

        NOTE: an empty value fails the connector's checks, so the key is deleted as a corrupt
        entry; a key someone else wrote must not open the breaker for every request.
        """
        if isinstance(reply, self._response_error) and str(reply).startswith(_WRONGTYPE):
            return b""
        if isinstance(reply, Exception):
            raise reply
        return reply

    def get(self, key: str) -> bytes | None:
        return self._pipelined("get", [key], 1)[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._pipelined("get", keys, _GET_BATCH_KEYS)

    def put(self, key: str, value: bytes) -> None:
        self._run(lambda: self._client.set(key, value))

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [bool(n) for n in self._pipelined("exists", keys, _EXISTS_BATCH_KEYS)]

    def delete(self, key: str) -> None:
        self._run(lambda: self._client.delete(key))

    def ping(self) -> bool:
        """Whether the server answers now (through the breaker)."""
        try:
            return bool(self._run(self._client.ping))
        except StoreUnavailableError:
            return False

    def close(self) -> None:
        self._client.close()
