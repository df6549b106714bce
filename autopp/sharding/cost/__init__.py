"""What an option and a redistribution cost: compute and communication time
(:mod:`.model`), the largest tensor a redistribution makes (:mod:`.redistribution_peaks`),
and the loss at the end of the last stage (:mod:`.loss`)."""
