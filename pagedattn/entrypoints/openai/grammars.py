"""ServingGrammars: a server's grammar compiles, so that no tenant can hold the compiler.

- A grammar already compiled is answered on the event loop, before any queue: it never waits
  behind another tenant's compile.
- Too large a constraint (sizes, counted repeats of a pattern) is a 400 before compiling.
- Other compiles queue for one worker (at most `max_queued` waiting, else 503); a compile waits
  at most `timeout_s` for it, then runs at most `timeout_s` in a child process that is killed
  past it (structured_output/compile_worker.py): a 400 `constraint_timeout` either way.
- The compile worker is no part of /health: a compile is bounded by its deadline.
"""

from __future__ import annotations

from pagedattn.entrypoints.openai.protocol import APIError
from pagedattn.entrypoints.openai.worker_pool import WorkerPool
from pagedattn.structured_output.params import (
    InvalidStructuredOutputsError,
    StructuredOutputsParams,
)


class ServingGrammars:
    """Compiles a request's constraint before the engine sees it (a bad one is a 400 now)."""

    def __init__(self, tokenizer, vocab_size: int, timeout_s: float, max_queued: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.pool = WorkerPool("pagedattn-grammar", 1, max_queued=max_queued)

    def close(self) -> None:
        from pagedattn.structured_output.compiler import grammar_cache_if_built

        self.pool.close()
        cache = grammar_cache_if_built(self.tokenizer, self.vocab_size)
        if cache is not None:
            cache.close()

    def _compile_job(self, params: StructuredOutputsParams) -> None:
        from pagedattn.structured_output.compiler import grammar_cache

        grammar_cache(self.tokenizer, self.vocab_size).compile_with_deadline(params, self.timeout_s)

    async def compile(self, params: StructuredOutputsParams | None, param: str | None) -> None:
        """Have `params` compiled and cached; an APIError (400, 503) when it cannot be."""
        if params is None:
            return
        from pagedattn.structured_output.compile_worker import (
            GrammarCompileTimeout,
            GrammarWorkerError,
        )
        from pagedattn.structured_output.compiler import cached_grammar, check_constraint_size

        if cached_grammar(params, self.tokenizer, self.vocab_size) is not None:
            return
        try:
            check_constraint_size(params)
            await self.pool.run(self._compile_job, params, queue_timeout_s=self.timeout_s)
        except InvalidStructuredOutputsError as exc:
            too_large = "too large to compile" in str(exc)
            code = "constraint_too_large" if too_large else "invalid_constraint"
            raise APIError(str(exc), param=param, code=code) from None
        except (TimeoutError, GrammarCompileTimeout) as exc:
            where = "wait for" if isinstance(exc, TimeoutError) else "finish"
            raise APIError(
                f"the output constraint did not {where} its compile within {self.timeout_s:g} s "
                "(too complex, or the compiler is busy): simplify it, or retry",
                param=param,
                code="constraint_timeout",
            ) from None
        except GrammarWorkerError:
            raise APIError(
                "the grammar compiler restarted: retry",
                status_code=503,
                err_type="server_error",
                code="server_busy",
            ) from None
