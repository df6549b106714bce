"""The test harness: the launcher (launch), cases, the single-process reference, the parity
metric, model builders and the launches' workers, shared by the suite's folders."""
