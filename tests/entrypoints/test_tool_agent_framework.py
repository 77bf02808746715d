"""An agent framework runs a one-tool loop end to end against the server: the OpenAI Agents SDK
(`openai-agents`) over /v1/responses and over /v1/chat/completions, on the real SmolLM2.

The agent must call the tool (the first turn's tool_choice is "required", so SmolLM2's call is
constrained and parses), the SDK runs it, hands back its output, and the model answers in text.
"""

from __future__ import annotations

import asyncio

import pytest

agents = pytest.importorskip(
    "agents", reason="the OpenAI Agents SDK is not installed: pip install openai-agents"
)

from openai import AsyncOpenAI  # noqa: E402

from pagedattn import LLM  # noqa: E402
from pagedattn.entrypoints.openai.server import build_app  # noqa: E402
from tests.entrypoints.server_process import InProcessServer  # noqa: E402

MODEL = "smollm2"


@pytest.fixture(scope="module")
def server():
    llm = LLM(dtype="float32", num_blocks=128, block_size=16, max_model_len=2048)
    app = build_app(llm.engine, served_model_name=MODEL, enable_auto_tool_choice=True)
    srv = InProcessServer(app)
    yield srv
    srv.stop()


# NOTE: slow (about 90 s on 2 cores, a model load and four agent turns); the routes it drives
# have their own default-suite tests (test_responses_server.py, test_tool_calling_server.py).
@pytest.mark.slow
@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agents_sdk_one_tool_loop(server, api):
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    client = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    model_cls = (
        agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
    )
    agent = agents.Agent(
        name="weather",
        instructions="Answer questions about the weather with the get_weather tool.",
        tools=[get_weather],
        model=model_cls(model=MODEL, openai_client=client),
        # NOTE: the SDK resets tool_choice to auto after the call (reset_tool_choice), so the
        # second turn is the model's own answer.
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
    )
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert len(calls) >= 1 and all(isinstance(c, str) and c for c in calls)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert isinstance(result.final_output, str) and result.final_output
