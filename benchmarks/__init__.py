"""The benchmarks: each module is run from the repository root as ``python -m benchmarks.<name>`` (``run``,
``recompute``, ``step_time``, ``loss``, ``overhead``, ``coverage``, ``plot_real_scale``), so that they import each
other and the tests' zoo as packages, with no edits of ``sys.path``. See ``benchmarks/README.md``."""
