"""The sharding ILP of one unit: the model and its solve (:mod:`.solver`, which opens with the
formulation), its memory row (:mod:`.memory_row`), HiGHS as it runs it (:mod:`.highs`) and a
solution (:mod:`.solution`)."""
