"""The roof: the command line (``python -m pipeline``, ``trtpipe``).

* :mod:`.app`: the argument parser, the command table and ``main``.

May import anything in the package; nothing imports it but ``pipeline.__main__`` and ``pipeline.docs_reference``.
"""
