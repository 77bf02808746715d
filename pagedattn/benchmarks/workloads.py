"""Throughput-benchmark workloads: uniform, ShareGPT-like, shared-prefix and single (batch-1
latency: one request), as token-id prompts.

Every engine gets the same token ids (random ids from the model's vocabulary, special ids left
out), so no tokenizer difference can change the work done. The ShareGPT-like trace can be saved
to and replayed from a JSON file.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

WORKLOAD_NAMES = ("uniform", "sharegpt", "shared_prefix", "single", "single_grounded")
DEFAULT_WORKLOADS = ("uniform", "sharegpt", "shared_prefix")
TRACE_VERSION = 1


@dataclass(frozen=True)
class WorkloadSizes:
    """How big each workload is: the issue's full sizes, a quick look, or a tiny smoke test."""

    uniform_num_requests: int = 32
    uniform_prompt_len: int = 128
    uniform_output_len: int = 128
    sharegpt_num_requests: int = 64
    sharegpt_prompt_mean: float = 160.0
    sharegpt_output_mean: float = 340.0
    sharegpt_min_len: int = 4
    sharegpt_max_len: int = 1024
    shared_num_requests: int = 64
    shared_prefix_len: int = 1024
    shared_suffix_len: int = 32
    shared_output_len: int = 64
    single_prompt_len: int = 512
    single_output_len: int = 256

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value <= 0:
                raise ValueError(f"WorkloadSizes.{name}={value!r} is invalid: use a positive value")
        if self.sharegpt_min_len > self.sharegpt_max_len:
            raise ValueError(
                f"sharegpt_min_len={self.sharegpt_min_len} > sharegpt_max_len="
                f"{self.sharegpt_max_len}: the clip range is empty"
            )

    @property
    def max_seq_len(self) -> int:
        """Longest prompt + output of any workload: the engines need this much context."""
        return max(
            self.uniform_prompt_len + self.uniform_output_len,
            2 * self.sharegpt_max_len,
            self.shared_prefix_len + self.shared_suffix_len + self.shared_output_len,
            self.single_prompt_len + self.single_output_len,
        )


