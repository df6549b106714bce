"""A stage from its units' solutions: distinct units traced and solved once per boundary pair
and chained by dynamic programming (:mod:`.blocks`), under a memory budget by a Lagrangian
price (:mod:`.budget`, :mod:`.mix`, :mod:`.over_budget`), and with the schedule's windows for
the once-per-step collectives (:mod:`.once_per_step`)."""
