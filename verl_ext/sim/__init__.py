"""The trace-driven cluster simulator (``verl-ext sim``): the same strategies and drafting rules as
on real engines, over simulated instances in virtual time.

* ``clock``: the virtual-time asyncio loop, so strategies run unchanged;
* ``instance``: ``SimInstance``, the ``Instance`` contract over a cost model and a trace;
  ``kv_pool``: Seer's global KV pool; ``dispatcher``: veRL's one-actor dispatcher;
  ``host_costs``: the measured host-side costs of the real paths;
* ``source`` / ``workload``: what each request emits (the trace's response) and which epoch runs;
* ``drafting``: speculative decoding by exact-match replay with the real draft index;
  ``synthetic``: draft-model methods a trace cannot replay; ``calibration``: similarity levels
  against the papers' figures;
* ``runner`` / ``report`` / ``defaults``: one simulated rollout per arm and its report;
  ``pipeline``: consecutive training steps.
"""
