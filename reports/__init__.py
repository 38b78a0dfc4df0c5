"""The benchmark pipeline's Python side: matrix expansion, one cell's run, aggregation, projection, the report.

Read in the order the Snakefile runs them: ``matrix`` (+ ``matrix_spec``: the matrix YAML, parsed and checked),
``limits`` (probe rule), ``cell`` (run rule), ``aggregate``, ``project``, then the report: ``tables``,
``figures``, ``timeline``, ``methods``, ``html`` and ``render`` (``python -m reports``). docs/pipeline.md.
"""
