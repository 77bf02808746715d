"""--calculate-kv-scales: each layer's fp8 k/v scale from a calibration prefill at start-up.

The scale maps a layer's largest |K| (|V|) onto the fp8 format's largest value. Taken from the
first user prefill (as vLLM does), a one-token prompt sets it from one token's amax, the later
prompts' larger values saturate, and greedy agreement with a float32 KV cache fell to 0-9 tokens
of 48. So the engine runs one prefill of ``CALIBRATION_TEXT`` (a few hundred tokens of prose,
numbers and code) before it serves, into free blocks that the scheduler then hands out as
usual; the same model and text give the same scales on every start, whatever the first request.
"""

from __future__ import annotations

from pagedattn.core.scheduler_output import ScheduledRequest, SchedulerOutput

# Fewer tokens than this (a tiny --max-model-len or cache): the engine says the scales are weak.
MIN_CALIBRATION_TOKENS = 64

CALIBRATION_TEXT = """\
The committee met on Tuesday, 14 March, to review the quarterly figures. Revenue rose 12.5% to
$4.2 million, while operating costs fell slightly; the board asked why shipping delays in the
northern region had doubled since January. "We underestimated demand," the director said.
In the laboratory, samples were heated to 373 K for 45 minutes, cooled, and weighed again: the
mass dropped from 2.031 g to 1.874 g. Water boils at 100 degrees Celsius at sea level.
def fibonacci(n: int) -> list[int]:
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]
SELECT name, COUNT(*) FROM orders WHERE created_at > '2024-01-01' GROUP BY name;
Q: What is the capital of France? A: Paris. Q: How many legs does a spider have? A: Eight.
Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who
repaired every clock in the valley but never wound his own. Children asked him why; he smiled
and said that time, like bread, tastes better when someone else has baked it.
{"id": 7, "items": ["apple", "banana", "cherry"], "total": 19.99, "paid": true}
Die Sonne scheint, und der Himmel ist blau. Le chat dort sur le canapé. El tren sale a las ocho.
1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597, 2584, 4181, 6765.
"""


def calibrate_kv_scales(runner, max_tokens: int) -> int:
    """One prefill of the calibration text (at most ``max_tokens`` tokens) through ``runner``
    (whose attention layers compute their scales on it); returns the tokens it ran.

    Call before any request: it writes blocks [0, n) of the free pool, unhashed and unowned."""
    ids = list(runner.tokenizer.encode(CALIBRATION_TEXT))
    block_size = runner.block_size
    limit = min(max_tokens, runner.num_blocks * block_size)
    ids = ids[:limit]
    blocks = list(range(-(-len(ids) // block_size)))
    request = ScheduledRequest(
        req_id="kv-scale-calibration",
        token_ids=ids,
        start_pos=0,
        block_ids=tuple(list(blocks) for _ in range(runner.num_groups)),
        needs_sample=False,
        sampling_params=None,
        seed=None,
        prompt_token_ids=ids,
        output_token_ids=[],
    )
    runner.execute(SchedulerOutput([request], {request.req_id: len(ids)}, len(ids)))
    return len(ids)
