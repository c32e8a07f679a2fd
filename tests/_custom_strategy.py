"""A third-party strategy, named by import path in tests (never registered)."""

import dataclasses

from verl_ext.pipe import Strategy


@dataclasses.dataclass(frozen=True)
class LastOptions:
    tag: str = "x"


class LastInstance(Strategy):
    """Sends every request to the last instance by name."""

    Options = LastOptions

    def __init__(self, options=None):
        super().__init__(options)
        self.sent = 0

    async def submit(self, request, pool):
        self.sent += 1
        return await pool.run(pool.instances[sorted(pool.instances)[-1]], request)

    def metrics(self):
        return {"sent": float(self.sent)}


class NotAStrategy:
    pass
