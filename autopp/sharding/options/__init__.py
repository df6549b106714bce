"""What each node of a unit's joint graph may do: its options (:mod:`.option`), enumerated from
DTensor's own rules (:mod:`.strategies`), and the ops whose kernel communicates, which add
options of their own (:mod:`.op_hooks`, :mod:`.expert_dispatch`)."""
