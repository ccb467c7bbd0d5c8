"""loracc's benchmarks, one tool: ``python -m benchmarks <subcommand> [options]``.

``harness.py`` times (CUDA events, warm-up, medians, peak memory) and records (one JSON schema,
``{"run": provenance, "records": [...]}``, with the date, device, versions, command and commit) for
every subcommand; ``workloads.py`` holds the model shapes, the methods compared and the optimizer,
``varlen.py`` the varying-length data and ``diffusion.py`` the diffusion models' inputs and loss.
A run writes into ``benchmarks/results/<date>-<device>-<commit>/``; ``report`` turns a run folder
into its README.md, ``index`` lists the runs, ``readme`` fills README.md's results table. A
subcommand is a module with a ``main(argv) -> int`` and a line in ``__main__.SUBCOMMANDS``.
Imports go one way: harness, diffusion ← workloads ← varlen ← report, runner ← step ← memory_budget;
report ← results_index, readme_table.
"""