SIZE_PRESETS = {
    "full": WorkloadSizes(),
    "quick": WorkloadSizes(
        uniform_num_requests=8,
        uniform_prompt_len=64,
        uniform_output_len=32,
        sharegpt_num_requests=16,
        sharegpt_prompt_mean=80.0,
        sharegpt_output_mean=48.0,
        sharegpt_max_len=256,
        shared_num_requests=16,
        shared_prefix_len=512,
        shared_suffix_len=16,
        shared_output_len=16,
        single_prompt_len=256,
        single_output_len=64,
    ),
    # For the smoke test on a tiny random model with a 256-token context.
    "tiny": WorkloadSizes(
        uniform_num_requests=4,
        uniform_prompt_len=16,
        uniform_output_len=8,
        sharegpt_num_requests=6,
        sharegpt_prompt_mean=16.0,
        sharegpt_output_mean=8.0,
        sharegpt_max_len=48,
        shared_num_requests=4,
        shared_prefix_len=64,
        shared_suffix_len=8,
        shared_output_len=8,
        single_prompt_len=32,
        single_output_len=8,
    ),
}


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt token ids and exactly how many tokens it generates."""

    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    """A named list of requests, all arriving at once; warm_prefix is sent first when present."""

    name: str
    requests: list[BenchRequest]
    warm_prefix: list[int] | None = None
    info: dict = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def mean_decode_context(self) -> float:
        """Mean tokens each sequence attends to during a decode step (prompt + half the output)."""
        return sum(len(r.prompt_token_ids) + r.max_tokens / 2 for r in self.requests) / len(
            self.requests
        )


class TokenSampler:
    """Random token ids from [0, vocab_size), never one of the special ids."""

    def __init__(self, vocab_size: int, special_ids: set[int], rng: random.Random) -> None:
        self.allowed = [i for i in range(vocab_size) if i not in special_ids]
        if not self.allowed:
            raise ValueError(f"every id of the {vocab_size}-token vocabulary is special")
        self.rng = rng

    def sample(self, n: int) -> list[int]:
        return self.rng.choices(self.allowed, k=n)


def _lognormal_len(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    # NOTE: mu chosen so the unclipped distribution has the requested mean: E = exp(mu + s^2/2).
    mu = math.log(mean) - sigma * sigma / 2
    return min(hi, max(lo, round(rng.lognormvariate(mu, sigma))))


def make_uniform(sizes: WorkloadSizes, tokens: TokenSampler) -> Workload:
    reqs = [
        BenchRequest(tokens.sample(sizes.uniform_prompt_len), sizes.uniform_output_len)
        for _ in range(sizes.uniform_num_requests)
    ]
    return Workload("uniform", reqs)


def make_sharegpt(sizes: WorkloadSizes, tokens: TokenSampler, seed: int) -> Workload:
    """Log-normal prompt and output lengths (ShareGPT's long tail), clipped, from a seeded RNG."""
    rng = random.Random(seed)
    lo, hi = sizes.sharegpt_min_len, sizes.sharegpt_max_len
    reqs = []
    for _ in range(sizes.sharegpt_num_requests):
        num_prompt = _lognormal_len(rng, sizes.sharegpt_prompt_mean, 1.0, lo, hi)
        num_output = _lognormal_len(rng, sizes.sharegpt_output_mean, 0.8, lo, hi)
        reqs.append(BenchRequest(tokens.sample(num_prompt), num_output))
    return Workload("sharegpt", reqs, info={"seed": seed})


def make_shared_prefix(sizes: WorkloadSizes, tokens: TokenSampler) -> Workload:
    """One system prompt shared by every request, each with its own short user part."""
    system = tokens.sample(sizes.shared_prefix_len)
    reqs = [
        BenchRequest(system + tokens.sample(sizes.shared_suffix_len), sizes.shared_output_len)
        for _ in range(sizes.shared_num_requests)
    ]
    return Workload("shared_prefix", reqs, warm_prefix=system)


def make_single(sizes: WorkloadSizes, tokens: TokenSampler) -> Workload:
    """One request alone: time to first token and per-token latency at batch 1."""
    prompt = tokens.sample(sizes.single_prompt_len)
    return Workload("single", [BenchRequest(prompt, sizes.single_output_len)])


def make_single_grounded(tokenizer, scale: float = 1.0) -> Workload:
    """Batch-1 requests, one after another, whose answers copy spans of their prompt (edit a
    code file, correct a notice, answer by quoting a document): grounded_texts' fixed texts,
    chat templated by the model's tokenizer (as plain text where it has no chat template: a
    base model, such as the packaged Gemma 3 270M)."""
    from pagedattn.benchmarks.grounded_texts import GROUNDED_TASKS

    reqs = []
    for text, num_output in GROUNDED_TASKS:
        if getattr(tokenizer, "chat_template", None) is None:
            ids = tokenizer.encode(text)
        else:
            messages = [{"role": "user", "content": text}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) else ids
        reqs.append(BenchRequest(list(ids), max(1, round(num_output * scale))))
    return Workload("single_grounded", reqs, info={"sequential": True})


def make_workloads(
    sizes: WorkloadSizes, vocab_size: int, special_ids: set[int], seed: int, tokenizer=None
) -> dict[str, Workload]:
    """Every workload, deterministic in ``seed`` (single_grounded needs the tokenizer)."""
    tokens = TokenSampler(vocab_size, special_ids, random.Random(seed))
    workloads = {
        "uniform": make_uniform(sizes, tokens),
        "sharegpt": make_sharegpt(sizes, tokens, seed),
        "shared_prefix": make_shared_prefix(sizes, tokens),
        "single": make_single(sizes, tokens),
    }
    if tokenizer is not None:
        scale = sizes.single_output_len / SIZE_PRESETS["full"].single_output_len
        workloads["single_grounded"] = make_single_grounded(tokenizer, scale)
    return workloads


def workload_to_dict(workload: Workload) -> dict:
    return {
        "version": TRACE_VERSION,
        "name": workload.name,
        "warm_prefix": workload.warm_prefix,
        "info": workload.info,
        "requests": [
            {"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}
            for r in workload.requests
        ],
    }


def workload_from_dict(data: dict) -> Workload:
    if data.get("version") != TRACE_VERSION or "requests" not in data:
        raise ValueError(
            f"not a throughput trace (version {data.get('version')!r}, expected {TRACE_VERSION}): "
            "write one with --trace-out"
        )
    reqs = [
        BenchRequest(list(r["prompt_token_ids"]), int(r["max_tokens"])) for r in data["requests"]
    ]
    return Workload(data["name"], reqs, data.get("warm_prefix"), data.get("info", {}))


def save_trace(workload: Workload, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(workload_to_dict(workload)))


def load_trace(path: Path, vocab_size: int) -> Workload:
    """A saved trace; ValueError if it does not fit the model's vocabulary."""
    workload = workload_from_dict(json.loads(path.read_text()))
    bad = [t for r in workload.requests for t in r.prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"trace {path} has token ids outside the model's vocabulary [0, {vocab_size}) "
            f"(e.g. {bad[0]}): it was made for another model"
        )
    return workload


def model_vocab(model: str | None) -> tuple[int, set[int], object]:
    """The vocabulary size, the special token ids (never sampled into a prompt) and the
    tokenizer of ``model``."""
    from pagedattn.model.loader import resolve_checkpoint

    ckpt = resolve_checkpoint(model)
    tokenizer = ckpt.tokenizer()
    config = ckpt.hf_config()
    config = getattr(config, "text_config", None) or config
    special = set(tokenizer.all_special_ids)
    eos = getattr(config, "eos_token_id", None)
    special |= {eos} if isinstance(eos, int) else set(eos or [])
    return int(config.vocab_size), special, tokenizer
