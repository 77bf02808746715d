"""Memory metrics of a simulated run, accumulated step by step and averaged over time.

Every quantity is counted in KV token slots (one slot = K and V of one token in every layer, so
bytes = slots * bytes_per_token and ratios are the same in bytes). At each simulated step ``t``,
after the step's allocations and before finished requests are freed, for each running request
``r`` with ``h_r`` tokens held in the cache, ``a_r`` slots allocated to it, and a final KV length
``L_r = prompt_len + output_len - 1`` (the most slots it will ever fill):

- token slots ``T_t = sum_r h_r``: slots holding real tokens;
- allocated ``A_t``: slots reserved by requests (a shared block counts once);
- reservation ``R_t = sum_r (min(a_r, L_r) - h_r)``: slots held for tokens the request will
  produce later;
- internal fragmentation ``I_t = sum_r max(a_r - L_r, 0)``: slots the request will never fill;
- external fragmentation ``E_t``: free slots lying in holes too small for the request at the
  head of the waiting queue, while one waits (0 when nothing waits, and always 0 for paging,
  whose free blocks need not be contiguous);
- capacity ``M``: slots in the pool.

Without sharing ``A_t = T_t + R_t + I_t``. The run-level figures are ratios of sums over steps
(time averages): effective utilisation ``sum T / sum A``, reservation ``sum R / sum A``, internal
``sum I / sum A``, external ``sum E / sum M``, occupancy ``sum A / sum M``.
With sharing (prefix hits, forks) a shared token counts once per sequence in ``T`` but its slot
once in ``A``, so utilisation can pass 1; sharing runs report the saving of
``pagedattn.sim.sharing`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SimResult:
    """The outcome of replaying one trace under one memory policy."""

    policy: str
    capacity_slots: int
    num_steps: int
    num_output_tokens: int
    utilization: float
    reservation_frac: float
    internal_frac: float
    external_frac: float
    occupancy: float
    max_concurrent: int
    # Time-averaged running requests over steps in which some arrived request was waiting
    # (memory or the batch bound the batch); over all steps when none ever waited.
    mean_concurrent: float
    num_preemptions: int

    @property
    def tokens_per_step(self) -> float:
        """Throughput: output tokens generated per simulated step."""
        return self.num_output_tokens / max(self.num_steps, 1)


@dataclass
class MemoryMeter:
    """Sums the per-step quantities of the module docstring."""

    capacity_slots: int
    token_slots: int = 0
    allocated: int = 0
    reservation: int = 0
    internal: int = 0
    external: int = 0
    num_steps: int = 0
    max_concurrent: int = 0
    _concurrent_all: int = 0
    _concurrent_saturated: int = 0
    _num_saturated_steps: int = 0
    per_step_allocated: list[int] = field(default_factory=list)

    def record(
        self,
        held: list[int],
        allocated: list[int],
        final_lens: list[int],
        total_allocated: int,
        stranded_free: int,
        num_waiting: int,
    ) -> None:
        """Add one step: per running request, tokens held, slots allocated, final KV length."""
        self.num_steps += 1
        self.token_slots += sum(held)
        self.allocated += total_allocated
        for h, a, final in zip(held, allocated, final_lens, strict=True):
            self.reservation += min(a, final) - h
            self.internal += max(a - final, 0)
        self.external += stranded_free
        num_running = len(held)
        self.max_concurrent = max(self.max_concurrent, num_running)
        self._concurrent_all += num_running
        if num_waiting > 0:
            self._concurrent_saturated += num_running
            self._num_saturated_steps += 1
        self.per_step_allocated.append(total_allocated)

    def result(self, policy: str, num_output_tokens: int, num_preemptions: int) -> SimResult:
        """Turn the sums into time-averaged ratios."""
        alloc = max(self.allocated, 1)
        cap_sum = max(self.capacity_slots * self.num_steps, 1)
        if self._num_saturated_steps:
            mean_conc = self._concurrent_saturated / self._num_saturated_steps
        else:
            mean_conc = self._concurrent_all / max(self.num_steps, 1)
        return SimResult(
            policy=policy,
            capacity_slots=self.capacity_slots,
            num_steps=self.num_steps,
            num_output_tokens=num_output_tokens,
            utilization=self.token_slots / alloc,
            reservation_frac=self.reservation / alloc,
            internal_frac=self.internal / alloc,
            external_frac=self.external / cap_sum,
            occupancy=self.allocated / cap_sum,
            max_concurrent=self.max_concurrent,
            mean_concurrent=mean_conc,
            num_preemptions=num_preemptions,
        )
