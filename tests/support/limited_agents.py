"""Agents under a ``ModelLimit`` for the crash tests, calling a fake provider that refuses above 2 concurrent calls.

Workers import this module beside ``tests.support.agents`` (``LOUSHO_AGENTS=tests.support.agents,
tests.support.limited_agents``). The fake provider counts the calls in flight per account in the test Redis db
(fleet-wide, as a real provider would; a killed process's calls end with it) and answers 429 with
``Retry-After: 2`` to a call that finds two in flight already. Each request logs a ``provider`` line (``start``,
``end`` or ``refused``) with its time; the model lines of ``LoggedModel`` come inside them. Nothing here decides
whether the fleet behaved.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import redis

from store.records import Message
from tests.support.agents import TOOLS, LoggedModel, _script, _shape_of, log_event
from worker import Agent, ModelLimit, ProviderRateLimitedError
from worker.providers import ModelResponse, ToolSpec

#: Calls in flight the fake provider takes on one account before it answers 429.
PROVIDER_CAPACITY = 2
#: The ``Retry-After`` of its 429s, in seconds.
RETRY_AFTER_S = 2
#: Set of the calls in flight on an account (``pid:call``).
_INFLIGHT = "lousho-test:provider:{account}:calls"

_clients: dict[int, redis.Redis] = {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


def _redis() -> redis.Redis:
    client = _clients.get(os.getpid())
    if client is None:
        _clients.clear()
        client = _clients[os.getpid()] = redis.Redis.from_url(os.environ["LOUSHO_REDIS_URL"])
    return client


class FussyProvider(LoggedModel):
    """``LoggedModel`` behind a provider account that refuses (429, ``Retry-After: 2``) a third concurrent call."""

    def __init__(self, account: str) -> None:
        super().__init__(_script, model_id=f"fussy-{account}")
        self.account = account

    def generate(  # type: ignore[override]  # never streams
        self,
        messages: list[Message],
        tools: list[ToolSpec],
    ) -> ModelResponse:
        key = _INFLIGHT.format(account=self.account)
        call = f"{os.getpid()}:{uuid.uuid4().hex[:12]}"
        client = _redis()
        client.sadd(key, call)
        # A call whose process was killed ends with it, as a real provider's connection would.
        pids = [int((m.decode() if isinstance(m, bytes) else str(m)).split(":")[0]) for m in client.smembers(key)]
        inflight = len([pid for pid in pids if _alive(pid)])
        record: dict[str, Any] = {
            "kind": "provider",
            "account": self.account,
            "inflight": inflight,
            "run_id": _shape_of(messages).run_id,
        }
        try:
            if inflight > PROVIDER_CAPACITY:
                log_event({**record, "phase": "refused"})
                raise ProviderRateLimitedError(f"{self.account}: too many requests", retry_after=float(RETRY_AFTER_S))
            log_event({**record, "phase": "start"})
            response = super().generate(messages, tools)
            log_event({**record, "phase": "end"})
            return response
        finally:
            client.srem(key, call)


#: Two calls at a time across the fleet: the fake provider never has to refuse one.
limited = Agent(
    name="limited",
    model=FussyProvider("guarded"),
    instructions="Limited crash-test agent.",
    tools=TOOLS,
    max_steps=50,
    tool_concurrency=4,
    model_limit=ModelLimit("crash-guarded", concurrent=2),
)
#: A key with no numbers: nothing holds the calls back, but a 429's Retry-After holds every caller of the key.
unguarded = Agent(
    name="unguarded",
    model=FussyProvider("open"),
    instructions="Unguarded crash-test agent.",
    tools=TOOLS,
    max_steps=50,
    tool_concurrency=4,
    model_limit=ModelLimit("crash-open"),
)
