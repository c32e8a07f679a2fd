"""Which trajectory a ``generate`` call belongs to, inside veRL's agent-loop workers.

veRL's agent loops call ``LLMServerClient.generate(request_id, prompt_ids=..., ...)`` without the
prompt's ``uid`` (its GRPO group). verl_ext's agent-loop workers (``verl_ext.rollout.workers_v0``,
``workers_v1``) run each trajectory with ``TRAJECTORY_UID`` set to its ``uid``; the task that runs
the agent loop, and every task it starts, see it, so the dispatching client
(``verl_ext.rollout.manager``) can send it along. Without it (another worker class) the
dispatcher groups requests by prompt tokens alone.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional

TRAJECTORY_UID: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("verl_ext_trajectory_uid", default=None)


@contextlib.contextmanager
def trajectory(uid: Any) -> Iterator[None]:
    """Run the body as the trajectory of prompt ``uid`` (None: unknown)."""
    token = TRAJECTORY_UID.set(None if uid is None else str(uid))
    try:
        yield
    finally:
        TRAJECTORY_UID.reset(token)
