"""Tools: the ``autopar`` command line, ``explain`` (analysis + renderers), the benchmark harness, the demo."""
