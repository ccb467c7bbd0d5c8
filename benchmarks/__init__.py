"""loracc's benchmarks, one tool: ``python -m benchmarks <subcommand> [options]``.

``harness.py`` times (CUDA events, warm-up, medians, peak memory) and records (one JSON schema with
its provenance: commit, versions, device, command) for every subcommand; ``workloads.py`` holds
the model shapes, the methods compared and the optimizer. A subcommand is a module with a
``main(argv) -> int`` and a line in ``__main__.SUBCOMMANDS``.
"""
