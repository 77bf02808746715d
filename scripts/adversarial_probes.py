"""Re-run issue 21's adversarial list against a running front door (single server or replicas).

    python scripts/adversarial_probes.py --base-url http://127.0.0.1:8000 --api-key KEY \
        --model NAME [--other-key KEY2]

Prints one line per probe (`ok` or `FAIL: why`) and exits 1 if any failed. The server must run
with API keys. `run_probes` is what the tests call.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx

# A small request must still answer within this while another tenant's big one is refused.
SMALL_REQUEST_S = 5.0
# A refusal (401, 413, 400 for size) must come within this.
REFUSAL_S = 3.0


@dataclass(frozen=True)
class ProbeResult:
    """One probe: its name (the issue's label) and what went wrong (None when it held)."""

    name: str
    failure: str | None

    @property
    def ok(self) -> bool:
        return self.failure is None


class Probes:
    """The probes, each a method returning a failure message or None."""

    def __init__(self, base_url: str, key: str, model: str, other_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.key = key
        self.other_key = other_key
        self.model = model
        self.client = httpx.Client(base_url=self.base_url, timeout=60.0)

    def _auth(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.key}"}

    def _complete(self, key: str | None = None, **body) -> httpx.Response:
        body = {"model": self.model, "max_tokens": 1, **body}
        return self.client.post("/v1/completions", json=body, headers=self._auth(key))

    def _raw(self, head: bytes, timeout: float = REFUSAL_S + 2) -> bytes:
        """Send `head` (and no body) on a raw socket; what the server answers within timeout."""
        url = urlparse(self.base_url)
        with socket.create_connection((url.hostname, url.port or 80), timeout=timeout) as sock:
            sock.sendall(head)
            reply = b""
            deadline = time.monotonic() + timeout
            while b"\r\n\r\n" not in reply and time.monotonic() < deadline:
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    break
                if not chunk:
                    break
                reply += chunk
            return reply

    def _small_while(self, big: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
        """Run `big` twice in the background and time a 1-token request meanwhile."""
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            bigs = [pool.submit(big) for _ in range(2)]
            time.sleep(0.2)
            t0 = time.monotonic()
            small = self._complete(prompt="hello", max_tokens=1)
            elapsed = time.monotonic() - t0
            responses = [f.result() for f in bigs]
        return responses[0], max(elapsed, 0.0) if small.status_code == 200 else float("inf")

    # ---- C2: the guard, auth first -----------------------------------------------------------

    def c2_unauthenticated_invalid_body_is_401(self) -> str | None:
        r = self.client.post("/v1/completions", content=b"{not json", headers={})
        return None if r.status_code == 401 else f"got {r.status_code}, want 401: {r.text[:200]}"

    def c2_declared_huge_body_without_key_is_401_at_once(self) -> str | None:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 300000000\r\n\r\n")  # fmt: skip
        t0 = time.monotonic()
        reply = self._raw(head)
        if not reply.startswith(b"HTTP/1.1 401"):
            return f"got {reply[:40]!r} after {time.monotonic() - t0:.1f} s, want 401 at once"
        return None

    def c2_declared_huge_body_with_key_is_413_at_once(self) -> str | None:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + self.key.encode() + b"\r\n"
                b"Content-Length: 300000000\r\n\r\n")  # fmt: skip
        reply = self._raw(head)
        return None if reply.startswith(b"HTTP/1.1 413") else f"got {reply[:40]!r}, want 413"

    # ---- H1 / C2: big prompts do not stall others -------------------------------------------

    def h1_prompt_far_past_the_context_is_refused_fast(self) -> str | None:
        prompt = "hello " * 200_000  # 1.2 MB: far more than any context here
        t0 = time.monotonic()
        r = self._complete(prompt=prompt)
        elapsed = time.monotonic() - t0
        if r.status_code != 400 or elapsed > REFUSAL_S:
            return f"got {r.status_code} after {elapsed:.1f} s, want 400 within {REFUSAL_S} s"
        return None

    def h1_small_request_does_not_wait_behind_big_prompts(self) -> str | None:
        prompt = "hello " * 200_000

        def big() -> httpx.Response:
            return self._complete(key=self.other_key, prompt=prompt)

        _, elapsed = self._small_while(big)
        if elapsed > SMALL_REQUEST_S:
            return f"the 1-token request took {elapsed:.1f} s (want < {SMALL_REQUEST_S} s)"
        return None

    # ---- C1: grammar compiles ----------------------------------------------------------------

    def c1_huge_choice_list_is_a_400_that_says_why(self) -> str | None:
        choices = [f"option number {i}" for i in range(50_000)]
        r = self._complete(prompt="pick", guided_choice=choices)
        if r.status_code != 400 or "too large" not in r.text:
            return f"got {r.status_code}: {r.text[:200]}"
        return None

    def c1_long_regex_is_a_400(self) -> str | None:
        r = self._complete(prompt="x", guided_regex="(ab|cd)" * 2000)
        return None if r.status_code == 400 else f"got {r.status_code}: {r.text[:200]}"

    def c1_text_requests_go_on_while_grammars_are_refused(self) -> str | None:
        choices = [f"option number {i}" for i in range(50_000)]

        def big() -> httpx.Response:
            return self._complete(key=self.other_key, prompt="pick", guided_choice=choices)

        _, elapsed = self._small_while(big)
        if elapsed > SMALL_REQUEST_S:
            return f"the 1-token request took {elapsed:.1f} s (want < {SMALL_REQUEST_S} s)"
        return None

    # ---- L1-L3 -------------------------------------------------------------------------------

    def l1_debug_kv_hides_other_tenants_blocks(self) -> str | None:
        r = self.client.get("/debug/kv", headers=self._auth())
        if r.status_code == 404:
            return None  # this front door has no /debug/kv
        snap = r.json()
        own = {b for t in snap.get("block_tables", {}).values() for g in t for b in g}
        leaked = [i for i, s in enumerate(snap.get("state", [])) if s != "hidden" and i not in own]
        return f"blocks {leaked[:5]} of others are shown" if leaked else None

    def l2_metrics_need_a_key(self) -> str | None:
        r = self.client.get("/metrics")
        return None if r.status_code == 401 else f"got {r.status_code} without a key, want 401"

    def l3_too_many_prompts_is_a_400(self) -> str | None:
        r = self._complete(prompt=["hi"] * 3000)
        if r.status_code != 400 or r.json()["error"]["param"] != "prompt":
            return f"got {r.status_code}: {r.text[:200]}"
        return None

    def health_is_ok_after_all_of_the_above(self) -> str | None:
        deadline = time.monotonic() + 30
        while True:
            r = self.client.get("/health")
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        return None if r.status_code == 200 else f"/health {r.status_code}: {r.text[:200]}"

    def names(self, fast: bool = False) -> list[str]:
        slow = {"h1_small_request_does_not_wait_behind_big_prompts"}
        names = [n for n in dir(self) if n.split("_")[0] in ("c1", "c2", "h1", "l1", "l2", "l3")]
        names = [n for n in names if not (fast and n in slow)]
        return [*names, "health_is_ok_after_all_of_the_above"]


def run_probes(
    base_url: str, key: str, model: str, other_key: str | None = None, *, fast: bool = False
) -> list[ProbeResult]:
    """Every probe against `base_url`, in a fixed order (health last)."""
    probes = Probes(base_url, key, model, other_key)
    results = []
    for name in probes.names(fast):
        try:
            failure = getattr(probes, name)()
        except Exception as exc:  # a probe that crashes is a failure, not the end of the run
            failure = f"raised {exc!r}"
        results.append(ProbeResult(name, failure))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--other-key", default=None, help="a second tenant's key")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--fast", action="store_true", help="skip the slowest probes")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    results = run_probes(args.base_url, args.api_key, args.model, args.other_key, fast=args.fast)
    if args.json:
        print(json.dumps([{"name": r.name, "failure": r.failure} for r in results], indent=1))
    else:
        for r in results:
            print(f"{r.name:60s} {'ok' if r.ok else 'FAIL: ' + r.failure}")
    print(f"{sum(r.ok for r in results)}/{len(results)} probes held")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
