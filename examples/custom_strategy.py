"""Register a custom strategy and compare it with `baseline`.

    python examples/custom_strategy.py        # runs `verl-ext ab --strategies baseline,round_robin`

A strategy implements `submit(request, pool)`: pick an instance (or several, for chunks) and
run the request through `pool.run`, which keeps load and timing accounting uniform. Once
registered, the name works in `verl-ext ab --strategies ...`. In veRL, name it by import path on
top of `rollout=baseline` (the module must be importable where veRL runs, e.g. installed):

    python -m verl.trainer.main_ppo rollout=baseline \
        actor_rollout_ref.rollout.custom.verl_ext.strategy=my_pkg.my_mod:RoundRobinStrategy \
        +actor_rollout_ref.rollout.custom.verl_ext.options.start=1

or declare it in your package's `verl_ext.strategies` entry-point group
(`round_robin = my_pkg.my_mod:RoundRobinStrategy`) and use its name.
"""

import dataclasses
import itertools
import sys

from verl_ext.pipe import Strategy, register_strategy


@dataclasses.dataclass(frozen=True)
class RoundRobinOptions:
    start: int = 0  # index of the first instance


@register_strategy("round_robin")
class RoundRobinStrategy(Strategy):
    """Ignores load and sends request i to instance (start + i) mod N."""

    Options = RoundRobinOptions

    def __init__(self, options=None):
        super().__init__(options)
        self._counter = itertools.count(self.options.start)
        self.dispatched = 0

    async def submit(self, request, pool):
        names = sorted(pool.instances)
        instance = pool.instances[names[next(self._counter) % len(names)]]
        self.dispatched += 1
        return await pool.run(instance, request)

    def metrics(self):
        return {"dispatched": float(self.dispatched)}


if __name__ == "__main__":
    from verl_ext.cli import main

    sys.exit(main(["ab", "--strategies", "baseline,round_robin", "--prompts", "8", "--out", "runs/custom_strategy", *sys.argv[1:]]))
