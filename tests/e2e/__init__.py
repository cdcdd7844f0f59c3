"""End-to-end tests: real processes (LocalCluster ranks, proxies, subprocesses), each such test marked `slow`
(test_local.py also holds LocalCluster's in-process argument and codec checks, which are not). The folders beside
this one mirror the package; `-m "not slow"` runs what needs no process of its own."""
