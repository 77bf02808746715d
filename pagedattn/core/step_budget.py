"""StepTokenBudget: how many tokens one engine step may compute, fixed or from measured time.

With a fixed budget (``--max-num-batched-tokens``) every step may hold that many tokens. Without
one, the budget follows the measured cost per token so that a step takes about the target time:
a long prompt is prefilled in chunks small enough that the streams decoding beside it are not
stalled for seconds on a slow CPU, and as large as the cap where the hardware is fast. A step
with no stream decoding beside it stalls nobody, so it may take the cap (``tokens_for``).

The cost per token is measured on steps that prefill. A decode step streams every weight for a
handful of tokens, so its cost per token says nothing about a prompt's: on the AMX Xeon a
batch-32 decode step took 0.69 ms per token, a 2,048-token prefill step 0.16. Measured on both,
the budget sank to about 700 tokens after a few decode steps, and a later burst of prompts was
prefilled in small, slow chunks.

Within the step, ``long_prefill_token_threshold`` (vLLM's option of that name) caps what one
request computes: a long prompt's chunk leaves the rest of the budget to prompts queued behind it.
"""

from __future__ import annotations

# The cap of the adaptive budget, and the old fixed default.
DEFAULT_MAX_STEP_TOKENS = 2048
# The budget before any step was measured: small, so a slow machine's first chunk is short.
INITIAL_STEP_TOKENS = 256
# Steps with fewer tokens are not measured: their time is mostly per-step overhead.
MIN_MEASURED_TOKENS = 32
# Weight of the newest step in the moving average of the cost per token.
COST_SMOOTHING = 0.3
# The budget at most doubles from one step to the next (one fast step is not proof).
MAX_GROWTH = 2.0


class StepTokenBudget:
    """The token budget of each step: fixed, or sized from step times to meet a target."""

    def __init__(
        self,
        fixed_tokens: int | None,
        target_step_time_s: float,
        min_tokens: int,
        max_tokens: int = DEFAULT_MAX_STEP_TOKENS,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        if fixed_tokens is not None and fixed_tokens < 1:
            raise ValueError(f"fixed_tokens={fixed_tokens!r} is invalid: use >= 1 or None")
        if long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold={long_prefill_token_threshold!r} is invalid: "
                "use >= 1, or 0 for no cap"
            )
        # The most tokens one request computes in a step; 0: no cap but the step's budget.
        self.long_prefill_token_threshold = long_prefill_token_threshold
        if target_step_time_s <= 0:
            raise ValueError(f"target_step_time_s={target_step_time_s!r} is invalid: use > 0")
        self.fixed_tokens = fixed_tokens
        self.target_step_time_s = target_step_time_s
        self.max_tokens = fixed_tokens if fixed_tokens is not None else max_tokens
        # NOTE: never below min_tokens (max_num_seqs), so every running sequence can decode.
        self.min_tokens = max(1, min(min_tokens, self.max_tokens))
        # Moving average of step seconds per token; None until a step was measured.
        self.seconds_per_token: float | None = None
        self._tokens = max(self.min_tokens, min(INITIAL_STEP_TOKENS, self.max_tokens))

    @property
    def is_adaptive(self) -> bool:
        """True when the budget follows measured step times (no fixed budget was given)."""
        return self.fixed_tokens is None

    @property
    def tokens(self) -> int:
        """The token budget of the next step."""
        return self.max_tokens if self.fixed_tokens is not None else self._tokens

    def tokens_for(self, streaming: bool) -> int:
        """The budget of a step, where ``streaming`` says whether a running request has output
        tokens already (a user waiting on its next one): if none has, the cap."""
        return self.tokens if streaming else self.max_tokens

    def cap_request(self, num_new_tokens: int) -> int:
        """The tokens a request with num_new_tokens left may compute this step, before the
        step's remaining budget applies: at most long_prefill_token_threshold (when set)."""
        threshold = self.long_prefill_token_threshold
        return threshold if 0 < threshold < num_new_tokens else num_new_tokens

    def observe(self, num_tokens: int, step_time_s: float, num_prefill_tokens: int) -> None:
        """A step computed num_tokens, num_prefill_tokens of them in prompt chunks (the rest one
        token, or one plus drafts, per decoding request), in step_time_s: update the cost and
        the next budget. Decode-only steps are not measured."""
        if not self.is_adaptive or num_prefill_tokens <= 0 or step_time_s <= 0:
            return
        if num_tokens < MIN_MEASURED_TOKENS:
            return
        cost = step_time_s / num_tokens
        previous = self.seconds_per_token
        self.seconds_per_token = (
            cost if previous is None else previous + COST_SMOOTHING * (cost - previous)
        )
        wanted = int(self.target_step_time_s / self.seconds_per_token)
        wanted = min(wanted, int(self._tokens * MAX_GROWTH))
        self._tokens = max(self.min_tokens, min(wanted, self.max_tokens))
