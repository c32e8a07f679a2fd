"""History workers (RhymeRL sections 4.2 and 5.3): Ray actors on idle CPUs that keep each
prompt's last rollouts (for HistoSpec drafting) and its length statistics (for HistoPipe).

* ``store``: the per-prompt data, statistics and snapshots (``HistoryStore``), and the history
  provider over a store in this process (``LocalHistory``).
* ``worker``: the actor (``HistoryWorker``) and the driver-side client (``HistoryClient``).
"""

from verl_ext.history.store import HistoryCorrupt, HistoryStore, LocalHistory, Trajectory, history_weight
from verl_ext.history.worker import HistoryClient, HistoryWorker

__all__ = ["HistoryClient", "HistoryCorrupt", "HistoryStore", "HistoryWorker", "LocalHistory", "Trajectory",
           "history_weight"]
